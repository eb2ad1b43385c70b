"""fit_batch_size against a real GPU's memory (``cuda`` marker: skipped without one)."""

from __future__ import annotations

import pytest
import torch

import anydevice as ad

pytestmark = pytest.mark.cuda

MiB = 2**20


def test_fit_batch_size_finds_the_real_limit_of_the_gpu():
    dev = torch.device("cuda", 0)
    unit = 256 * MiB  # one "sample"

    def step(batch_size: int) -> None:
        x = torch.empty(batch_size * unit, dtype=torch.uint8, device=dev)
        x.fill_(1)

    ad.free_memory(dev)
    free, _ = torch.cuda.mem_get_info(dev)
    found = ad.fit_batch_size(step, start=8, device=dev)
    assert found * unit <= free
    assert (found + 2) * unit > free  # close to what is free (allocator rounding aside)
    step(found)  # it fits...
    ad.free_memory(dev)
    with pytest.raises(torch.OutOfMemoryError):
        step(found + 1)  # ...and one more does not
    ad.free_memory(dev)
