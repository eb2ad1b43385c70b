"""``tests/conftest.py``: the scheduler hands out the multi-process tests first, a file's
together."""

from __future__ import annotations

from pathlib import Path

from conftest import WORLDS, _slow_tests, world_scope

TESTS = Path(__file__).resolve().parent


def test_slow_tests_are_found_in_every_folder_of_the_suite():
    """The tests live in folders mirroring the package: a ``slow`` test in tests/cli/ or
    tests/launching/ starts processes too, and must not run beside another world (it
    did, once the tests moved into folders, where only tests/*.py was read)."""
    slow = _slow_tests(TESTS)
    assert "test_two_nodes_on_this_machine_finish_together" in slow  # tests/cli/
    assert "test_forked_workers_and_no_workers_import_nothing_and_run" in slow  # tests/feeding/
    assert "test_sigkill_during_a_background_write_leaves_the_previous_checkpoint" in slow
    # a module's pytestmark (tests/launching/test_reaper.py: launches)
    assert "test_sigkill_to_the_launcher_leaves_nothing_the_workers_started" in slow
    # the mark above a parametrize written over several lines
    assert "test_more_examples_run_on_the_simulator_under_its_own_name" in slow
    # two gloo ranks (tests/training/test_accumulation.py)
    assert "test_two_ranks_reduce_once_per_step_and_match_one_process_on_the_whole_batch" in slow
    assert "test_micro_batch_size_refuses_what_cannot_be_split" not in slow  # in-process


def test_every_world_file_is_one_the_suite_has():
    every = {p.name for p in TESTS.rglob("test_*.py")}
    assert every >= WORLDS, WORLDS - every


def test_a_files_worlds_are_one_unit_and_in_process_tests_are_not():
    slow = _slow_tests(TESTS)
    file = "tests/launching/test_hangwatch.py"
    a = f"{file}::test_a_mismatched_collective_stops_the_job_with_both_lines"
    b = f"{file}::test_two_nodes_stop_a_mismatch_with_one_verdict"
    assert world_scope(a, slow) == world_scope(b, slow) == f"world {file}"
    slow_one = "tests/cli/test_cli.py::test_two_nodes_on_this_machine_finish_together"
    assert world_scope(slow_one, slow) == "world tests/cli/test_cli.py"
    assert world_scope("tests/test_api.py::test_lazy_names[x]", slow) is None
