"""CUDA visibility and ordering: NVML records + CUDA_VISIBLE_DEVICES + CUDA_DEVICE_ORDER.

These rules are pure, so they are tested on hand-built NVML records (0 to 8 GPUs, mixed
models, MIG). What NVML and CUDA really report is checked by the ``cuda`` tests in
test_inventory_cuda.py on a GPU machine.
"""

from __future__ import annotations

import pytest

from anydevice.hardware.backends.cuda import (
    CudaBackend,
    _info,
    _strtoul,
    confirm_order,
    cuda_built,
    cuda_wheel_command,
    driver_initialized,
    visible_devices,
)
from machines import mig, record


def smi(vis):
    return [g.smi_index for g in vis.devices]


def test_no_visible_devices_variable_shows_all_in_pci_order():
    gpus = [record(i) for i in range(8)]
    vis = visible_devices(list(reversed(gpus)), None)
    assert smi(vis) == list(range(8))
    assert not vis.guessed
    assert vis.ignored == ()


def test_no_gpus_at_all():
    vis = visible_devices([], None)
    assert vis.devices == ()
    assert visible_devices([], "0").devices == ()


@pytest.mark.parametrize(
    ("cvd", "expected", "ignored"),
    [
        ("1,0", [1, 0], []),
        ("2", [2], []),
        (" 3 , 1 ", [3, 1], []),
        ("0,2,-1,1", [0, 2], ["-1", "1"]),  # CUDA's documented example
        ("0,1,5", [0, 1], ["5"]),
        ("5,0", [], ["5", "0"]),
        ("1gpu", [1], []),  # CUDA reads indices like strtoul
        ("abc,1", [], ["abc", "1"]),
    ],
)
def test_visible_devices_by_index(cvd, expected, ignored):
    vis = visible_devices([record(i) for i in range(4)], cvd)
    assert smi(vis) == expected
    assert list(vis.ignored) == ignored
    if ignored:
        assert any(repr(ignored[0].strip()) in n for n in vis.notes)


def test_empty_visible_devices_hides_every_gpu():
    vis = visible_devices([record(0), record(1)], "")
    assert vis.devices == ()


def test_repeated_entry_hides_every_gpu():
    vis = visible_devices([record(0), record(1)], "0,1,0")
    assert vis.devices == ()
    assert any("twice" in n for n in vis.notes)


def test_uuid_and_unique_prefix_select_gpus():
    gpus = [record(i) for i in range(3)]
    vis = visible_devices(gpus, f"{gpus[2].uuid},GPU-1111")
    assert smi(vis) == [2, 1]


def test_ambiguous_uuid_prefix_stops_parsing():
    gpus = [record(0), record(1)]
    vis = visible_devices(gpus, "1,GPU-,0")
    assert smi(vis) == [1]
    assert any("ambiguous" in n for n in vis.notes)


def test_unknown_uuid_stops_parsing():
    vis = visible_devices([record(0), record(1)], "GPU-deadbeef,1")
    assert vis.devices == ()
    assert vis.ignored == ("GPU-deadbeef", "1")


def test_mixed_models_fastest_first_is_a_marked_guess():
    # A T4 on the first PCI slot, an A100 on the second: CUDA's default order puts the
    # A100 first, so cuda:0 is nvidia-smi's GPU 1.
    gpus = [record(0, "T4"), record(1, "A100")]
    vis = visible_devices(gpus, None)
    assert smi(vis) == [1, 0]
    assert vis.guessed
    assert any("PCI_BUS_ID" in n for n in vis.notes)


def test_mixed_models_pci_bus_id_order_matches_nvidia_smi():
    gpus = [record(0, "T4"), record(1, "A100")]
    vis = visible_devices(gpus, None, "PCI_BUS_ID")
    assert smi(vis) == [0, 1]
    assert not vis.guessed


