"""Selection: the spec grammar, and the policies on hand-built machines (0, 1, 2, 8 GPUs)."""

from __future__ import annotations

import logging

import pytest
import torch

import anydevice as ad
from anydevice.errors import DeviceNotFoundError, DeviceSpecError, VisibilityError
from anydevice.hardware.backends.cuda import cuda_built
from anydevice.hardware.facts import DeviceInfo, ProcessInfo, parse_size
from anydevice.hardware.selection import select, select_all, try_gpu_in
from anydevice.hardware.spec import Spec, parse_spec
from anydevice.hardware.visibility import visible_value
from machines import GiB, gpu, machine


def pick(spec, inv, **kw):
    return select(parse_spec(spec), inv, environ=kw.pop("environ", {}), **kw).spec


# ----------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(
    ("text", "kind", "index"),
    [
        ("auto", "auto", None),
        ("AUTO", "auto", None),
        (" cpu ", "cpu", None),
        ("cpu:0", "cpu", None),
        ("gpu", "gpu", None),
        ("GPU:1", "gpu", 1),
        ("cuda", "cuda", None),
        ("Cuda:3", "cuda", 3),
        ("mps", "mps", None),
        ("xpu:1", "xpu", 1),
        ("xla:0", "xla", 0),
        ("tpu", "xla", None),
        ("free", "free", None),
        ("2", "gpu", 2),
        (2, "gpu", 2),
        (torch.device("cuda", 1), "cuda", 1),
        (torch.device("cpu"), "cpu", None),
        ("meta", "meta", None),
    ],
)
def test_parse_spec_accepts_the_grammar(text, kind, index):
    spec = parse_spec(text)
    assert (spec.kind, spec.index) == (kind, index)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("gpu:-1", "negative"),
        (-1, "negative"),
        ("cuda:0,1", "several devices"),
        ("cuda:x", "whole number"),
        ("cuda:", "whole number"),
        ("cpu:1", "one CPU"),
        ("auto:1", "takes no index"),
        ("free:0", "takes no index"),
        ("cdua", "Did you mean 'cuda'"),
        ("npu", "Unknown device 'npu'"),
    ],
)
def test_parse_spec_rejects_malformed_text_with_a_value_error(text, match):
    with pytest.raises(DeviceSpecError, match=match) as info:
        parse_spec(text)
    assert isinstance(info.value, ValueError)


def test_unknown_spec_lists_every_spelling_the_docs_list():
    # tpu[:i] and a registered backend's <name>[:i] are accepted, so the message lists them.
    with pytest.raises(DeviceSpecError) as info:
        parse_spec("bogus")
    message = str(info.value)
    for spelling in ("gpu[:i]", "cuda[:i]", "xla[:i]", "tpu[:i]", "<name>[:i]", "meta", "free"):
        assert spelling in message, spelling


@pytest.mark.parametrize("bad", [True, 1.5, None, ["cuda"]])
def test_parse_spec_rejects_other_types(bad):
    with pytest.raises(TypeError, match="str, int or torch.device"):
        parse_spec(bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8GiB", 8 * GiB),
        ("8G", 8 * GiB),
        ("8gb", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", int(1.5 * GiB)),
        (1024, 1024),
        ("100", 100),
    ],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["8 parsecs", "lots", "-1G", ""])
def test_parse_size_rejects_nonsense(bad):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(bad)


# ----------------------------------------------------------------------------- no GPU


def test_no_gpu_auto_is_cpu_and_gpu_lists_fall_back_to_cpu():
    inv = machine()
    assert pick("auto", inv) == "cpu"
    assert [d.spec for d in select_all(Spec("gpu"), inv)] == ["cpu"]
    assert [d.spec for d in select_all(Spec("auto"), inv)] == ["cpu"]


@pytest.mark.parametrize("spec", ["gpu", "cuda", "cuda:0", 0, "free"])
def test_no_gpu_explicit_gpu_specs_raise_naming_what_exists(spec):
    with pytest.raises(DeviceNotFoundError, match="only the CPU") as info:
        pick(spec, machine())
    assert isinstance(info.value, LookupError)


