"""The README's quick start runs as written, on this machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_quick_start_runs():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert code is not None
    assert len(code.group(1).splitlines()) <= 15
    out = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "torch.Size([4, 2])" in out.stdout


def test_measure_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "measure.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Measurement('forward, batch 64'" in out.stdout
    assert "largest batch that fits:" in out.stdout and "MemoryUsage(" in out.stdout


# ----------------------------------------------------------------------------- snippets

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Before a block: ``<!-- no-run: why -->``, for a snippet that needs what a test here lacks.
NO_RUN = re.compile(r"<!-- no-run: (.+?) -->\s*\Z", re.S)
#: Blocks that say why they cannot run here, per file: a new one must be counted here.
NOT_RUN = {"README.md": 1, "docs/design.md": 1}

#: What the snippets take as given: a small model and batch, a loader, an optimizer (and the
#: imports, for a fragment; a snippet that starts with imports must bring all it uses). Each
#: snippet starts from a fresh copy, in its own empty working folder.
PRELUDE = """
import torch
from pathlib import Path
from torch import nn
import anydevice as ad

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.attn(x))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

made = []

def make_model():
    made.append(GPT())
    return made[-1]

def make_loader():
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    return torch.utils.data.DataLoader(data, batch_size=4)

def make_optimizer():  # for the model made last, as in ad.prepare(make_model(), ...)
    return torch.optim.SGD(made[-1].parameters(), lr=0.1)

device = ad.device()
model = make_model().to(device)
optimizer = opt = make_optimizer()
loader = make_loader()
x, y = next(iter(loader))
loss_fn = nn.functional.cross_entropy
loss = loss_fn(model(x), y)
a = b = torch.randn(64, 64)
path = "ckpt"

def step(batch=None):
    model(x).sum().backward()
"""

RUNNER = """
import json, os, sys, tempfile, traceback
prelude, snippets, shared = json.load(sys.stdin)
failed = {}
scope = None
for name, code in snippets:
    os.chdir(tempfile.mkdtemp())
    given = {"__name__": "prelude"}
    try:
        exec(compile(prelude, "<prelude>", "exec"), given)
        own = code.startswith(("import ", "from "))  # a program: its imports are its own
        if scope is None or not shared:
            mine = ("torch", "nn", "ad", "Path") if own else ()
            scope = {k: v for k, v in given.items() if k not in mine}
        scope["__name__"] = "__main__"
        exec(compile(code, name, "exec"), scope)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def snippets() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every ```python block of the README and docs: (runnable, not runnable), each as
    (``file:line``, code or the reason it does not run here)."""
    runnable, not_run = [], []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            name = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            why = NO_RUN.search(text[: m.start()][-300:])
            if why:
                not_run.append((name, why.group(1)))
            else:
                runnable.append((name, m.group(1)))
    return runnable, not_run


def test_every_python_snippet_in_the_readme_and_docs_runs():
    runnable, not_run = snippets()
    assert len(runnable) >= 8
    counted = {str(d.relative_to(ROOT)): 0 for d in DOCS}
    for name, _ in not_run:
        counted[name.split(":")[0]] += 1
    assert {k: v for k, v in counted.items() if v} == NOT_RUN, not_run
    # A snippet that registers the simulated accelerator changes its process for good
    # ("auto" picks it from then on): those of one file run, in order, in a process of
    # their own, as one program (the prelude's own device stays the CPU).
    simulated: dict[str, list[tuple[str, str]]] = {}
    together = []
    for name, code in runnable:
        if "testing." in code:
            simulated.setdefault(name.split(":")[0], []).append((name, code))
        else:
            together.append((name, code))
    failed: dict[str, str] = {}
    for shared, group in [(False, together), *((True, g) for g in simulated.values())]:
        env = {**os.environ, "ANYDEVICE_DEVICE": "cpu"} if shared else None
        out = subprocess.run(
            [sys.executable, "-c", RUNNER],
            input=json.dumps([PRELUDE, group, shared]),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        failed |= json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{name}:\n{tb}" for name, tb in failed.items())