def test_index_in_visible_devices_follows_cuda_order_not_nvidia_smi():
    # CUDA_VISIBLE_DEVICES=0 with the default order means CUDA's device 0 (the A100 here),
    # the classic trap: nvidia-smi calls that GPU 1.
    gpus = [record(0, "T4"), record(1, "A100")]
    assert smi(visible_devices(gpus, "0")) == [1]
    assert smi(visible_devices(gpus, "0", "pci_bus_id")) == [0]


def test_uuids_make_the_order_certain_whatever_the_device_order():
    gpus = [record(0, "T4"), record(1, "A100")]
    vis = visible_devices(gpus, f"{gpus[0].uuid},{gpus[1].uuid}")
    assert smi(vis) == [0, 1]
    assert not vis.guessed


def test_unknown_device_order_value_falls_back_to_fastest_first_with_a_note():
    gpus = [record(0, "T4"), record(1, "A100")]
    vis = visible_devices(gpus, None, "SLOWEST_FIRST")
    assert smi(vis) == [1, 0]
    assert any("SLOWEST_FIRST" in n for n in vis.notes)


def test_same_model_in_any_order_is_pci_order_and_certain():
    gpus = [record(i, "A100") for i in range(4)]
    vis = visible_devices(gpus, None)
    assert smi(vis) == [0, 1, 2, 3]
    assert not vis.guessed


def test_mig_gpu_is_replaced_by_its_first_mig_device():
    gpus = [mig(record(0, "A100"), 3, 2), record(1, "A100")]
    vis = visible_devices(gpus, None)
    assert [g.uuid for g in vis.devices] == [gpus[0].mig_devices[0].uuid, gpus[1].uuid]
    assert any("only one" in n for n in vis.notes)


def test_which_of_several_mig_devices_cuda_shows_is_marked_as_a_guess():
    gpus = [mig(record(0, "A100"), 3, 2), record(1, "A100")]
    vis = visible_devices(gpus, None)
    first = gpus[0].mig_devices[0]
    assert [m.uuid for m in vis.mig_candidates] == [m.uuid for m in gpus[0].mig_devices]
    assert vis.index_guessed(vis.devices[0]) and not vis.index_guessed(vis.devices[1])
    assert not vis.guessed  # the GPUs' own order is certain
    infos = [_info(i, r, vis) for i, r in enumerate(vis.devices)]
    assert [d.index_guessed for d in infos] == [True, False]
    assert any("guess" in n for n in infos[0].notes) and infos[1].notes == ()
    assert "index guessed (MIG)" in repr(infos[0]) and first.uuid == infos[0].uuid


def test_one_mig_device_visible_is_no_guess():
    parent = mig(record(0, "A100"), 1, 1, 1)
    vis = visible_devices([parent], parent.mig_devices[1].uuid)
    assert vis.mig_candidates == () and not vis.index_guessed(vis.devices[0])


def test_torchs_uuids_confirm_or_correct_the_mig_guess():
    gpus = [mig(record(0, "A100"), 3, 2), record(1, "A100")]
    vis = visible_devices(gpus, None)
    second = gpus[0].mig_devices[1]
    confirmed = confirm_order(vis, [vis.devices[0].uuid.removeprefix("MIG-"), gpus[1].uuid])
    assert confirmed.devices == vis.devices and confirmed.mig_candidates == ()
    corrected = confirm_order(vis, [second.uuid, gpus[1].uuid.lower()])
    assert [d.uuid for d in corrected.devices] == [second.uuid, gpus[1].uuid]
    assert corrected.mig_candidates == () and not corrected.index_guessed(corrected.devices[0])
    assert any(second.uuid in n for n in corrected.notes)
    assert confirm_order(vis, ["GPU-unknown"]) == vis  # a UUID NVML did not list: unchanged


def test_mig_device_by_uuid():
    parent = mig(record(0, "A100"), 1, 1, 1)
    target = parent.mig_devices[2]
    vis = visible_devices([parent], target.uuid)
    assert [g.uuid for g in vis.devices] == [target.uuid]
    assert vis.devices[0].mig_parent == parent.uuid