def test_cpu_torch_on_a_gpu_machine_says_to_install_a_cuda_build():
    inv = machine(torch_build="CPU", cuda_runtime=None, nvidia_gpus=2, driver_cuda="12.4")
    message = str(pytest.raises(DeviceNotFoundError, pick, "cuda", inv).value)
    if not cuda_built():  # the reason names this process's torch
        assert "CPU-only" in message
        assert "cu124" in message


def test_mps_off_a_mac_says_so():
    message = str(pytest.raises(DeviceNotFoundError, pick, "mps", machine()).value)
    assert "Apple" in message


def test_xla_without_torch_xla_names_the_package():
    message = str(pytest.raises(DeviceNotFoundError, pick, "tpu", machine()).value)
    assert "torch_xla" in message


# ----------------------------------------------------------------------------- one GPU


def test_one_gpu_specs():
    inv = machine(gpu(0))
    for spec in ("auto", "gpu", "gpu:0", "cuda", "cuda:0", 0, "0", "free"):
        assert pick(spec, inv) == "cuda:0", spec
    assert pick("cpu", inv) == "cpu"


def test_index_past_the_end_names_what_exists():
    inv = machine(gpu(0))
    message = str(pytest.raises(DeviceNotFoundError, pick, "cuda:3", inv).value)
    assert message == (
        "Requested 'cuda:3', but 1 CUDA device is visible. Use cuda:0, or run "
        "`anydevice info` to see what is here."
    )


def test_index_message_shows_cuda_visible_devices():
    inv = machine(gpu(0), gpu(1))
    message = str(
        pytest.raises(
            DeviceNotFoundError, pick, "cuda:3", inv, environ={"CUDA_VISIBLE_DEVICES": "0,1"}
        ).value
    )
    assert "2 CUDA devices are visible (CUDA_VISIBLE_DEVICES='0,1')" in message
    assert "Use cuda:0 or cuda:1" in message


def test_index_message_shows_the_kinds_own_visibility_variable():
    xpus = tuple(DeviceInfo(kind="xpu", index=i, name="Intel Arc") for i in range(2))
    inv = machine(others=xpus)
    env = {"ZE_AFFINITY_MASK": "0,1", "CUDA_VISIBLE_DEVICES": "3"}
    message = str(pytest.raises(DeviceNotFoundError, pick, "xpu:2", inv, environ=env).value)
    assert "(ZE_AFFINITY_MASK='0,1')" in message
    assert "CUDA_VISIBLE_DEVICES" not in message


def test_try_gpu_falls_back_with_one_warning_naming_what_exists(caplog):
    inv = machine(gpu(0))
    with caplog.at_level(logging.INFO, logger="anydevice"):
        assert try_gpu_in(inv, 10).spec == "cpu"
    assert len(caplog.records) == 1
    record = caplog.records[0]
    assert record.levelno == logging.WARNING
    assert "try_gpu(10)" in record.getMessage()
    assert "cuda:0 'NVIDIA H100 80GB HBM3'" in record.getMessage()
    assert try_gpu_in(inv, 0).spec == "cuda:0"


def test_try_gpu_warns_when_torch_cannot_use_the_gpus_present(caplog):
    inv = machine(torch_build="CPU", cuda_runtime=None, nvidia_gpus=1)
    with caplog.at_level(logging.INFO, logger="anydevice"):
        assert try_gpu_in(inv).spec == "cpu"
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "1 NVIDIA GPU(s) are in this machine" in caplog.records[0].getMessage()


def test_try_gpu_on_a_machine_without_gpu_only_informs(caplog):
    with caplog.at_level(logging.INFO, logger="anydevice"):
        assert try_gpu_in(machine()).spec == "cpu"
    assert [r.levelno for r in caplog.records] == [logging.INFO]


# ----------------------------------------------------------------------------- several GPUs


def test_eight_gpus_select_all_and_by_index():
    inv = machine(*(gpu(i) for i in range(8)))
    assert [d.spec for d in select_all(Spec("cuda"), inv)] == [f"cuda:{i}" for i in range(8)]
    assert pick("gpu:7", inv) == "cuda:7"
    assert pick(5, inv) == "cuda:5"


