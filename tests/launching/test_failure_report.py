"""The launcher's failure report read from real records: torch elastic's own failure
objects over error files and stack dumps laid out as a launch leaves them."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from anydevice.launching.failures import stacks_file, worker_failed


def _record(path: Path, message: str, when: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = f'Traceback (most recent call last):\n  File "train.py", line 9\n{message}\n'
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": message,
                    "extraInfo": {"py_callstack": trace, "timestamp": str(int(when))},
                },
                "anydevice": {"time": when, "consequence": True},
            }
        )
    )


def test_a_waiting_rank_stopped_between_its_record_and_its_exit_still_exits_1(tmp_path):
    """Ranks 0 and 2 time out waiting for rank 1; rank 2 recorded its error first, but the
    launcher stopped it (SIGTERM) after rank 0 exited and before rank 2 did. The launch
    is a failure of the waiting ranks' (exit 1), not a signal the user sent (143)."""
    attempt = tmp_path / "run" / "attempt_0"
    now = time.time()
    timeout = "RuntimeError: Timed out waiting 10000ms for recv operation to complete"
    _record(attempt / "0" / "error.json", timeout, now + 0.2)
    _record(attempt / "2" / "error.json", timeout, now)
    (attempt / "1").mkdir(parents=True)
    launch_dir = tmp_path / "launch"
    stack = stacks_file(launch_dir, 1)
    stack.parent.mkdir(parents=True)
    stack.write_text(
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/tmp/hang.py", line 18 in <module>\n'
    )
    failures = {
        0: ProcessFailure(0, 101, 1, str(attempt / "0" / "error.json")),
        1: ProcessFailure(1, 102, -signal.SIGTERM, str(attempt / "1" / "error.json")),
        2: ProcessFailure(2, 103, -signal.SIGTERM, str(attempt / "2" / "error.json")),
    }
    error = worker_failed(ChildFailedError("train.py", failures), nprocs=3, launch_dir=launch_dir)
    assert str(error).startswith("Rank(s) 1 never arrived: rank(s) 0, 2 waited"), str(error)
    assert error.exitcode == 1
