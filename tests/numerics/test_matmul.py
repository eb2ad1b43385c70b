"""fast_matmul: torch's real fp32 math flags, set inside and restored exactly, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import anydevice as ad
from anydevice.numerics.matmul import MathSettings, _Saved

NODES = [
    ("generic", "all"),
    ("cuda", "all"),
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("mkldnn", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
]
VALUES = {"generic": ["none", "ieee", "tf32", "bf16"], "cuda": ["none", "ieee", "tf32"]}
VALUES["mkldnn"] = VALUES["generic"]


def observe() -> tuple[object, ...]:
    """Everything torch's getters show: each fp32_precision value, and each legacy getter's
    answer or the fact that it refuses to answer."""
    seen: list[object] = [torch._C._get_fp32_precision_getter(*n) for n in NODES]
    legacy = (
        lambda: torch.backends.cuda.matmul.allow_tf32,
        lambda: torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision,
    )
    for read in legacy:
        try:
            seen.append(read())
        except RuntimeError:
            seen.append("refused")
    return tuple(seen)


@pytest.fixture(autouse=True)
def leave_settings_as_found() -> Iterator[None]:
    # Clean-up only (torch's initial cuDNN state cannot be written back once a test sets it).
    saved = _Saved.save()
    yield
    saved.restore()


def test_inside_both_apis_read_tf32_and_outside_what_was_there() -> None:
    before = observe()
    with ad.fast_matmul():
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        assert torch.backends.cudnn.rnn.fp32_precision == "tf32"
    assert observe() == before


def test_medium_also_lets_onednn_use_bf16() -> None:
    with ad.fast_matmul("medium"):
        assert torch.get_float32_matmul_precision() == "medium"
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def fails_inside() -> None:
    with ad.fast_matmul():
        torch.backends.fp32_precision = "ieee"  # changed inside: put back too
        raise KeyError("boom")


def test_settings_come_back_when_the_block_raises() -> None:
    before = observe()
    with pytest.raises(KeyError, match="boom"):
        fails_inside()
    assert observe() == before


def test_nested_blocks_restore_the_enclosing_block() -> None:
    before = observe()
    with ad.fast_matmul():
        outer = observe()
        with ad.fast_matmul("medium"):
            assert torch.get_float32_matmul_precision() == "medium"
        assert observe() == outer
    assert observe() == before


def test_works_as_a_decorator() -> None:
    @ad.fast_matmul()
    def inside() -> str:
        return torch.get_float32_matmul_precision()

    before = observe()
    assert inside() == "high"
    assert inside() == "high"
    assert observe() == before


def test_warns_about_nothing() -> None:
    # torch 2.9-2.12 warn once when the legacy API is used; here it is used on purpose.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ad.fast_matmul():
            pass


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(ad.PrecisionError, match="'high' .* or 'medium'"), ad.fast_matmul("low"):  # type: ignore[arg-type]
        pass


def test_legacy_getters_stay_readable_inside_after_new_api_settings() -> None:
    torch.backends.fp32_precision = "ieee"  # new API only: a legacy getter now refuses
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.backends.cudnn.allow_tf32  # noqa: B018
    with ad.fast_matmul():
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
        assert torch.get_float32_matmul_precision() == "high"


# ----------------------------------------------------------------------------- reading


SETTERS = {
    "_set_fp32_precision_setter",
    "_set_float32_matmul_precision",
    "_set_cublas_allow_tf32",
    "_set_cudnn_allow_tf32",
    "_set_onednn_allow_tf32",
}


def setters_called(fn: Callable[[], object]) -> list[str]:
    """Names of torch's math-setting setters that ``fn`` calls (sys.setprofile sees every
    call into C from Python)."""
    called: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        name = getattr(arg, "__name__", "")
        if event == "c_call" and name in SETTERS:
            called.append(name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return called


STATES = {
    "as torch starts": lambda: None,
    "legacy high": lambda: torch.set_float32_matmul_precision("high"),
    "new API root tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "new API matmul leaf tf32": lambda: setattr(
        torch.backends.cuda.matmul, "fp32_precision", "tf32"
    ),
    "new API conv ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
}


@pytest.mark.parametrize("state", STATES)
def test_reading_the_settings_writes_nothing(state: str) -> None:
    STATES[state]()
    before = observe()
    called = setters_called(MathSettings.capture)
    assert called == [], f"capture() called {len(called)} setter(s): {sorted(set(called))}"
    assert observe() == before

    def writes() -> None:
        with ad.fast_matmul():
            pass

    assert setters_called(writes)  # the check sees writes


def test_another_thread_never_sees_a_reading() -> None:
    # A matmul on another thread runs in whatever the settings say at that instant: a
    # reading that moved them, even for a microsecond, would change its precision.
    torch.backends.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    expected = observe()
    seen: set[tuple[object, ...]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(observe())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for _ in range(3000):
            MathSettings.capture()
    finally:
        done.set()
        watcher.join(timeout=30)
        sys.setswitchinterval(interval)
    assert not watcher.is_alive()
    assert seen == {expected}, f"another thread saw {len(seen) - 1} other state(s)"


def test_a_reading_after_the_new_api_answers_where_the_legacy_getters_refuse() -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # new API only: "a mix" for legacy
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.rnn.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        torch.get_float32_matmul_precision()
    s = MathSettings.capture()
    assert s.matmul_precision is None  # refused, not guessed
    assert s.cudnn_tf32 is None  # conv and RNN differ: no one legacy flag says it
    assert (s.precision("matmul"), s.precision("conv"), s.precision("rnn")) == (
        "tf32",
        "ieee",
        "tf32",
    )
    assert s.precision("matmul", "mkldnn") == "ieee"


def test_the_precision_read_follows_inheritance_as_torch_resolves_it() -> None:
    for node in NODES:
        torch._C._set_fp32_precision_setter(*node, "none")
    assert MathSettings.capture().precision("matmul") == "ieee"  # nothing set: full fp32
    torch.backends.fp32_precision = "tf32"
    assert MathSettings.capture().precision("conv") == "tf32"
    torch.backends.cudnn.fp32_precision = "ieee"  # the cuda level overrides the root
    s = MathSettings.capture()
    assert (s.precision("matmul"), s.precision("conv")) == ("ieee", "ieee")
    assert s.precision("matmul", "mkldnn") == "tf32"


def test_an_unknown_op_is_refused_with_the_names_that_exist() -> None:
    with pytest.raises(ValueError, match="op=.attention.*'matmul', 'conv', 'rnn'"):
        MathSettings.capture().precision("attention")


def test_fast_matmul_yields_what_was_in_force() -> None:
    torch.set_float32_matmul_precision("highest")
    with ad.fast_matmul() as before:
        assert before.matmul_precision == "highest" and before.precision("matmul") == "ieee"
        assert MathSettings.capture().precision("matmul") == "tf32"
    assert MathSettings.capture() == before


# ----------------------------------------------------------------------------- exactness

OPS = st.one_of(
    st.sampled_from(NODES).flatmap(
        lambda n: st.tuples(st.just("tree"), st.just(n), st.sampled_from(VALUES[n[0]]))
    ),
    st.tuples(st.just("matmul"), st.sampled_from(["highest", "high", "medium"])),
    st.tuples(st.just("cublas"), st.booleans()),
    st.tuples(st.just("cudnn"), st.booleans()),
)


def apply(ops: list[tuple[object, ...]]) -> None:
    for op in ops:
        if op[0] == "tree":
            torch._C._set_fp32_precision_setter(*op[1], op[2])  # type: ignore[misc]
        elif op[0] == "matmul":
            torch.set_float32_matmul_precision(str(op[1]))
        elif op[0] == "cublas":
            torch.backends.cuda.matmul.allow_tf32 = bool(op[1])
        else:
            torch.backends.cudnn.allow_tf32 = bool(op[1])


def reset() -> None:
    """A known state, written explicitly (torch's initial cuDNN state cannot be written)."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    for node in NODES:
        torch._C._set_fp32_precision_setter(*node, "none")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    before=st.lists(OPS, max_size=6),
    inside=st.lists(OPS, max_size=4),
    after=st.lists(OPS, max_size=6),
    precision=st.sampled_from(["high", "medium"]),
)
def test_no_later_setting_can_tell_the_block_happened(
    before: list[tuple[object, ...]],
    inside: list[tuple[object, ...]],
    after: list[tuple[object, ...]],
    precision: str,
) -> None:
    # What torch stores (inherited or set, and legacy values the getters hide) must come
    # back: every later change must then read the same as if the block never ran.
    reset()
    apply(before)
    expected_now = observe()
    apply(after)
    expected_later = observe()

    reset()
    apply(before)
    with ad.fast_matmul(precision):  # type: ignore[arg-type]
        apply(inside)
    assert observe() == expected_now
    apply(after)
    assert observe() == expected_later


