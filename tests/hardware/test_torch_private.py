"""Every private torch name anydevice uses, checked against the torch these tests run on.

``anydevice.hardware.backends.torch_private`` is the one place that touches them. A torch release
that renames or drops one fails here by name, before a user meets an ``AttributeError``
or a silently different answer.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from anydevice.hardware.backends import torch_private as tp

CUDA_BUILD = torch.version.cuda is not None


@pytest.mark.parametrize("name", sorted(tp.NAMES))
def test_each_private_name_is_where_this_build_should_have_it(name: str) -> None:
    where, builds = tp.NAMES[name]
    present = hasattr(importlib.import_module(where), name)
    if builds == "all" or CUDA_BUILD:
        assert present, f"{where}.{name} is gone from torch {torch.__version__}"


def test_privateuse1_name_is_the_slots_name_before_and_after_a_rename() -> None:
    code = (
        "import torch\n"
        "from anydevice.hardware.backends.torch_private import privateuse1_name\n"
        "print(privateuse1_name())\n"
        "torch.utils.rename_privateuse1_backend('npuish')\n"
        "print(privateuse1_name())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["privateuseone", "npuish"]


def test_fp32_precision_nodes_read_back_what_was_stored() -> None:
    assert tp.has_fp32_precision_tree()
    before = tp.fp32_precision("mkldnn", "matmul")
    other = "tf32" if before == "ieee" else "ieee"
    try:
        tp.set_fp32_precision("mkldnn", "matmul", other)
        assert tp.fp32_precision("mkldnn", "matmul") == other
    finally:
        tp.set_fp32_precision("mkldnn", "matmul", before)
    assert tp.fp32_precision("mkldnn", "matmul") == before


def test_the_cuda_bindings_fall_back_on_a_build_without_them() -> None:
    if CUDA_BUILD:
        pytest.skip("a CUDA build: the bindings are there (checked above)")
    from anydevice.hardware.backends.cuda import cudnn_version_number, has_primary_context

    assert tp.primary_context_query() is None and tp.cudnn_binding() is None
    assert cudnn_version_number() is None
    assert has_primary_context(0) is False
    assert not torch.cuda.is_initialized()


def test_the_host_cache_is_emptied_through_the_public_name_where_torch_has_it() -> None:
    empty = tp.host_empty_cache()
    public = getattr(torch.accelerator, "empty_host_cache", None)
    assert empty is (public if public is not None else torch._C._host_emptyCache)


def test_process_groups_lists_the_default_group_and_the_ones_made_from_it(tmp_path) -> None:
    # In a child: a real one-rank gloo world, made and destroyed there.
    code = (
        "import torch.distributed as dist\n"
        "from anydevice.hardware.backends.torch_private import process_groups\n"
        "assert process_groups() == []\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
        "world_size=1)\n"
        "sub = dist.new_group([0])\n"
        "groups = process_groups()\n"
        "assert groups[0] is dist.group.WORLD and sub in groups and len(groups) == 2, groups\n"
        "dist.destroy_process_group()\n"
        "assert process_groups() == []\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_flight_record_counts_each_groups_collectives_and_names_the_last(tmp_path) -> None:
    # In a child: a real one-rank gloo world with a subgroup; again with the recorder off.
    code = (
        "import torch, torch.distributed as dist\n"
        "from anydevice.hardware.backends.torch_private import flight_record\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
        "world_size=1)\n"
        "sub = dist.new_group([0])\n"
        "t = torch.ones(3, dtype=torch.float64)\n"
        "dist.all_reduce(t); dist.all_reduce(t); dist.broadcast(t, 0, group=sub)\n"
        "status = flight_record(entries=False)['pg_status']\n"
        "print(sorted((k, v['last_enqueued_collective']) for k, v in status.items()))\n"
        "entries = flight_record(entries=True)['entries']\n"
        "last = entries[-1] if entries else {}\n"
        "print(last.get('profiling_name'), last.get('collective_seq_id'), "
        "last.get('input_sizes'), last.get('input_dtypes'), 'frames' in last)\n"
        "dist.destroy_process_group()\n"
    )
    for buffer, expected in (
        ("2000", ["[('0', 2), ('1', 1)]", "gloo:broadcast 1 [[3]] ['Double'] False"]),
        ("0", ["[]", "None None None None False"]),
    ):
        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": buffer}
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == expected, buffer
