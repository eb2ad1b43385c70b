"""The README's quick start runs as written, on this machine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)  # a fresh interpreter on a busy machine
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


@pytest.mark.timeout(360)  # its own subprocess timeout, and room to report it
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
#: A block's first line, where it is a fragment of the reader's program: what it takes as
#: given, by name (what is in parentheses says what they are), e.g.
#: ``# Assumes: model, x, y, loss_fn, optimizer (your own: a step of your loop)``.
ASSUMES = re.compile(r"\A# Assumes: (.+)\n")

#: What the fragments may take as given, each by the name its ``# Assumes:`` line says: a
#: small model and batch, a loader, an optimizer and its factory. A block gets those names
#: and nothing else (no imports either), each in a fresh scope and an empty working folder.
PRELUDE = """
import functools
import torch
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

def make_model():
    return GPT()

def make_loader():
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    return torch.utils.data.DataLoader(data, batch_size=4)

make_optimizer = functools.partial(torch.optim.SGD, lr=0.1)  # given the parameters
device = ad.device()
model = make_model().to(device)
optimizer = opt = make_optimizer(model.parameters())
loader = make_loader()
x, y = next(iter(loader))
loss_fn = nn.functional.cross_entropy
a = b = torch.randn(64, 64)
path = "ckpt"

def step(batch=None):
    model(x).sum().backward()
"""

RUNNER = """
import json, os, sys, tempfile, traceback
prelude, snippets, shared = json.load(sys.stdin)
failed = {}
above = {}  # what the blocks above defined, in a file whose blocks run as one program
for name, code, assumed in snippets:
    os.chdir(tempfile.mkdtemp())
    try:
        given = {"__name__": "prelude"}
        if assumed:
            exec(compile(prelude, "<prelude>", "exec"), given)
        known = {**given, **above}
        missing = [n for n in assumed if n not in known]
        if missing:
            raise NameError(f"# Assumes: {missing}, which no set-up here defines")
        scope = {"__name__": "__main__", **{n: known[n] for n in assumed}}
        exec(compile(code, name, "exec"), scope)
        if shared:
            above.update({k: v for k, v in scope.items() if not k.startswith("__")})
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def assumed(code: str) -> list[str]:
    """The names a block's ``# Assumes:`` line gives (none: it runs as pasted).

    >>> assumed("# Assumes: model, x (a batch), make_optimizer (e.g. f(g, lr=1))\\nmodel(x)")
    ['model', 'x', 'make_optimizer']
    """
    m = ASSUMES.match(code)
    if m is None:
        return []
    text = m.group(1)
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    names = [n.strip() for n in text.split(",")]
    assert all(n.isidentifier() for n in names), f"not names: {m.group(1)!r}"
    return names


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


def test_every_readme_block_runs_as_pasted():
    """The README is what people paste first: no block there leans on names it does not
    define (they did: make_model, make_loader, loss_fn, x, y)."""
    runnable, _ = snippets()
    readme = [(name, code) for name, code in runnable if name.startswith("README.md:")]
    assert len(readme) >= 5
    assert [name for name, code in readme if assumed(code)] == []


@pytest.mark.timeout(360)
def test_a_fragment_that_leans_on_an_undefined_name_fails_here():
    """The runner gives a block only what it says it assumes: a paste that would fail
    fails here too, and an assumption the set-up cannot meet is named."""
    out = _run([("pasted", "loss = loss_fn(model(x), y)\n", []),
                ("assumes", "# Assumes: model, x\nmodel(x).sum()\n", ["model", "x"]),
                ("unknown", "# Assumes: dataset\nlen(dataset)\n", ["dataset"])], False)  # fmt: skip
    assert set(out) == {"pasted", "unknown"}, out
    assert "NameError: name 'loss_fn' is not defined" in out["pasted"]
    assert "['dataset'], which no set-up here defines" in out["unknown"]


def _run(group: list[tuple[str, str, list[str]]], shared: bool) -> dict[str, str]:
    env = {**os.environ, "ANYDEVICE_DEVICE": "cpu"} if shared else None
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([PRELUDE, group, shared]),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.long  # every fragment, each in its own process (make test-long)
@pytest.mark.timeout(600)  # the groups side by side, each bounded below
def test_every_python_snippet_in_the_readme_and_docs_runs():
    """Each block as pasted, or with exactly the names its ``# Assumes:`` line gives."""
    runnable, not_run = snippets()
    assert len(runnable) >= 8
    counted = {str(d.relative_to(ROOT)): 0 for d in DOCS}
    for name, _ in not_run:
        counted[name.split(":")[0]] += 1
    assert {k: v for k, v in counted.items() if v} == NOT_RUN, not_run
    # A snippet that registers the simulated accelerator changes its process for good
    # ("auto" picks it from then on): those of one file run, in order, in a process of
    # their own, as one program (a block may assume what one above it defined).
    simulated: dict[str, list[tuple[str, str, list[str]]]] = {}
    together = []
    for name, code in runnable:
        if "testing." in code:
            simulated.setdefault(name.split(":")[0], []).append((name, code, assumed(code)))
        else:
            together.append((name, code, assumed(code)))
    failed: dict[str, str] = {}
    runs = []  # side by side: each group in a process of its own
    for shared, group in [(False, together), *((True, g) for g in simulated.values())]:
        env = {**os.environ, "ANYDEVICE_DEVICE": "cpu"} if shared else None
        proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        runs.append((proc, json.dumps([PRELUDE, group, shared])))
    for proc, given in runs:
        try:
            out, err = proc.communicate(given, timeout=540)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
        failed |= json.loads(out.strip().splitlines()[-1])
    assert not failed, "\n\n".join(f"{name}:\n{tb}" for name, tb in failed.items())