FRESH = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {src!r})
    from anydevice import fast_matmul
    S = torch._C._set_fp32_precision_setter
    G = torch._C._get_fp32_precision_getter
    def look():
        return [G("cuda", "conv"), G("cuda", "rnn"), G("cuda", "matmul")]
    seen = []
    torch.backends.fp32_precision = {generic!r}
    if {use!r}:
        with fast_matmul():
            seen.append(look())
    seen.append(look())
    for node, value in [(("generic", "all"), "ieee"), (("generic", "all"), "none"),
                        (("cuda", "all"), "ieee"), (("cuda", "all"), "none")]:
        S(*node, value)
        seen.append(look())
    print(json.dumps(seen))
    """
)


@pytest.mark.long  # a fresh interpreter per case (make test-long)
@pytest.mark.slow
@pytest.mark.parametrize("generic", ["none", "ieee"])
def test_torchs_initial_cudnn_state_survives_the_block(generic: str) -> None:
    # In a fresh process cuDNN conv/RNN inherit, yet read "tf32" when nothing above is
    # set: a state no setter can write again. The block must leave it alone.
    src = str(Path(__file__).resolve().parents[2] / "src")

    def run(use: bool) -> list[list[str]]:
        code = FRESH.format(src=src, generic=generic, use=use)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        return json.loads(out.stdout)

    without, with_block = run(False), run(True)
    assert with_block[0][:2] == ["tf32", "tf32"]  # inside: cuDNN TF32 on
    assert with_block[1:] == without
