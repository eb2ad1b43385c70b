"""ad.to, ad.device_of, ad.devices_of: real tensors, modules, optimizers and containers.

Without a GPU the second device is ``meta``: tensors really move there (new objects with
the same shape and dtype and no data), which is all a structural test needs. Copies that
need a GPU are in test_placement_cuda.py.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import anydevice as ad
from anydevice.placement.move import _accepts_non_blocking, _auto_non_blocking, target_device

META = torch.device("meta")
CPU = torch.device("cpu")


class Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class Batch:
    x: Any
    y: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    n: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlots:
    x: torch.Tensor
    label: str = "a"


@dataclasses.dataclass
class WithDerived:
    """``total`` is computed once in ``__post_init__``; a rebuild must not recompute it."""

    x: torch.Tensor
    total: int = dataclasses.field(init=False)
    calls: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls.append(1)
        self.total = len(self.calls) * 100


# ----------------------------------------------------------------------------- tensors


def test_tensor_already_on_target_is_returned_as_is():
    t = torch.ones(3)
    assert ad.to(t, CPU) is t
    assert ad.to(t, "cpu") is t
    assert ad.to(t, CPU, non_blocking=False) is t


def test_tensor_moves_to_meta_with_shape_and_dtype():
    t = torch.ones(2, 3, dtype=torch.float16)
    out = ad.to(t, "meta")
    assert out.device == META
    assert out.shape == t.shape
    assert out.dtype == t.dtype
    assert t.device == CPU  # the input is untouched


def test_device_spec_strings_go_through_ad_device():
    with pytest.raises(ad.DeviceSpecError):
        ad.to(torch.ones(1), "cuda:x")
    with pytest.raises(TypeError):
        ad.to(torch.ones(1), 1.5)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda:0", "cuda"])
def test_a_missing_torch_device_is_refused_like_its_spec_string(spec: str) -> None:
    batch = {"x": torch.ones(2)}
    with pytest.raises(ad.DeviceNotFoundError) as by_string:
        ad.to(batch, spec)
    for obj in (torch.ones(2), batch, [torch.ones(2)]):
        with pytest.raises(ad.DeviceNotFoundError) as by_device:
            ad.to(obj, torch.device(spec))
        assert str(by_device.value) == str(by_string.value)


def test_non_blocking_must_be_auto_true_or_false():
    with pytest.raises(ValueError, match="non_blocking must be"):
        ad.to(torch.ones(1), CPU, non_blocking="yes")  # type: ignore[arg-type]


def test_target_device_fills_in_nothing_for_cpu_and_meta():
    assert target_device(CPU) is CPU
    assert target_device("meta") == META


class RecordingTensor(torch.Tensor):
    """A real tensor subclass that records the keyword arguments of its ``.to`` calls."""

    seen: ClassVar[list[dict[str, Any]]] = []

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        RecordingTensor.seen.append(dict(kwargs))
        return super().to(*args, **kwargs)


def test_explicit_non_blocking_reaches_tensor_to():
    t = torch.ones(2).as_subclass(RecordingTensor)
    RecordingTensor.seen.clear()
    ad.to({"t": t}, META, non_blocking=True)
    ad.to({"t": t}, META, non_blocking=False)
    ad.to({"t": t}, META)  # auto: to meta is blocking
    # False is Tensor.to's default: passed or left out, the copy is blocking
    assert [s.get("non_blocking", False) for s in RecordingTensor.seen] == [True, False, False]


class ReportsPinned(torch.Tensor):
    """A real CPU tensor that answers ``is_pinned()`` with True (pinning needs a GPU)."""

    def is_pinned(self, *args: Any, **kwargs: Any) -> bool:  # type: ignore[override]
        return True


def test_auto_non_blocking_rule():
    cpu_tensor = torch.ones(1)
    assert not cpu_tensor.is_pinned()
    # host to accelerator: blocking, pageable or pinned (the caller may refill the buffer)
    assert _auto_non_blocking(CPU, cpu_tensor, "cuda") is False
    pinned = torch.ones(1).as_subclass(ReportsPinned)
    assert pinned.is_pinned()
    assert _auto_non_blocking(CPU, pinned, "cuda") is False
    assert _auto_non_blocking(CPU, pinned, "xpu") is False
    # accelerator to accelerator: asynchronous
    assert _auto_non_blocking(torch.device("cuda", 1), cpu_tensor, "cuda") is True
    assert _auto_non_blocking(torch.device("xpu", 0), cpu_tensor, "xpu") is True
    # to the host: blocking (garbage until synchronised otherwise); MPS, meta: blocking
    assert _auto_non_blocking(torch.device("cuda", 0), cpu_tensor, "cpu") is False
    assert _auto_non_blocking(CPU, cpu_tensor, "mps") is False
    assert _auto_non_blocking(CPU, cpu_tensor, "meta") is False


def test_error_from_tensor_to_keeps_its_type_and_names_the_path():
    batch = {"inputs": [torch.ones(1), torch.ones(1, device="meta")]}
    with pytest.raises(NotImplementedError, match="meta") as info:
        ad.to(batch, CPU)
    assert "obj['inputs'][1]" in "\n".join(getattr(info.value, "__notes__", []))


def test_a_tensor_seen_twice_is_copied_once():
    t = torch.ones(2)
    out = ad.to({"a": t, "b": [t]}, META)
    assert out["a"] is out["b"][0]
    assert out["a"].device == META


def test_parameter_moves_like_tensor_to():
    p = nn.Parameter(torch.ones(2))
    out = ad.to([p], META)[0]
    assert out.device == META
    assert out.requires_grad


# ----------------------------------------------------------------------------- containers


def test_nested_batch_keeps_structure_types_and_shares_unmoved_leaves():
    x, mask, ids = torch.ones(2, 3), torch.ones(2, dtype=torch.bool), np.arange(3)
    batch = {
        "inputs": [x, (mask, "text", 3)],
        "pair": Pair(x, None),
        "ids": ids,
        "raw": b"bytes",
    }
    out = ad.to(batch, CPU)
    assert out == batch
    assert out is not batch and out["inputs"] is not batch["inputs"]
    assert out["inputs"][0] is x and out["inputs"][1][0] is mask
    assert type(out["inputs"][1]) is tuple and type(out["pair"]) is Pair
    assert out["ids"] is ids and out["raw"] is batch["raw"]


def test_caller_containers_are_never_mutated():
    inner = [torch.ones(1)]
    batch = {"a": inner, "b": torch.ones(1)}
    before = (dict(batch), list(inner))
    out = ad.to(batch, META)
    assert batch == before[0] and inner == before[1]
    assert batch["a"] is inner and inner[0].device == CPU
    out["a"].append("new")
    assert len(inner) == 1


def test_ordered_dict_defaultdict_userdict_and_mapping_proxy_keep_their_type():
    t = torch.ones(1)
    od = collections.OrderedDict([("z", t), ("a", t)])
    dd: collections.defaultdict[str, list[Any]] = collections.defaultdict(list, {"x": t})
    ud = collections.UserDict({"x": t})
    proxy = types.MappingProxyType({"x": t})

    out_od = ad.to(od, META)
    assert type(out_od) is collections.OrderedDict and list(out_od) == ["z", "a"]
    out_dd = ad.to(dd, META)
    assert type(out_dd) is collections.defaultdict and out_dd.default_factory is list
    assert out_dd["missing"] == [] and "missing" not in dd
    out_ud = ad.to(ud, META)
    assert type(out_ud) is collections.UserDict and out_ud["x"].device == META
    out_proxy = ad.to(proxy, META)
    assert type(out_proxy) is types.MappingProxyType and out_proxy["x"].device == META


class FrozenMapping(Mapping[str, Any]):
    """A read-only mapping built from a dict."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