def test_mig_device_by_legacy_gpu_instance_path():
    parent = mig(record(0, "A100"), 1, 1)
    vis = visible_devices([parent], f"MIG-{parent.uuid}/2/0")
    assert [g.uuid for g in vis.devices] == [parent.mig_devices[1].uuid]


def test_mig_mode_without_instances_hides_the_gpu_and_says_so():
    parent = mig(record(0, "A100"))
    vis = visible_devices([parent, record(1, "A100")], None)
    assert smi(vis) == [1]
    assert any("MIG mode but has no MIG devices" in n for n in vis.notes)


def test_strtoul_reads_leading_digits():
    assert _strtoul("12abc") == 12
    assert _strtoul("-1") == -1
    assert _strtoul("x1") is None
    assert _strtoul("") is None


@pytest.mark.parametrize(
    ("driver", "wheel"),
    [("12.4", "cu124"), ("12.5", "cu124"), ("13.1", "cu130"), ("11.2", "cu118"), (None, "cu129")],
)
def test_wheel_command_matches_the_driver(driver, wheel):
    assert cuda_wheel_command(driver).endswith(f"/whl/{wheel}")


def test_backend_on_a_cpu_build_lists_no_device_and_never_initialises_cuda():
    if cuda_built():
        pytest.skip("this torch has CUDA; the cuda tests cover it")
    probe = CudaBackend().probe()
    assert probe.devices == ()
    assert not driver_initialized()


def test_unavailable_reason_names_empty_visible_devices():
    backend = CudaBackend(environ={"CUDA_VISIBLE_DEVICES": ""})
    reason = backend.unavailable_reason()
    if cuda_built():
        assert "CUDA_VISIBLE_DEVICES" in reason
    else:
        assert "CPU-only" in reason


def test_library_versions_never_ask_torch_backends_cudnn_version(monkeypatch):
    # torch.backends.cudnn.version() checks every GPU's capability first, which initialises
    # CUDA (torch 2.11); the versions are read from the libraries alone.
    import torch

    from anydevice.hardware.backends import cuda

    asked = []
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: asked.append(1) or 90100)
    versions = cuda._library_versions()
    assert asked == []
    assert set(versions) == {"cudnn", "nccl"}
    assert not torch.cuda.is_initialized()


def test_cudnn_version_number_reads_the_binding_torch_itself_uses():
    # torch.backends.cudnn reads torch._C._cudnn; the version comes from its getVersionInt.
    import torch

    from anydevice.hardware.backends.cuda import cudnn_version_number

    binding = getattr(torch._C, "_cudnn", None)
    assert torch.backends.cudnn._cudnn is binding
    if binding is None:
        assert cudnn_version_number() is None
    else:
        assert hasattr(binding, "getVersionInt")
        assert isinstance(cudnn_version_number(), int) or not binding.is_cuda


def test_has_primary_context_name_is_there_exactly_on_cuda_builds():
    import torch

    from anydevice.hardware.backends.cuda import has_primary_context

    assert hasattr(torch._C, "_cuda_hasPrimaryContext") == cuda_built()
    if not torch.cuda.is_initialized():
        assert has_primary_context(0) is False


@pytest.mark.cuda
@pytest.mark.real_gpu("cuDNN's version, read in a fresh process (the simulated GPU has no cuDNN)")
def test_cudnn_version_without_initialising_cuda_matches_torchs():
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import json, torch
        from anydevice.hardware.backends.cuda import _library_versions, cudnn_version_number
        from anydevice.hardware.backends.cuda import driver_initialized
        ours, text = cudnn_version_number(), _library_versions()["cudnn"]
        looked = {"torch_init": torch.cuda.is_initialized(), "driver": driver_initialized()}
        print(json.dumps({**looked, "ours": ours, "text": text,
                          "theirs": torch.backends.cudnn.version()}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["torch_init"] is False and r["driver"] is False
    assert r["ours"] == r["theirs"] and r["text"].startswith(str(r["theirs"] // 10000))
