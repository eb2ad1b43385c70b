"""Why a job makes no progress, from what each rank is doing: one verdict, in words.

The input is what the hang watch (:mod:`~anydevice.launching.hangwatch`) saw of every
rank: the collective it is in (op, torch's sequence number in its group, shapes and
dtypes, the user's file:line, how long it has waited), or where it is outside any; how far
it got in each group; whether its process is gone. The output is a :class:`Verdict`, pure
data (this module reads no clock, no file, no process).

The rules, in the order they are tried:

1. **mismatch** — ranks at the same sequence number of the same group run different
   collectives (another op, or, for ops every rank calls alike, other shapes or dtypes).
   That is a bug of the program, certain at once: :attr:`Verdict.certain`.
2. **deadlock** — rank *a* waits in a collective of group *A* for rank *b*, which waits in
   a collective of group *B* for *a* (or a longer cycle): the ranks call the collectives
   of two groups in different orders.
3. **gone** — a rank that others wait for has no process any more.
4. **stall** — a rank that others wait for is outside any collective: it has not reached
   the collective (data loading, a lock, a loop, or slow work — which is why a stall is
   reported and not stopped).
5. **stuck** — every rank of the group is in the collective and it does not complete
   (the network, or the backend).

A collective "holds" a rank once it has waited ``hang_after`` seconds and its op is known
(the rank's watch reads it after a second); a mismatch needs only ``mismatch_after``
seconds (both ranks seen in it). ``hang_after`` adapts: it is at
least :data:`GAP_FACTOR` times the longest gap between two collectives that any rank has
shown (:func:`adaptive_hang_after`), so a job whose steps take minutes is not called hung.

>>> a = RankState(0, call=Call("all_reduce", 4, "0", 40.0, at="train.py:10"))
>>> b = RankState(1, seqs={"0": 3}, at="train.py:9", code="time.sleep(600)")
>>> print(diagnose({0: a, 1: b}, hang_after=30).summary)
rank 1 has not reached all_reduce #4 for 40 s: it is at train.py:9 (`time.sleep(600)`)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "GAP_FACTOR",
    "Call",
    "Group",
    "RankState",
    "Verdict",
    "adaptive_hang_after",
    "diagnose",
    "ranks_text",
]

#: ``hang_after`` is at least this many times the longest gap between collectives seen.
GAP_FACTOR = 2.0

#: torch's dtype names in the flight recorder, as Python writes them.
_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}


@dataclass(frozen=True)
class Call:
    """A collective a rank is in."""

    op: str  #: "" until the details are read
    seq: int  #: torch's sequence number in the group (the same on every rank)
    group: str  #: the group's name
    waited: float  #: seconds so far
    fingerprint: int = 0  #: equal on ranks that call the same collective (0: unknown)
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    at: str = ""  #: file:line of the user's code that called it
    code: str = ""  #: that line's text

    @property
    def known(self) -> bool:
        return bool(self.op)


@dataclass(frozen=True)
class RankState:
    """One rank as the watch saw it."""

    rank: int
    pid: int = 0
    host: str = ""
    gone: str = ""  #: "" while its process runs; else how it ended ("killed by SIGKILL")
    call: Call | None = None
    seqs: Mapping[str, int] = field(default_factory=dict)  #: last collective entered per group
    at: str = ""  #: where its main thread is, outside a collective
    code: str = ""
    stack: tuple[str, ...] = ()
    gap: float = 0.0  #: the longest gap between two collectives it has shown (seconds)
    known: bool = True  #: False: no record of it reached the watch


@dataclass(frozen=True)
class Group:
    """A process group: its global ranks and the description it was made with."""

    name: str
    ranks: tuple[int, ...]
    desc: str = ""


@dataclass(frozen=True)
class Verdict:
    """What is wrong, in one sentence (``summary``), then where each rank is (``lines``)
    and the stacks of the ranks to blame (``stacks``). ``signature`` changes when the
    diagnosis does, not when only the time waited does."""

    kind: str  #: "mismatch", "deadlock", "gone", "stall" or "stuck"
    summary: str
    lines: tuple[str, ...]
    stacks: tuple[str, ...]
    blamed: tuple[int, ...]
    signature: tuple[object, ...]

    @property
    def certain(self) -> bool:
        """A mismatch: a bug of the program, which no wait resolves."""
        return self.kind == "mismatch"

    def text(self) -> str:
        """The summary, then each line indented."""
        return "\n".join([self.summary, *(f"  {line}" for line in (*self.lines, *self.stacks))])


def adaptive_hang_after(hang_after: float, gaps: Iterable[float]) -> float:
    """``hang_after``, or :data:`GAP_FACTOR` times the longest gap between collectives
    that a rank has shown, whichever is longer.

    >>> adaptive_hang_after(30, [1.0, 0.5])
    30
    >>> adaptive_hang_after(30, [45.0])
    90.0
    """
    longest = max(gaps, default=0.0)
    return max(hang_after, GAP_FACTOR * longest)


def diagnose(
    ranks: Mapping[int, RankState],
    groups: Mapping[str, Group] | None = None,
    *,
    hang_after: float,
    mismatch_after: float = 1.0,
) -> Verdict | None:
    """The verdict on ``ranks`` (global rank -> state), or None when no rank has waited
    ``hang_after`` seconds in a collective and no mismatch is seen. ``groups`` names each
    group's ranks (a group not in it spans every rank of ``ranks``)."""
    groups = dict(groups or {})
    found = _mismatch(ranks, groups, mismatch_after)
    if found is not None:
        return found
    held = [
        s
        for s in ranks.values()
        if s.call is not None and s.call.known and s.call.waited >= hang_after and not s.gone
    ]
    if not held:
        return None
    return _hold(ranks, groups, held)