def test_read_only_mapping_is_rebuilt_from_a_dict():
    out = ad.to(FrozenMapping({"x": torch.ones(1), "s": "keep"}), META)
    assert type(out) is FrozenMapping
    assert out["x"].device == META and out["s"] == "keep"


class TaggedList(list[Any]):
    tag = ""


def test_list_and_tuple_subclasses_and_sets_keep_their_type():
    tagged = TaggedList([torch.ones(1)])
    tagged.tag = "mine"
    out = ad.to(tagged, META)
    assert type(out) is TaggedList and out.tag == "mine" and out[0].device == META
    assert ad.to(frozenset({"a", 1}), META) == frozenset({"a", 1})
    moved = ad.to({torch.ones(1)}, META)
    assert type(moved) is set and next(iter(moved)).device == META


def test_dataclass_is_rebuilt_without_init():
    b = Batch(torch.ones(1), "label")
    out = ad.to(b, META)
    assert type(out) is Batch and out is not b
    assert out.x.device == META and out.y == "label" and b.x.device == CPU


def test_frozen_and_slotted_dataclasses_are_moved():
    f = ad.to(Frozen(torch.ones(1), 4), META)
    assert f.x.device == META and f.n == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.n = 5  # type: ignore[misc]
    s = ad.to(FrozenSlots(torch.ones(1), "b"), META)
    assert type(s) is FrozenSlots and s.x.device == META and s.label == "b"


