"""Inventory and selection on a real NVIDIA GPU (``cuda`` marker: skipped without one).

Each check runs in a fresh interpreter, because the point is what anydevice does to a
process that has not touched CUDA yet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.real_gpu(
        "NVML and CUDA's state, in fresh processes (a child has no simulated GPU)"
    ),
]


def run_py(code: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_inventory_creates_no_context_and_does_not_initialise_cuda():
    r = run_py(
        """
        import json, os, torch, pynvml, anydevice as ad
        from anydevice.hardware.backends.cuda import driver_initialized
        inv = ad.inventory()
        ad.device("free"); ad.describe("cuda:0")
        pynvml.nvmlInit()
        pids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
        print(json.dumps({"torch_init": torch.cuda.is_initialized(),
                          "driver_init": driver_initialized(),
                          "our_pid_on_gpu": os.getpid() in pids,
                          "n": len(inv.of_kind("cuda"))}))
        """
    )
    assert r["n"] >= 1
    assert r == {**r, "torch_init": False, "driver_init": False, "our_pid_on_gpu": False}


def test_nvml_mapping_matches_cuda_uuids():
    # Once CUDA is initialised the inventory takes torch's own order, so the mapping read
    # from NVML is only tested while looking (telemetry, cuDNN and NCCL versions included)
    # has initialised nothing.
    r = run_py(
        """
        import json, torch, anydevice as ad
        from anydevice.hardware.backends.cuda import driver_initialized
        ours = [d.uuid for d in ad.inventory().of_kind("cuda")]
        ad.describe("cuda:0")
        looked = {"torch_init": torch.cuda.is_initialized(), "driver_init": driver_initialized()}
        theirs = [str(torch.cuda.get_device_properties(i).uuid)
                  for i in range(torch.cuda.device_count())]
        print(json.dumps({**looked, "ours": ours, "theirs": theirs}))
        """
    )
    assert r["torch_init"] is False and r["driver_init"] is False
    strip = [u.removeprefix("GPU-").removeprefix("MIG-").lower() for u in r["ours"]]
    assert strip == [u.removeprefix("GPU-").lower() for u in r["theirs"]]


def test_visible_devices_by_uuid_is_honoured():
    first = run_py(
        "import json, anydevice as ad; "
        "print(json.dumps([d.uuid for d in ad.inventory().of_kind('cuda')]))"
    )
    r = run_py(
        """
        import json, torch, anydevice as ad
        d = ad.inventory().of_kind("cuda")
        print(json.dumps({"ours": [x.uuid for x in d], "count": torch.cuda.device_count()}))
        """,
        env={"CUDA_VISIBLE_DEVICES": first[-1]},
    )
    assert r == {"ours": [first[-1]], "count": 1}


def test_driver_initialised_is_detected_and_restrict_visible_refuses():
    r = run_py(
        """
        import json, torch, anydevice as ad
        from anydevice.hardware.backends.cuda import driver_initialized
        before = driver_initialized()
        value = ad.restrict_visible("0")
        torch.cuda.is_available()  # cuInit, without torch's lazy init
        after = driver_initialized()
        try:
            ad.restrict_visible("0")
            refused = False
        except ad.VisibilityError:
            refused = True
        print(json.dumps({"before": before, "after": after, "refused": refused,
                          "value": value, "count": torch.cuda.device_count()}))
        """
    )
    assert r["before"] is False and r["after"] is True and r["refused"] is True
    assert r["value"].startswith(("GPU-", "MIG-")) and r["count"] == 1
