"""The hang verdict's rules on states laid out by hand, as the watch reads them: which
diagnosis, which ranks, which lines, and when none is given."""

from __future__ import annotations

import pytest

from anydevice.launching.verdict import (
    GAP_FACTOR,
    Call,
    Group,
    RankState,
    adaptive_hang_after,
    diagnose,
    ranks_text,
)

DEFAULT = {"0": Group("0", (0, 1), "default_pg")}


def call(op: str = "all_reduce", seq: int = 4, group: str = "0", waited: float = 40.0, **kw):
    kw.setdefault("fingerprint", hash((op, kw.get("shapes", ((4,),)))) & 0xFFFF)
    kw.setdefault("shapes", ((4,),))
    kw.setdefault("dtypes", ("Float",))
    return Call(op, seq, group, waited, **kw)


def test_different_ops_at_one_sequence_number_are_a_mismatch_naming_both_lines():
    ranks = {
        0: RankState(0, call=call("all_reduce", at="train.py:10", waited=1.5)),
        1: RankState(1, call=call("broadcast", at="train.py:12", waited=1.5)),
    }
    v = diagnose(ranks, DEFAULT, hang_after=30)
    assert v is not None and v.kind == "mismatch" and v.certain
    assert v.summary == (
        "rank 1 runs broadcast #4 at train.py:12 while rank 0 runs all_reduce #4 at "
        "train.py:10: the ranks call different collectives"
    )
    assert v.blamed == (1,)


def test_a_mismatch_needs_no_hang_after_but_both_ranks_seen_in_it():
    ranks = {
        0: RankState(0, call=call("all_reduce", waited=0.2)),
        1: RankState(1, call=call("broadcast", waited=0.2)),
    }
    assert diagnose(ranks, DEFAULT, hang_after=30, mismatch_after=1.0) is None
    assert diagnose(ranks, DEFAULT, hang_after=30, mismatch_after=0.1) is not None


def test_other_shapes_in_the_same_op_are_a_mismatch_that_shows_them():
    ranks = {
        0: RankState(0, call=call(shapes=((4,),), fingerprint=1, at="a.py:3")),
        1: RankState(1, call=call(shapes=((8,),), fingerprint=2, at="a.py:3")),
    }
    v = diagnose(ranks, DEFAULT, hang_after=30)
    assert v is not None and v.kind == "mismatch"
    assert v.summary.endswith("the ranks pass different shapes")
    assert "rank 1 runs all_reduce #4 on float32[8] at a.py:3" in v.summary
    assert "rank 0 runs all_reduce #4 on float32[4]" in v.summary


def test_a_rank_outside_any_collective_is_a_stall_with_its_line_and_stack():
    ranks = {
        0: RankState(0, call=call(at="train.py:10", code="dist.all_reduce(t)")),
        1: RankState(
            1,
            seqs={"0": 3},
            at="train.py:9",
            code="time.sleep(600)",
            stack=('File "train.py", line 9, in <module>', "  time.sleep(600)"),
        ),
    }
    v = diagnose(ranks, DEFAULT, hang_after=30)
    assert v is not None and (v.kind, v.certain, v.blamed) == ("stall", False, (1,))
    assert v.summary == (
        "rank 1 has not reached all_reduce #4 for 40 s: it is at train.py:9 (`time.sleep(600)`)"
    )
    assert any(
        line.startswith("rank 0: in all_reduce #4 on float32[4] for 40 s") for line in v.lines
    )
    assert "rank 1: outside any collective, at train.py:9  `time.sleep(600)`" in v.lines
    assert '  File "train.py", line 9, in <module>' in v.stacks


def test_no_verdict_before_hang_after_nor_while_the_op_is_unknown():
    waiting = {0: RankState(0, call=call(waited=20)), 1: RankState(1, seqs={"0": 3})}
    assert diagnose(waiting, DEFAULT, hang_after=30) is None
    unknown = {0: RankState(0, call=call(op="", waited=40)), 1: RankState(1, seqs={"0": 3})}
    assert diagnose(unknown, DEFAULT, hang_after=30) is None