def test_init_false_fields_and_post_init_state_survive():
    d = WithDerived(torch.ones(1))
    d.total = 7  # changed after construction: a re-run of __init__ would reset it
    out = ad.to(d, META)
    assert out.total == 7
    assert out.calls == [1]  # __post_init__ ran once, for the original only
    assert out.x.device == META


def test_packed_sequence_keeps_batch_sizes_on_cpu():
    packed = pack_padded_sequence(torch.ones(2, 3, 4), [3, 1], batch_first=True)
    out = ad.to(packed, META)
    assert type(out) is type(packed)
    assert out.data.device == META
    assert out.batch_sizes.device == CPU


def test_unknown_objects_and_numpy_arrays_are_left_alone():
    arr = np.ones(3)
    obj = object()
    out = ad.to([arr, obj, None, 1.5, "s", b"b", torch.float16, CPU], META)
    assert out[0] is arr and out[1] is obj
    assert out[2:] == [None, 1.5, "s", b"b", torch.float16, CPU]


# ----------------------------------------------------------------------------- skip_keys


def test_skip_keys_apply_at_every_level():
    labels, deep = torch.ones(1), torch.ones(1)
    batch = {"x": torch.ones(1), "labels": labels, "nested": [{"labels": deep, "y": torch.ones(1)}]}
    out = ad.to(batch, META, skip_keys=("labels",))
    assert out["labels"] is labels and out["nested"][0]["labels"] is deep
    assert out["x"].device == META and out["nested"][0]["y"].device == META


def test_skip_keys_accepts_one_string_and_applies_to_fields():
    keep = torch.ones(1)
    out = ad.to({"labels": keep, "b": Batch(torch.ones(1), keep)}, META, skip_keys="labels")
    assert out["labels"] is keep and out["b"].x.device == META
    out = ad.to(Batch(torch.ones(1), keep), META, skip_keys={"y"})
    assert out.y is keep and out.x.device == META
    nt = ad.to(Pair(torch.ones(1), keep), META, skip_keys=["b"])
    assert type(nt) is Pair and nt.b is keep and nt.a.device == META


# ----------------------------------------------------------------------------- custom .to


