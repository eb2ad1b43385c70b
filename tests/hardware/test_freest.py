"""The "free" rule on hand-built inventories: ``choose_free`` and ``ad.device("free")`` agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from anydevice.errors import VisibilityError
from anydevice.hardware.freest import choose_free, cuda_indices, free_key
from anydevice.hardware.selection import select, select_all
from anydevice.hardware.spec import Spec
from machines import GiB, gpu, machine, mig, record


def specs(choice):
    return [d.spec for d in choice.picked]


def test_most_free_memory_first_then_least_busy_then_lowest_index():
    gpus = [
        gpu(0, free=10 * GiB),
        gpu(1, free=70 * GiB, util=50.0),
        gpu(2, free=70 * GiB, util=5.0),
        gpu(3, free=70 * GiB, util=5.0),
        gpu(4, free=20 * GiB),
    ]
    assert specs(choose_free(gpus, 3)) == ["cuda:2", "cuda:3", "cuda:1"]
    assert specs(choose_free(gpus, 5)) == ["cuda:2", "cuda:3", "cuda:1", "cuda:4", "cuda:0"]


def test_min_free_and_max_util_leave_gpus_out_with_the_reason():
    gpus = [gpu(0, free=4 * GiB), gpu(1, free=30 * GiB, util=80.0), gpu(2, free=20 * GiB)]
    choice = choose_free(gpus, 1, min_free=8 * GiB, max_util=30)
    assert choice.ok and specs(choice) == ["cuda:2"]
    reasons = {d.spec: r for d, r in choice.rejected}
    assert reasons == {"cuda:0": "4.0 GiB free < 8.0 GiB", "cuda:1": "80% busy > 30%"}


def test_fewer_than_wanted_is_not_ok_and_explains_each_gpu():
    gpus = [gpu(0, free=4 * GiB), gpu(1, free=30 * GiB), gpu(2, memory_free=None)]
    choice = choose_free(gpus, 2, min_free=8 * GiB)
    assert not choice.ok and specs(choice) == ["cuda:1"]
    text = choice.explain()
    assert text.splitlines()[0] == "2 GPU(s) wanted, 1 qualify:"
    assert "cuda:0 NVIDIA H100 80GB HBM3: 4.0 GiB free < 8.0 GiB" in text
    assert "cuda:1 NVIDIA H100 80GB HBM3: qualifies" in text
    assert "cuda:2 NVIDIA H100 80GB HBM3: free memory unknown" in text


def test_max_util_needs_a_known_utilisation():
    choice = choose_free([gpu(0, utilization=None)], 1, max_util=50)
    assert not choice.ok and choice.rejected[0][1] == "utilisation unknown"
    assert choose_free([gpu(0, utilization=None)], 1).ok  # without the bound it does not matter


def test_asking_for_no_gpu_is_refused():
    with pytest.raises(ValueError, match="at least one GPU"):
        choose_free([gpu(0)], 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 80), st.sampled_from([0.0, 5.0, 50.0, 100.0])),
        min_size=1,
        max_size=8,
    )
)
def test_choose_free_is_the_rule_of_device_free(readings):
    gpus = [gpu(i, free=f * GiB, util=u) for i, (f, u) in enumerate(readings)]
    inv = machine(*gpus)
    assert choose_free(gpus, 1).picked[0] == select(Spec("free"), inv)
    ranked = choose_free(gpus, len(gpus)).picked
    assert list(ranked) == select_all(Spec("free"), inv)
    assert list(ranked) == sorted(gpus, key=free_key)


# ----------------------------------------------------------------------------- --format index


def test_indices_are_cudas_among_all_gpus_whatever_is_visible_now():
    records = [record(0), record(1), record(2)]
    # This shell sees only smi 2 and 0 (as cuda:0 and cuda:1); a new value names them 2 and 0.
    picked = [gpu(0, smi=2, uuid=records[2].uuid), gpu(1, smi=0, uuid=records[0].uuid)]
    assert cuda_indices(picked, records, None) == [2, 0]


def test_indices_of_different_models_need_pci_bus_order():
    records = [record(0, "T4"), record(1, "H100")]
    picked = [gpu(0, "H100", smi=1, uuid=records[1].uuid)]
    with pytest.raises(VisibilityError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        cuda_indices(picked, records, None)
    assert cuda_indices(picked, records, "PCI_BUS_ID") == [1]


def test_mig_devices_have_no_index():
    parent = mig(record(0), 1)
    picked = [gpu(0, uuid=parent.mig_devices[0].uuid, mig_parent=parent.uuid)]
    with pytest.raises(VisibilityError, match="MIG devices are named by UUID only"):
        cuda_indices(picked, [parent], None)
