"""torch's version and build, read from its files without importing it, agree with torch."""

from __future__ import annotations

import json
import subprocess
import sys

from anydevice.hardware import torchbuild
from anydevice.hardware.backends import build_label


def test_files_give_what_torch_itself_says():
    code = (
        "import json, sys\n"
        "from anydevice.hardware import torchbuild\n"
        "b = torchbuild.read()\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "names = ('cuda', 'hip', 'xpu')\n"
        "print(json.dumps([b.version, torch.__version__, b.imported,\n"
        "    [b.toolkit(n) for n in names], [getattr(torch.version, n, None) for n in names],\n"
        "    [list(t) for t in torchbuild.read().toolkits], [list(t) for t in b.toolkits]]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    version, torch_version, imported, toolkits, torchs, after, before = json.loads(out.stdout)
    assert (version, toolkits) == (torch_version, torchs)
    assert imported is False and before == after  # the files say what the module does


def test_once_torch_is_imported_its_module_is_read():
    import torch

    build = torchbuild.read()
    assert build is not None and build.imported
    assert build.version == torch.__version__ and build.toolkit("cuda") == torch.version.cuda


def test_version_file_assignments_are_read_as_literals(tmp_path):
    f = tmp_path / "version.py"
    f.write_text(
        "from typing import Optional\n"
        "__version__ = '2.11.0+cu130'\n"
        "cuda: Optional[str] = '13.0'\n"
        "hip: Optional[str] = None\n"
        "git_version = compute()\n"
    )
    values = torchbuild._assignments(f)
    assert values == {"__version__": "2.11.0+cu130", "cuda": "13.0", "hip": None}
    assert torchbuild._assignments(tmp_path / "missing.py") == {}


def test_toolkits_are_every_other_text_the_version_file_sets(tmp_path):
    values = {"__version__": "2.11.0", "git_version": "abc", "debug": False, "cuda": "13.0"}
    assert torchbuild._toolkits({**values, "hip": None, "xpu": "", "rocm": "7.0"}) == (
        ("cuda", "13.0"),
        ("rocm", "7.0"),
    )


def test_labels_are_the_kinds_toolkits():
    def label(**toolkits: str) -> str:
        return build_label(torchbuild.TorchBuild("2.11.0", tuple(toolkits.items())))

    assert label(cuda="13.0") == "CUDA 13.0"
    assert label(hip="6.4", rocm="6.4") == "ROCm 6.4"
    assert label(xpu="20250101") == "XPU"
    assert label() == "CPU"


def test_installed_versions_and_device_extensions_come_from_dist_info(tmp_path, monkeypatch):
    (tmp_path / "nvidia_cudnn_cu12-9.10.2.21.dist-info").mkdir()
    ext = tmp_path / "torch_npu-2.11.0.dist-info"
    ext.mkdir()
    (ext / "entry_points.txt").write_text(
        "[console_scripts]\nnpu-smi = x:y\n\n[torch.backends]\ntorch_npu = torch_npu:_autoload\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert torchbuild.library_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12") == "9.10.2"
    assert torchbuild.library_version("nvidia_cudnn_cu12", parts=None) == "9.10.2.21"
    assert torchbuild.device_extensions() == ("torch_npu",)


def test_library_version_matches_importlib_metadata():
    import importlib.metadata

    assert torchbuild.library_version("psutil", parts=None) == importlib.metadata.version("psutil")