class Encoding:
    """Like a tokenizer's BatchEncoding: moves its own tensors."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.calls: list[dict[str, Any]] = []

    def to(self, device: Any, non_blocking: bool = False) -> Encoding:
        self.calls.append({"device": device, "non_blocking": non_blocking})
        return Encoding(self.ids.to(device))


class PositionalOnly:
    def __init__(self) -> None:
        self.calls = 0

    def to(self, device: Any) -> PositionalOnly:
        self.calls += 1
        return self


def test_object_with_to_is_moved_by_its_own_method():
    enc = Encoding(torch.ones(2))
    out = ad.to({"enc": enc}, META, non_blocking=True)
    assert out["enc"].ids.device == META
    assert enc.calls == [{"device": META, "non_blocking": True}]


def test_auto_lets_a_custom_to_use_its_own_default():
    enc = Encoding(torch.ones(2))
    ad.to(enc, META)
    assert enc.calls == [{"device": META, "non_blocking": False}]


def test_non_blocking_is_passed_only_to_methods_that_take_it():
    obj = PositionalOnly()
    assert ad.to(obj, META, non_blocking=True) is obj
    assert obj.calls == 1
    assert _accepts_non_blocking(PositionalOnly) is False
    assert _accepts_non_blocking(Encoding) is True


def test_signature_is_read_once_per_class():
    class Fresh:
        def to(self, device: Any, **kwargs: Any) -> Fresh:
            return self

    before = _accepts_non_blocking.cache_info()
    for _ in range(5):
        ad.to(Fresh(), META, non_blocking=True)
    after = _accepts_non_blocking.cache_info()
    assert after.misses - before.misses == 1
    assert after.hits - before.hits == 4


class Broken:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def to(self, device: Any, non_blocking: bool = False) -> Broken:
        self.calls += 1
        raise self.error


def test_custom_to_error_names_the_path_and_keeps_the_original():
    original = ValueError("tokenizer says no")
    broken = Broken(original)
    batch = {"inputs": [torch.ones(1), "s", broken]}
    with pytest.raises(ad.MoveError) as info:
        ad.to(batch, META)
    assert info.value.path == "obj['inputs'][2]"
    assert "obj['inputs'][2]" in str(info.value) and "tokenizer says no" in str(info.value)
    assert info.value.__cause__ is original


def test_type_error_inside_custom_to_is_not_swallowed_or_retried():
    broken = Broken(TypeError("bug inside .to"))
    with pytest.raises(ad.MoveError) as info:
        ad.to([broken], META, non_blocking=True)
    assert isinstance(info.value.__cause__, TypeError)
    assert broken.calls == 1  # no second attempt without non_blocking


def test_custom_to_returning_none_moved_in_place():
    class InPlace:
        def __init__(self) -> None:
            self.t = torch.ones(1)

        def to(self, device: Any) -> None:
            self.t = self.t.to(device)

    obj = InPlace()
    assert ad.to(obj, META) is obj and obj.t.device == META


# ----------------------------------------------------------------------------- cycles


def test_cycle_raises_a_clear_error_with_the_path():
    loop: list[Any] = [torch.ones(1)]
    batch = {"a": {"b": loop}}
    loop.append(batch["a"])
    with pytest.raises(ad.MoveError, match="contains itself") as info:
        ad.to(batch, META)
    assert "obj['a']['b'][1] is obj['a'] itself" in str(info.value)


def test_self_containing_dict_raises_move_error_not_recursion_error():
    d: dict[str, Any] = {}
    d["self"] = d
    with pytest.raises(ad.MoveError, match=r"obj\['self'\] is obj itself"):
        ad.to(d, META)


def test_same_list_twice_is_not_a_cycle():
    shared = [torch.ones(1)]
    out = ad.to([shared, shared], META)
    assert out[0][0] is out[1][0]


# ----------------------------------------------------------------------------- modules, optimizers


def test_module_is_moved_in_place_and_returned():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    out = ad.to({"model": model}, META)
    assert out["model"] is model
    assert ad.to(model, META) is model
    assert {t.device for t in model.state_dict().values()} == {META}


def _adam_with_state(**options: Any) -> tuple[nn.Linear, torch.optim.Adam]:
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), **options)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("options", [{}, {"foreach": True}, {"fused": True}])
def test_optimizer_state_follows_parameters_as_load_state_dict_does(options):
    _, trained = _adam_with_state(**options)
    # The same optimizer over parameters on another device, holding the CPU state.
    model = nn.Linear(3, 2, device="meta")
    opt = torch.optim.Adam(model.parameters(), **options)
    reference = torch.optim.Adam(model.parameters(), **options)
    reference.load_state_dict(trained.state_dict())
    for p, q in zip(model.parameters(), trained.param_groups[0]["params"], strict=True):
        opt.state[p] = dict(trained.state[q])

    assert ad.to(opt, META) is opt
    for p in model.parameters():
        moved = {k: v.device for k, v in opt.state[p].items()}
        expected = {k: v.device for k, v in reference.state[p].items()}
        assert moved == expected
        assert moved["exp_avg"] == META
        assert moved["step"] == (META if options.get("fused") else CPU)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the state is usable where it now is


def test_optimizer_whose_parameters_are_elsewhere_is_refused():
    _, opt = _adam_with_state()
    with pytest.raises(ad.MoveError, match="move the model first") as info:
        ad.to(opt, META)
    assert "param_groups[0]['params'][0] on cpu" in str(info.value)
    assert opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].device == CPU


# ----------------------------------------------------------------------------- properties


@dataclasses.dataclass
class Node:
    value: Any
    other: Any = None


leaves = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.builds(
        lambda shape, dtype: torch.zeros(shape, dtype=dtype),
        st.lists(st.integers(0, 3), max_size=2),
        st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float16]),
    ),
)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=2), children, max_size=4),
        st.builds(Pair, children, children),
        st.builds(Node, children, children),
        st.builds(
            lambda d: collections.OrderedDict(d),
            st.dictionaries(st.text(max_size=2), children, max_size=3),
        ),
    )


structures = st.recursive(leaves, _extend, max_leaves=20)


def _same_shape(a: Any, b: Any, device: torch.device) -> None:
    """``b`` is ``a`` moved to ``device``: same types, same values, tensors on ``device``."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert b.device == device and b.shape == a.shape and b.dtype == a.dtype
        if device == a.device:
            assert b is a
    elif isinstance(a, Mapping):
        assert list(a) == list(b)
        for k in a:
            _same_shape(a[k], b[k], device)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_shape(x, y, device)
    elif dataclasses.is_dataclass(a):
        _same_shape(a.value, b.value, device)  # type: ignore[attr-defined]
        _same_shape(a.other, b.other, device)  # type: ignore[attr-defined]
    else:
        assert b is a  # every other leaf is shared, not copied


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(structures)
def test_random_structures_keep_structure_types_values_and_identity(obj):
    snapshot = copy.deepcopy(obj)
    same = ad.to(obj, CPU)
    _same_shape(obj, same, CPU)
    moved = ad.to(obj, META)
    _same_shape(obj, moved, META)
    # the input is unchanged: same values, and its tensors still on the CPU
    assert set(ad.devices_of(obj)) <= {CPU}
    assert repr(obj) == repr(snapshot)