def test_ranks_waiting_for_a_dead_rank_say_it_is_gone():
    ranks = {r: RankState(r, call=call(seq=812, at="t.py:40")) for r in range(7)}
    ranks[7] = RankState(7, gone="killed by SIGKILL", at="t.py:38", seqs={"0": 811})
    groups = {"0": Group("0", tuple(range(8)), "default_pg")}
    v = diagnose(ranks, groups, hang_after=30)
    assert v is not None and v.kind == "gone" and v.blamed == (7,)
    assert v.summary == (
        "ranks 0–6 wait in all_reduce #812 at t.py:40; rank 7's process is gone (killed by "
        "SIGKILL): it was at t.py:38"
    )


def test_two_groups_called_in_different_orders_are_a_deadlock_naming_both():
    groups = {
        "0": Group("0", (0, 1), "default_pg"),
        "1": Group("1", (0, 1), "undefined"),
        "2": Group("2", (0, 1), "undefined"),
    }
    ranks = {
        0: RankState(0, call=call(seq=2, group="1", at="d.py:12"), seqs={"1": 2, "2": 1}),
        1: RankState(1, call=call(seq=2, group="2", at="d.py:15"), seqs={"1": 1, "2": 2}),
    }
    v = diagnose(ranks, groups, hang_after=30)
    assert v is not None and v.kind == "deadlock" and v.blamed == (0, 1)
    assert v.summary.startswith(
        "rank 0 waits in all_reduce #2 of group 1 at d.py:12 for rank 1, which waits in "
        "all_reduce #2 of group 2 at d.py:15 for rank 0: a deadlock between group 1 and group 2"
    )


def test_a_chain_through_another_group_ends_at_the_rank_that_holds_it():
    groups = {
        "0": Group("0", (0, 1, 2), "default_pg"),
        "4": Group("4", (0, 1), "dp"),
        "5": Group("5", (1, 2), "tp"),
    }
    ranks = {
        0: RankState(0, call=call(seq=9, group="4", at="m.py:1")),
        1: RankState(1, call=call("barrier", seq=3, group="5", at="m.py:2"), seqs={"4": 8}),
        2: RankState(2, seqs={"5": 2}, at="m.py:7", code="load()"),
    }
    v = diagnose(ranks, groups, hang_after=30)
    assert v is not None and v.kind == "stall" and v.blamed == (2,)
    assert (
        "rank 0 waits in all_reduce #9 of group 4 (dp) at m.py:1 for rank 1, which waits in "
        "barrier #3 of group 5 (tp)" in v.summary
    )
    assert (
        "rank 2 has not reached barrier #3 of group 5 (tp) for 40 s: it is at m.py:7" in v.summary
    )


def test_every_rank_in_the_collective_and_still_waiting_is_stuck():
    ranks = {r: RankState(r, call=call()) for r in (0, 1)}
    v = diagnose(ranks, DEFAULT, hang_after=30)
    assert v is not None and v.kind == "stuck"
    assert "every rank of its group is in it" in v.summary


def test_the_signature_ignores_the_time_waited():
    def state(waited: float):
        return {
            0: RankState(0, call=call(waited=waited)),
            1: RankState(1, seqs={"0": 3}, at=f"t.py:{int(waited)}"),
        }

    a = diagnose(state(31), DEFAULT, hang_after=30)
    b = diagnose(state(95), DEFAULT, hang_after=30)
    assert a is not None and b is not None
    assert a.signature == b.signature and a.summary != b.summary


@pytest.mark.parametrize(
    ("gaps", "expected"),
    [((), 30.0), ((2.0, 4.0), 30.0), ((45.0,), 45.0 * GAP_FACTOR)],
)
def test_hang_after_grows_with_the_longest_gap_between_collectives(gaps, expected):
    assert adaptive_hang_after(30.0, gaps) == expected


def test_a_slow_rank_within_the_adapted_time_is_not_judged():
    ranks = {
        0: RankState(0, call=call(waited=60), gap=45.0),
        1: RankState(1, seqs={"0": 3}, at="t.py:9", gap=45.0),
    }
    hang_after = adaptive_hang_after(30, (s.gap for s in ranks.values()))
    assert diagnose(ranks, DEFAULT, hang_after=hang_after) is None
    assert diagnose(ranks, DEFAULT, hang_after=30) is not None


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([3], "rank 3"),
        ([0, 2], "ranks 0, 2"),
        ([0, 1], "ranks 0, 1"),
        ([5, 0, 1, 2, 9], "ranks 0–2, 5, 9"),
    ],
)
def test_ranks_are_written_as_ranges(ranks, text):
    assert ranks_text(ranks) == text