def ranks_text(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0, 2``, ``ranks 0–6, 9``.

    >>> ranks_text([0, 1, 2, 3, 5])
    'ranks 0–3, 5'
    """
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    parts: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(
            str(start)
            if start == prev
            else f"{start}–{prev}"
            if prev > start + 1
            else f"{start}, {prev}"
        )
        if r is not None:
            start = prev = r
    return "ranks " + ", ".join(parts)


# ----------------------------------------------------------------------------- mismatch


def _mismatch(
    ranks: Mapping[int, RankState], groups: Mapping[str, Group], after: float
) -> Verdict | None:
    at: dict[tuple[str, int], list[RankState]] = defaultdict(list)
    for s in ranks.values():
        if s.call is not None and s.call.known and s.call.waited >= after and not s.gone:
            at[s.call.group, s.call.seq].append(s)
    for (group, seq), states in sorted(at.items()):
        cohorts: dict[tuple[str, int], list[RankState]] = defaultdict(list)
        for s in states:
            assert s.call is not None
            cohorts[s.call.op, s.call.fingerprint].append(s)
        if len(cohorts) < 2:
            continue
        # The cohort with the lowest rank last: "rank 1 runs broadcast #4 ... while rank 0
        # runs all_reduce #4 ...".
        ordered = sorted(cohorts.values(), key=lambda c: -min(s.rank for s in c))
        ops = {s.call.op for s in states if s.call is not None}
        shapes = {s.call.shapes for s in states if s.call is not None}
        if len(ops) > 1:
            why, detail = "the ranks call different collectives", False
        elif len(shapes) > 1:
            why, detail = "the ranks pass different shapes", True
        else:
            why, detail = "the ranks pass different dtypes", True
        parts = [_runs(c, groups, detail) for c in ordered]
        summary = f"{' while '.join(parts)}: {why}"
        lines = tuple(
            _in_line(c, groups) for c in sorted(ordered, key=lambda c: min(x.rank for x in c))
        )
        blamed = tuple(sorted(s.rank for s in ordered[0]))
        signature = (
            "mismatch",
            group,
            seq,
            tuple(tuple(sorted(s.rank for s in c)) for c in ordered),
        )
        return Verdict("mismatch", summary, lines, (), blamed, signature)
    return None


def _runs(cohort: list[RankState], groups: Mapping[str, Group], detail: bool) -> str:
    call = cohort[0].call
    assert call is not None
    verb = "runs" if len(cohort) == 1 else "run"
    on = f" on {_tensors(call)}" if detail and call.dtypes else ""
    where = f" at {call.at}" if call.at else ""
    return f"{ranks_text(s.rank for s in cohort)} {verb} {_name(call, groups)}{on}{where}"


# ----------------------------------------------------------------------------- holds


@dataclass
class _Missing:
    """The ranks a collective waits for, by what keeps each."""

    gone: list[RankState] = field(default_factory=list)
    outside: list[RankState] = field(default_factory=list)
    elsewhere: list[RankState] = field(default_factory=list)
    passed: list[RankState] = field(default_factory=list)
    unknown: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Culprit:
    """A rank that a held collective waits for, and why it is not there."""

    rank: int
    why: str  #: "gone", "outside", "passed" or "unknown"
    state: RankState | None
    key: tuple[str, int]  #: the collective that waits for it


def _hold(
    ranks: Mapping[int, RankState], groups: Mapping[str, Group], held: list[RankState]
) -> Verdict:
    inside: dict[tuple[str, int], list[RankState]] = defaultdict(list)
    for s in ranks.values():
        if s.call is not None and not s.gone:
            inside[s.call.group, s.call.seq].append(s)
    waits = {key: _missing(key, states, ranks, groups) for key, states in inside.items()}
    loop = _cycle(held, waits)
    if loop is not None:
        return _deadlock(loop, inside, groups)

    # Follow each held collective through the ranks that wait in another one, to the
    # ranks that keep them all: gone, outside any collective, past it, or unknown.
    chains: list[str] = []
    culprits: dict[int, _Culprit] = {}
    visited: list[tuple[str, int]] = []
    todo = sorted({(s.call.group, s.call.seq) for s in held if s.call is not None})
    while todo:
        key = todo.pop(0)
        if key in visited:
            continue
        visited.append(key)
        missing = waits[key]
        for s in missing.elsewhere:
            assert s.call is not None
            at = f" at {s.call.at}" if s.call.at else ""
            chains.append(
                f"{_waiting(inside[key], groups)} for rank {s.rank}, which waits in "
                f"{_name(s.call, groups)}{at}"
            )
            todo.append((s.call.group, s.call.seq))
        for why, found in (
            ("gone", missing.gone),
            ("outside", missing.outside),
            ("passed", missing.passed),
        ):
            for s in found:
                culprits.setdefault(s.rank, _Culprit(s.rank, why, s, key))
        for r in missing.unknown:
            culprits.setdefault(r, _Culprit(r, "unknown", None, key))

    whys = {c.why for c in culprits.values()}
    kind = "gone" if "gone" in whys else "stall" if whys else "stuck"
    sentences = [_blame(c, inside, groups) for c in sorted(culprits.values(), key=_order)]
    if not culprits:
        waiting = [x for k in visited for x in inside[k]]
        call = _first_call(waiting)
        sentences.append(
            f"{_waiting(waiting, groups)} for {_secs(call.waited)} and every rank of its "
            "group is in it: the collective itself does not complete (the network or the "
            "backend)"
        )
    lines = [_in_line(states, groups) for _, states in sorted(inside.items())]
    stacks: list[str] = []
    for c in sorted(culprits.values(), key=lambda c: c.rank):
        lines.append(_out_line(c))
        out = c.state
        if c.why == "outside" and out is not None and out.stack:
            host = f", {out.host}" if out.host else ""
            stacks.append(f"rank {out.rank} (pid {out.pid}{host}), most recent call last:")
            stacks += [f"  {line}" for line in out.stack]
    summary = "; ".join([*chains, *sentences])
    blamed = tuple(sorted(culprits)) or tuple(sorted(s.rank for s in held))
    signature = (
        kind,
        tuple(sorted(visited)),
        tuple(sorted((r, c.why) for r, c in culprits.items())),
    )
    return Verdict(kind, summary, tuple(lines), tuple(stacks), blamed, signature)


def _order(c: _Culprit) -> tuple[int, int]:
    return (("gone", "outside", "passed", "unknown").index(c.why), c.rank)


def _blame(
    c: _Culprit, inside: Mapping[tuple[str, int], list[RankState]], groups: Mapping[str, Group]
) -> str:
    """One sentence on why collective ``c.key`` waits for rank ``c.rank``."""
    waiting = inside[c.key]
    call = _first_call(waiting)
    s = c.state
    if c.why == "gone" and s is not None:
        was = (
            f": it was in {_name(s.call, groups)}"
            if s.call
            else f": it was at {s.at}"
            if s.at
            else ""
        )
        return f"{_waiting(waiting, groups)}; rank {c.rank}'s process is gone ({s.gone}){was}"
    if c.why == "outside" and s is not None:
        code = f" (`{s.code}`)" if s.code else ""
        return (
            f"rank {c.rank} has not reached {_name(call, groups)} for {_secs(call.waited)}: "
            f"it is at {s.at or 'an unknown place'}{code}"
        )
    if c.why == "passed" and s is not None:
        return (
            f"rank {c.rank} is past {_name(call, groups)} (it is at {s.at or 'an unknown place'}):"
            f" its collective #{call.seq} was another one, so the ranks may call different "
            "collectives"
        )
    return f"rank {c.rank} has not reached {_name(call, groups)}; no record of it reached the watch"


def _out_line(c: _Culprit) -> str:
    s = c.state
    if s is None:
        return f"rank {c.rank}: no record"
    code = f"  `{s.code}`" if s.code else ""
    if c.why == "gone":
        last = f", last at {s.at}" if s.at and s.call is None else ""
        return f"rank {c.rank}: process gone ({s.gone}){last}"
    past = f", past #{c.key[1]}" if c.why == "passed" else ""
    return f"rank {c.rank}: outside any collective{past}, at {s.at or '?'}{code}"


def _waiting(states: list[RankState], groups: Mapping[str, Group]) -> str:
    """``ranks 0, 2 wait in all_reduce #4 at train.py:10``"""
    call = _first_call(states)
    verb = "waits" if len(states) == 1 else "wait"
    at = f" at {call.at}" if call.at else ""
    return f"{ranks_text(s.rank for s in states)} {verb} in {_name(call, groups)}{at}"


def _missing(
    key: tuple[str, int],
    states: list[RankState],
    ranks: Mapping[int, RankState],
    groups: Mapping[str, Group],
) -> _Missing:
    group, seq = key
    members = groups[group].ranks if group in groups else tuple(sorted(ranks))
    here = {s.rank for s in states}
    out = _Missing()
    for r in members:
        if r in here:
            continue
        s = ranks.get(r)
        if s is None or not s.known:
            out.unknown.append(r)
        elif s.gone:
            out.gone.append(s)
        elif s.call is not None and (s.call.group, s.call.seq) != key:
            if s.call.group == group and s.call.seq > seq:
                out.passed.append(s)
            else:
                out.elsewhere.append(s)
        elif s.call is None:
            if s.seqs.get(group, 0) >= seq:
                out.passed.append(s)
            else:
                out.outside.append(s)
    return out


def _cycle(
    held: list[RankState],
    waits: Mapping[tuple[str, int], _Missing],
) -> list[tuple[tuple[str, int], RankState]] | None:
    """A cycle of collectives each waiting for a rank that waits in the next, through at
    least two groups: ``[(collective, the rank it waits for), ...]``."""
    for start in sorted({(s.call.group, s.call.seq) for s in held if s.call is not None}):
        path: list[tuple[tuple[str, int], RankState]] = []
        seen: dict[tuple[str, int], int] = {}
        key: tuple[str, int] | None = start
        while key is not None and key not in seen:
            seen[key] = len(path)
            others = waits[key].elsewhere if key in waits else []
            if not others:
                key = None
                break
            nxt = min(others, key=lambda s: s.rank)
            path.append((key, nxt))
            assert nxt.call is not None
            key = (nxt.call.group, nxt.call.seq)
        if key is not None and key in seen:
            loop = path[seen[key] :]
            if len({k[0] for k, _ in loop}) >= 2:
                return loop
    return None


def _deadlock(
    loop: list[tuple[tuple[str, int], RankState]],
    inside: Mapping[tuple[str, int], list[RankState]],
    groups: Mapping[str, Group],
) -> Verdict:
    """``rank 0 waits in all_reduce #1 of group 1 at a.py:8 for rank 1, which waits in
    all_reduce #1 of group 2 at a.py:11 for rank 0: a deadlock between ...``"""
    parts = []
    for i, (key, target) in enumerate(loop):
        call = _first_call(inside[key])
        where = f" at {call.at}" if call.at else ""
        what = f"in {_name(call, groups, always_group=True)}{where} for rank {target.rank}"
        if i == 0:
            waiting = inside[key]
            verb = "waits" if len(waiting) == 1 else "wait"
            parts.append(f"{ranks_text(s.rank for s in waiting)} {verb} {what}")
        else:
            parts.append(f", which waits {what}")
    names = sorted({_group_name(k[0], groups) for k, _ in loop})
    summary = (
        "".join(parts) + f": a deadlock between {' and '.join(names)} (the ranks call the "
        "collectives of these groups in different orders)"
    )
    lines = tuple(_in_line(inside[k], groups) for k, _ in loop)
    blamed = tuple(sorted({t.rank for _, t in loop}))
    signature = ("deadlock", tuple(sorted(k for k, _ in loop)))
    return Verdict("deadlock", summary, lines, (), blamed, signature)


# ----------------------------------------------------------------------------- words


def _first_call(states: list[RankState]) -> Call:
    calls = [s.call for s in states if s.call is not None]
    known = [c for c in calls if c.known]
    return max(known or calls, key=lambda c: c.waited)


def _group_name(name: str, groups: Mapping[str, Group]) -> str:
    group = groups.get(name)
    desc = group.desc if group is not None else ""
    if desc and desc not in ("undefined", "default_pg"):
        return f"group {name} ({desc})"
    return f"group {name}"


def _is_default(name: str, groups: Mapping[str, Group]) -> bool:
    group = groups.get(name)
    if group is not None:
        return group.desc == "default_pg"
    return len(groups) <= 1


def _name(call: Call, groups: Mapping[str, Group], *, always_group: bool = False) -> str:
    """``all_reduce #4`` (the default group), ``all_reduce #1 of group 2``."""
    op = call.op or "collective"
    if _is_default(call.group, groups) and not always_group:
        return f"{op} #{call.seq}"
    return f"{op} #{call.seq} of {_group_name(call.group, groups)}"


def _tensors(call: Call) -> str:
    parts = []
    for i, dtype in enumerate(call.dtypes[:3]):
        shape = call.shapes[i] if i < len(call.shapes) else ()
        parts.append(f"{_DTYPES.get(dtype, dtype)}[{', '.join(map(str, shape))}]")
    if len(call.dtypes) > 3:
        parts.append("...")
    return ", ".join(parts)


def _in_line(states: list[RankState], groups: Mapping[str, Group]) -> str:
    call = _first_call(states)
    on = f" on {_tensors(call)}" if call.dtypes else ""
    where = f", at {call.at}" if call.at else ""
    code = f"  `{call.code}`" if call.code else ""
    return (
        f"{ranks_text(s.rank for s in states)}: in {_name(call, groups)}{on} for "
        f"{_secs(call.waited)}{where}{code}"
    )


def _secs(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