def test_free_picks_most_free_memory_then_lowest_utilisation_then_lowest_index():
    inv = machine(
        gpu(0, free=10 * GiB),
        gpu(1, free=70 * GiB, util=50.0),
        gpu(2, free=70 * GiB, util=5.0),
        gpu(3, free=70 * GiB, util=5.0),
        gpu(4, free=20 * GiB),
    )
    assert pick("free", inv) == "cuda:2"
    order = [d.spec for d in select_all(Spec("free"), inv)]
    assert order == ["cuda:2", "cuda:3", "cuda:1", "cuda:4", "cuda:0"]


def test_free_with_unknown_memory_refuses_and_says_why():
    inv = machine(gpu(0, memory_free=None), notes=("NVML library not found (libnvidia-ml)",))
    message = str(pytest.raises(DeviceNotFoundError, pick, "free", inv).value)
    assert "unknown for cuda:0" in message
    assert "NVML library not found" in message


def test_need_memory_picks_the_first_gpu_that_fits():
    inv = machine(gpu(0, free=2 * GiB), gpu(1, free=9 * GiB), gpu(2, free=30 * GiB))
    assert pick("cuda", inv, need_memory=8 * GiB) == "cuda:1"
    assert pick("auto", inv, need_memory=8 * GiB) == "cuda:1"
    assert pick("free", inv, need_memory=8 * GiB) == "cuda:2"
    assert pick("cuda:2", inv, need_memory=8 * GiB) == "cuda:2"


def test_need_memory_on_full_gpus_lists_free_memory_per_gpu():
    inv = machine(gpu(0, free=1 * GiB), gpu(1, free=3 * GiB))
    message = str(pytest.raises(DeviceNotFoundError, pick, "cuda", inv, need_memory=8 * GiB).value)
    assert "need_memory=8.0 GiB" in message
    assert "cuda:0 1.0 GiB free of 80.0 GiB" in message
    assert "cuda:1 3.0 GiB free of 80.0 GiB" in message
    with pytest.raises(DeviceNotFoundError, match="cuda:0 1.0 GiB"):
        pick("cuda:0", inv, need_memory=8 * GiB)


def test_auto_on_full_gpus_with_need_memory_raises_instead_of_silently_using_cpu():
    inv = machine(gpu(0, free=1 * GiB))
    with pytest.raises(DeviceNotFoundError, match="need_memory"):
        pick("auto", inv, need_memory=8 * GiB)


def test_cpu_need_memory_checks_available_ram():
    inv = machine()
    assert pick("cpu", inv, need_memory=1 * GiB) == "cpu"
    with pytest.raises(DeviceNotFoundError, match="cpu 48.0 GiB free"):
        pick("cpu", inv, need_memory=100 * GiB)


def test_mixed_models_and_mig_devices_are_selectable_by_index():
    inv = machine(
        gpu(0, "A100", smi=1),
        gpu(1, "T4", smi=0),
        gpu(2, "A100", mig_parent="GPU-x", name="NVIDIA A100 MIG 3g.20gb", memory_total=20 * GiB),
    )
    assert pick("cuda:1", inv) == "cuda:1"
    assert select(Spec("cuda", 2), inv).mig_parent == "GPU-x"


def test_auto_under_a_launcher_uses_this_ranks_gpu():
    inv = machine(gpu(0), gpu(1), gpu(2), gpu(3))
    assert pick("auto", inv, environ={"LOCAL_RANK": "2"}) == "cuda:2"


def test_auto_with_more_ranks_than_gpus_shares_and_warns(caplog):
    inv = machine(gpu(0), gpu(1))
    with caplog.at_level(logging.WARNING, logger="anydevice"):
        assert pick("auto", inv, environ={"LOCAL_RANK": "3"}) == "cuda:1"
    assert "LOCAL_RANK=3 but only 2" in caplog.text


def test_full_gpus_are_still_selected_by_plain_specs():
    procs = (ProcessInfo(1234, "python", 79 * GiB),)
    inv = machine(gpu(0, free=0, procs=procs))
    assert pick("auto", inv) == "cuda:0"


