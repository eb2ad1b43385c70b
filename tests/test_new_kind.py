"""A new device kind is one file: ``tests/quark.py`` adds ``quark``, and the rest follows.

The kind is registered in a child process (torch keeps one ``privateuse1`` backend per
process, for good); the child reports what anydevice makes of it, and each fact is
checked here. Nothing in the package names ``quark``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, TESTS)
    import anydevice as ad
    from anydevice.hardware import backends
    from anydevice.hardware.spec import parse_spec
    from anydevice.training.context import backend_for
    from anydevice.placement.mismatch import is_device_mismatch

    def _error(call):
        try:
            call()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    before = {"spec": str(_error(lambda: parse_spec("quark"))), "kinds": backends.accelerators()}
    import quark
    quark.register_kind()
    inv = ad.inventory(telemetry=False)
    others = [k for k in backends.accelerators() if k != "quark" and inv.of_kind(k)]
    p = ad.precision("quark:1")
    pair = (
        "Input type (torch.quark.FloatTensor) and weight type (torch.FloatTensor) should be "
        "the same"
    )
    print(json.dumps({
        "before": before,
        "kinds": backends.accelerators(),
        "spec": [parse_spec(s).kind for s in ("QUARK:1", "quark")] + [parse_spec("quark:1").index],
        "misspelt": str(_error(lambda: parse_spec("quork"))),
        "device": [str(ad.device(s)) for s in ("quark", "quark:1", torch.device("quark", 1))],
        "devices": [str(d) for d in ad.devices("quark")],
        "index_error": str(_error(lambda: ad.device("quark:5"))),
        "inventory": [d.spec for d in inv.of_kind("quark")],
        "others": others,
        "gpu": [str(ad.device(s)) for s in ("gpu", 1, "free")] + [str(ad.try_gpu(1))],
        "auto": [str(ad.device()), [str(d) for d in ad.devices("auto")]],
        "precision": [p.mode, p.reason, str(_error(lambda: ad.precision("quark", "fp16")))],
        "collective": [
            backends.collective_backend("quark"),
            backend_for(torch.device("quark", 0)),
            str(backends.collective_device("quarkcc")),
            str(backends.collective_device("cpu:gloo,quark:quarkcc")),
            str(backends.collective_device("gloo")),
        ],
        "mismatch": is_device_mismatch(RuntimeError(pair)),
    }))
    """
)


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    code = CHILD.replace("TESTS", repr(str(Path(__file__).parent)), 1)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return found


def test_before_registering_the_kind_is_unknown(seen):
    before = seen["before"]
    assert "DeviceSpecError: Unknown device 'quark'" in before["spec"]
    assert "quark" not in before["kinds"]


def test_it_follows_the_accelerators_already_registered(seen):
    kinds = seen["kinds"]
    assert kinds[-1] == "quark" and kinds[:-1] == seen["before"]["kinds"]


def test_the_spec_grammar_knows_it(seen):
    assert seen["spec"] == ["quark", "quark", 1]
    assert "Did you mean 'quark'?" in seen["misspelt"] and "quark[:i]" in seen["misspelt"]


def test_ad_device_and_the_inventory_find_its_devices(seen):
    assert seen["device"] == ["quark:0", "quark:1", "quark:1"]
    assert seen["devices"] == ["quark:0", "quark:1"]
    assert seen["inventory"] == ["quark:0", "quark:1"]
    assert "2 QUARK devices are visible" in seen["index_error"]


def test_gpu_and_auto_mean_it_where_no_other_accelerator_is(seen):
    if seen["others"]:
        pytest.skip(f"{seen['others']} come before quark here")
    # "free": quark:0 has the most free memory (its probe gives quark:1 one byte less)
    assert seen["gpu"] == ["quark:0", "quark:1", "quark:0", "quark:1"]
    assert seen["auto"] == ["quark:0", ["quark:0", "quark:1"]]


def test_its_own_precision_policy_decides(seen):
    mode, reason, refused = seen["precision"]
    assert (mode, reason) == ("bf16", "quark:1 (Quark 1): quarks compute in bf16")
    assert "PrecisionError" in refused and "no fp16" in refused


def test_its_collective_backend_and_device_follow(seen):
    assert seen["collective"] == ["quarkcc", "quarkcc", "quark:0", "quark:0", "cpu"]


def test_the_mismatch_report_tells_its_tensors_from_the_cpus(seen):
    assert seen["mismatch"] is True