# ----------------------------------------------------------------------------- edge cases


class PairWithNotes(Pair):
    """A named-tuple subclass without __slots__: instances carry extra attributes."""


class Scaled(NamedTuple):
    value: Any
    scale: int


class ScaledFromOne(Scaled):
    __slots__ = ()

    def __new__(cls, value: Any) -> ScaledFromOne:  # a signature of its own
        return super().__new__(cls, value, 1)


class TaggedTuple(tuple[Any, ...]):
    """A plain tuple subclass with a __new__ of its own and extra attributes."""

    def __new__(cls, first: Any, second: Any) -> TaggedTuple:
        return super().__new__(cls, (first, second))


def test_named_tuple_subclass_keeps_and_moves_its_extra_attributes():
    p = PairWithNotes(torch.ones(1), "a")
    p.note = "kept"  # type: ignore[attr-defined]
    p.weights = torch.ones(3)  # type: ignore[attr-defined]
    out = ad.to(p, META)
    assert type(out) is PairWithNotes and out.a.device == META and out.b == "a"
    assert out.note == "kept" and out.weights.device == META
    assert p.weights.device == CPU  # the caller's object is untouched
    skipped = ad.to(p, META, skip_keys=("weights",))
    assert skipped.weights is p.weights and skipped.a.device == META