def test_gpu_means_mps_or_xpu_where_there_is_no_cuda():
    from anydevice.hardware.facts import DeviceInfo

    mps = DeviceInfo(kind="mps", index=0, name="Apple M3 GPU", memory_total=GiB, memory_free=GiB)
    inv = machine(others=(mps,))
    assert pick("gpu", inv) == "mps:0"
    assert pick("auto", inv) == "mps:0"


# ----------------------------------------------------------------------------- this machine


def test_device_cpu_and_meta_need_no_lookup():
    assert ad.device("cpu") == torch.device("cpu")
    assert ad.device(torch.device("cpu")) == torch.device("cpu")
    assert ad.device("meta") == torch.device("meta")


def test_device_auto_matches_this_machine():
    got = ad.device()
    assert got.type in ("cpu", "cuda", "mps", "xpu", "xla")
    assert got == ad.devices("auto")[0]


def test_anydevice_device_overrides_auto(monkeypatch):
    monkeypatch.setenv("ANYDEVICE_DEVICE", "cpu")
    assert ad.device() == torch.device("cpu")
    assert ad.device("auto") == torch.device("cpu")


def test_anydevice_device_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("ANYDEVICE_DEVICE", "cdua:0")
    with pytest.raises(DeviceSpecError, match="from ANYDEVICE_DEVICE"):
        ad.device()
    monkeypatch.setenv("ANYDEVICE_DEVICE", "mps")
    if not torch.backends.mps.is_available():
        with pytest.raises(DeviceNotFoundError, match="from ANYDEVICE_DEVICE"):
            ad.device()


def test_devices_lists_and_dedupes():
    assert ad.devices("cpu") == [torch.device("cpu")]
    assert ad.devices(["cpu", "cpu"]) == [torch.device("cpu")]
    assert ad.devices("gpu") == ad.try_all_gpus()


def test_try_gpu_on_this_machine():
    all_gpus = ad.try_all_gpus()
    if all_gpus == [torch.device("cpu")]:
        assert ad.try_gpu() == torch.device("cpu")
    else:
        assert ad.try_gpu(0) == all_gpus[0]
    assert ad.try_gpu(10_000) == torch.device("cpu")
    with pytest.raises(DeviceSpecError):
        ad.try_gpu(-1)


def test_describe_gives_live_readings_of_the_cpu():
    info = ad.describe("cpu")
    assert info.kind == "cpu"
    assert info.memory_total and info.memory_free
    assert 0 < info.memory_free <= info.memory_total


# ----------------------------------------------------------------------------- visibility


def test_visible_value_writes_uuids_for_todays_indices():
    gpus = [gpu(i) for i in range(4)]
    assert visible_value([2, 0], gpus, None) == f"{gpus[2].uuid},{gpus[0].uuid}"
    assert visible_value(["GPU-3333"], gpus, "0,1,2,3") == gpus[3].uuid


def test_visible_value_without_uuids_composes_with_the_current_variable():
    gpus = [gpu(i, uuid=None) for i in range(3)]
    assert visible_value([0, 2], gpus, "3,5,7") == "3,7"
    assert visible_value([1], gpus, None) == "1"


@pytest.mark.parametrize(
    ("wanted", "match"),
    [([5], "cuda:5 is not visible"), (["GPU-9"], "matches no"), (["GPU-"], "more than one")],
)
def test_visible_value_rejects_what_is_not_visible(wanted, match):
    with pytest.raises(DeviceNotFoundError, match=match):
        visible_value(wanted, [gpu(0), gpu(1)], None)


def test_visible_value_rejects_duplicates():
    with pytest.raises(DeviceSpecError, match="twice"):
        visible_value([0, 0], [gpu(0), gpu(1)], None)


def test_restrict_visible_without_cuda_devices_leaves_the_variable_alone(monkeypatch):
    if cuda_built():
        pytest.skip("covered by the cuda tests on a GPU machine")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceNotFoundError, match="no CUDA device is visible"):
        ad.restrict_visible("0,2")
    import os

    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_restrict_visible_rejects_nonsense():
    with pytest.raises(DeviceSpecError):
        ad.restrict_visible([])
    with pytest.raises(DeviceSpecError):
        ad.restrict_visible([1.5])  # type: ignore[list-item]


