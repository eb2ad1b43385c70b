"""The README's training loop on 2 ranks, stopped and resumed again and again, ends as the
run never stopped does: the same samples in every epoch, the same losses, the same weights
bit for bit (issue 34's soak, CI-sized; tests/soak.py has the loop and the verdict,
benchmarks/soak_resume.py runs it for 30 cycles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ranks import process_tree_guard
from soak import SAMPLES, kill_plan, soak, verdict

pytestmark = pytest.mark.slow

#: Ten stops, all after epoch 0 (where a sampler restarted at epoch 0's order shows):
#: preemptions (SIGTERM) and SIGKILLs on either rank, at a batch, after the optimizer step,
#: from a timer, and right after a background save returned while its write goes on.
SEED, CYCLES, EPOCHS = 251, 10, 4


def test_the_plan_stops_both_ranks_both_ways_in_later_epochs() -> None:
    plan = kill_plan(SEED, CYCLES, EPOCHS)
    assert {(k["signal"], k["rank"]) for k in plan} == {
        ("SIGTERM", 0),
        ("SIGKILL", 0),
        ("SIGTERM", 1),
        ("SIGKILL", 1),
    }
    assert "saving" in {k["phase"] for k in plan}
    assert all(k["step"] > 6 for k in plan)  # epoch 0 has steps 1-6


@pytest.mark.long  # minutes: make test-long
@pytest.mark.timeout(700)  # two launches of up to 300 s each on a busy machine
def test_a_resumed_run_is_bit_identical_to_one_never_stopped(tmp_path: Path) -> None:
    with process_tree_guard():
        result = soak(tmp_path, SEED, CYCLES, EPOCHS, generator=False, workers=0, timeout=300)
    found = verdict(tmp_path, result)
    assert found["attempts"] == [CYCLES]  # every stop restarted the ranks; the last ran out
    assert found["steps"]["reference"] == EPOCHS * 6
    assert found["steps"]["soak"] > found["steps"]["reference"]  # steps after a save redone
    assert found["diverged"] == []  # every step of every attempt: the reference's ids, loss
    assert (found["repeated"], found["skipped"]) == (0, 0), found
    assert found["identical"], found  # both ranks' final weights, bit for bit
    assert len(found["resumed_at"]) == CYCLES + 1 and found["resumed_at"][0] == 0
    assert all(r > 0 for r in found["resumed_at"][1:]), found["resumed_at"]
    assert 2 * 8 * found["steps"]["reference"] == SAMPLES * EPOCHS