def test_named_tuple_with_its_own_new_is_rebuilt_without_calling_it():
    out = ad.to({"s": ScaledFromOne(torch.ones(2))}, META)["s"]
    assert type(out) is ScaledFromOne and out.value.device == META and out.scale == 1


def test_tuple_subclass_with_its_own_new_keeps_its_attributes():
    t = TaggedTuple(torch.ones(1), 2)
    t.origin = torch.zeros(1)  # type: ignore[attr-defined]
    out = ad.to(t, META)
    assert type(out) is TaggedTuple and out[0].device == META and out[1] == 2
    assert out.origin.device == META


def test_torch_return_types_are_rebuilt_by_their_own_class():
    r = torch.max(torch.ones(2, 2), 0)
    out = ad.to(r, META)
    assert type(out) is type(r) and out.values.device == META


def test_deque_and_userlist_are_moved_with_their_type_and_maxlen():
    d = collections.deque([torch.ones(1), "x"], maxlen=3)
    out = ad.to({"d": d}, META)["d"]
    assert type(out) is collections.deque and out.maxlen == 3
    assert out[0].device == META and out[1] == "x" and d[0].device == CPU
    u = collections.UserList([torch.ones(1)])
    moved = ad.to(u, META)
    assert type(moved) is collections.UserList and moved[0].device == META


def test_structure_deeper_than_max_depth_is_refused_with_the_path_not_recursion_error():
    from anydevice.placement.move import MAX_DEPTH

    deep: Any = torch.ones(1)
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ad.MoveError, match=rf"more than {MAX_DEPTH} containers deep") as info:
        ad.to(deep, META)
    assert info.value.path.startswith("obj[0][0][0]")
    shallow: Any = torch.ones(1)
    for _ in range(MAX_DEPTH - 1):
        shallow = {"k": shallow}
    out = ad.to(shallow, META)
    for _ in range(MAX_DEPTH - 1):
        out = out["k"]
    assert out.device == META


class _Collections:
    """Counts the cyclic collector's runs while it is installed."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        self.runs += phase == "start"


@pytest.mark.parametrize("kind", ["list", "dict", "nested"])
def test_a_long_walk_runs_no_collection_and_gives_the_collector_back(kind: str) -> None:
    import gc

    from anydevice.placement.move import GC_PAUSE_AT

    xs = [torch.zeros(1) for _ in range(20 * GC_PAUSE_AT)]  # ~115 young collections' worth
    obj: Any = {"list": xs, "dict": dict(enumerate(xs)), "nested": {"batch": [xs]}}[kind]
    ad.to([torch.zeros(1)], META)  # imports made now: they may collect
    gc.collect()  # the young generation's count starts at 0: the walk's few allocations
    counted = _Collections()  # before it meets the long list cannot trigger a collection
    gc.callbacks.append(counted)
    try:
        moved = ad.to(obj, META)
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(counted)
    assert counted.runs == 0
    leaves = (
        list(moved.values()) if kind == "dict" else moved["batch"][0] if kind == "nested" else moved
    )
    assert len(leaves) == len(xs) and leaves[0].device.type == "meta"


def test_the_collector_is_given_back_after_a_failed_walk_and_left_off_if_it_was() -> None:
    import gc

    from anydevice.placement.move import GC_PAUSE_AT

    class Refuses:
        def to(self, device: torch.device) -> None:
            raise RuntimeError("no")

    items: list[Any] = [torch.zeros(1) for _ in range(GC_PAUSE_AT)] + [Refuses()]
    with pytest.raises(ad.MoveError):
        ad.to(items, "meta")
    assert gc.isenabled()
    gc.disable()
    try:
        ad.to(items[:-1], "meta")
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()