def test_visibility_error_is_a_runtime_error():
    assert issubclass(VisibilityError, RuntimeError)


# ----------------------------------------------------------------------------- current device


def test_bare_cuda_names_the_current_device_once_there_is_one():
    inv = machine(gpu(0), gpu(1), gpu(2))
    assert pick("cuda", inv) == "cuda:0"  # CUDA not initialised: no set_device can have run
    current = {"cuda": 2}
    assert pick("cuda", inv, current=current) == "cuda:2"
    assert pick("gpu", inv, current=current) == "cuda:2"
    assert pick("auto", inv, current=current) == "cuda:2"
    assert pick("cuda:1", inv, current=current) == "cuda:1"  # an index wins
    assert pick("cuda", inv, current={"xpu": 1}) == "cuda:0"  # another kind's current


def test_launcher_rank_wins_over_the_current_device_for_auto():
    inv = machine(gpu(0), gpu(1))
    env = {"LOCAL_RANK": "1"}
    assert pick("auto", inv, environ=env, current={"cuda": 0}) == "cuda:1"


def test_need_memory_tries_the_current_device_first():
    inv = machine(gpu(0, free=30 * GiB), gpu(1, free=2 * GiB), gpu(2, free=9 * GiB))
    assert pick("cuda", inv, need_memory=8 * GiB, current={"cuda": 2}) == "cuda:2"
    assert pick("cuda", inv, need_memory=8 * GiB, current={"cuda": 1}) == "cuda:0"
    assert pick("auto", inv, need_memory=8 * GiB, current={"cuda": 2}) == "cuda:2"


def test_looking_at_devices_on_this_machine_initialises_nothing():
    from anydevice.hardware.selection import current_indices

    assert ad.device("cpu") == torch.device("cpu")
    ad.devices("auto")
    assert not torch.cuda.is_initialized()
    assert "cuda" not in current_indices()


# ----------------------------------------------------------------------------- raw errors


def test_devices_of_none_is_a_type_error_that_says_what_to_pass():
    with pytest.raises(TypeError, match=r"not NoneType \(None\).*'auto'"):
        ad.devices(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("need", [float("nan"), float("inf"), -float("inf")])
def test_need_memory_that_is_not_a_finite_size_is_a_spec_error(need):
    with pytest.raises(DeviceSpecError, match="memory size"):
        ad.device("cpu", need_memory=need)


def test_try_gpu_with_a_string_index_is_a_type_error_with_the_fix():
    with pytest.raises(TypeError, match=r"try_gpu\('1'\).*try_gpu\(1\)"):
        ad.try_gpu("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ad.try_gpu(True)


def test_anydevice_device_is_read_in_one_place():
    import ast
    from pathlib import Path

    from anydevice.hardware.override import DEVICE_VARIABLE, device_override

    package = Path(ad.__file__).parent
    readers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "getenv", "pop")
                and any(
                    isinstance(a, ast.Constant) and a.value == DEVICE_VARIABLE for a in node.args
                )
            ):
                readers.append(f"{path.relative_to(package)}:{node.lineno}")
    assert readers == [], f"read by name, not through override.device_override: {readers}"
    # ... and "auto" becomes its spec by one rule (override.with_override), so no other module
    # parses the variable's value itself.
    elsewhere = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "DEVICE_VARIABLE" in p.read_text() and p.name != "override.py"
    )
    assert elsewhere == [], f"the ANYDEVICE_DEVICE rule repeated in {elsewhere}"
    assert device_override({DEVICE_VARIABLE: "  cpu "}) == "cpu"
    assert device_override({DEVICE_VARIABLE: " "}) is None


def test_meta_selects_a_device_without_data_on_any_machine():
    for inv in (machine(), machine(gpu(0))):
        chosen = select(parse_spec("meta"), inv, environ={})
        assert (chosen.kind, chosen.index, chosen.spec) == ("meta", None, "meta")
        assert chosen.name == "meta (no data)" and not chosen.memory_total
