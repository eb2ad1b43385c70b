"""``ad.launch``: its configuration (pure), and real launches through torch's elastic agent.

The end-to-end tests spawn real worker processes (each imports torch: seconds apiece), so
there are few of them and one launch serves several tests. Every test runs under a guard
that fails it if a process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import anydevice as ad
import workers
from anydevice.launching import arguments
from anydevice.launching.elastic import plan, resolve_nprocs, scoped_environ
from anydevice.launching.options import LaunchOptions
from machines import gpu, machine
from ranks import free_port, process_tree_guard


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


# ----------------------------------------------------------------------------- nprocs


def test_nprocs_auto_is_one_per_gpu_else_one():
    assert resolve_nprocs("auto", machine(gpu(0), gpu(1), gpu(2))) == 3
    assert resolve_nprocs("auto", machine()) == 1


def test_nprocs_gpu_without_a_gpu_says_what_to_do():
    with pytest.raises(ad.DeviceNotFoundError, match="nprocs=N"):
        resolve_nprocs("gpu", machine())
    assert resolve_nprocs("gpu", machine(gpu(0), gpu(1))) == 2


@pytest.mark.parametrize("bad", [0, -2, "many", True, 1.5, 4097, "", None])
def test_nprocs_rejects_what_is_not_a_count(bad):
    with pytest.raises(ad.DistributedError, match=r"nprocs=.* \(-n\): give the processes"):
        resolve_nprocs(bad, machine())


def test_nprocs_accepts_digits_from_the_command_line():
    assert resolve_nprocs("4", machine()) == 4


# ----------------------------------------------------------------------------- plan


def test_standalone_binds_loopback_on_a_port_the_os_picks():
    p = plan(2, cores=8, environ={})
    assert p.standalone
    assert (p.min_nodes, p.max_nodes) == (1, 1)
    assert p.rdzv_endpoint == "127.0.0.1:0"
    assert p.local_addr == "127.0.0.1"
    assert p.rdzv_configs["is_host"] is True


def test_standalone_runs_get_distinct_run_ids():
    assert plan(2, environ={}).run_id != plan(2, environ={}).run_id


def test_join_timeout_bounds_the_rendezvous():
    assert plan(1, LaunchOptions(timeout=7.4), environ={}).rdzv_configs["join_timeout"] == 7


def test_several_nodes_need_an_endpoint():
    with pytest.raises(ad.DistributedError, match="rdzv_endpoint='HOST:PORT'"):
        plan(1, LaunchOptions(nnodes=2), environ={})


def test_node_rank_zero_hosts_the_store_and_others_do_not():
    host = plan(1, LaunchOptions(nnodes=2, node_rank=0, rdzv_endpoint="10.1.2.3:29400"), environ={})
    other = plan(
        1, LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="10.1.2.3:29400"), environ={}
    )
    assert host.rdzv_configs["is_host"] is True
    assert other.rdzv_configs["is_host"] is False
    assert host.run_id == other.run_id  # every node must agree without talking
    assert host.local_addr is None  # a real network: the hostname is looked up


def test_loopback_endpoint_keeps_every_node_on_loopback():
    assert (
        plan(1, LaunchOptions(nnodes=2, rdzv_endpoint="127.0.0.1:5000"), environ={}).local_addr
        == "127.0.0.1"
    )


@pytest.mark.parametrize(
    ("kwargs", "unshared"),
    [
        ({}, False),
        ({"max_restarts": 1}, True),
        ({"nnodes": "1:2", "rdzv_endpoint": "h:1"}, True),
    ],
)
def test_restarts_and_elastic_ranges_unshare_the_rendezvous_store(kwargs, unshared):
    p = plan(2, LaunchOptions(**kwargs), environ={})
    assert (p.env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1") is unshared


def test_user_setting_of_the_store_variable_is_respected():
    p = plan(2, LaunchOptions(max_restarts=2), environ={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in p.env


def test_the_hang_watch_waits_30_s_by_default_and_0_turns_it_off():
    assert plan(2, environ={}).hang_after == 30.0
    assert plan(2, LaunchOptions(hang_after=0), environ={}).hang_after == 0.0


def test_workers_share_the_cores_unless_omp_threads_is_set():
    assert plan(3, cores=12, environ={}).env["OMP_NUM_THREADS"] == "4"
    assert plan(4, cores=2, environ={}).env["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in plan(1, cores=12, environ={}).env
    assert "OMP_NUM_THREADS" not in plan(3, cores=12, environ={"OMP_NUM_THREADS": "2"}).env


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nnodes": "2:1", "rdzv_endpoint": "h:1"}, "MIN <= MAX"),
        ({"nnodes": "two", "rdzv_endpoint": "h:1"}, "MIN:MAX"),
        ({"nnodes": 2, "rdzv_endpoint": "no-port"}, "HOST:PORT"),
        ({"start_method": "thread"}, "spawn"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"timeout": 0}, "timeout"),
        (
            {"hang_after": -1},
            r"hang_after=-1 \(--hang-after\): give the seconds .*0 turns the hang watch off",
        ),
        ({"hang_after": float("nan")}, "hang_after=nan"),
    ],
)
def test_plan_rejects_bad_arguments_with_the_fix(kwargs, match):
    with pytest.raises(ad.DistributedError, match=match):
        plan(1, LaunchOptions(**kwargs), environ={})


def test_scoped_environ_restores_everything_also_on_error():
    def launch_that_fails():
        with scoped_environ({"ANYDEVICE_TEST_KEEP": "during"}):
            os.environ["ANYDEVICE_TEST_NEW"] = "written by the launch"
            raise KeyError("boom")

    os.environ["ANYDEVICE_TEST_KEEP"] = "before"
    try:
        with pytest.raises(KeyError):
            launch_that_fails()
        assert os.environ["ANYDEVICE_TEST_KEEP"] == "before"
        assert "ANYDEVICE_TEST_NEW" not in os.environ
    finally:
        del os.environ["ANYDEVICE_TEST_KEEP"]


# ----------------------------------------------------------------------------- refusals


def test_spawn_refuses_a_function_workers_cannot_import():
    with pytest.raises(ad.DistributedError, match="module level"):
        ad.launch(lambda: 1, nprocs=2)


def test_spawn_refuses_arguments_that_cannot_be_pickled():
    with pytest.raises(ad.DistributedError, match="picklable"):
        ad.launch(workers.fail_on, (x for x in range(3)), nprocs=2)


#: Bad values for each argument of ad.launch (with what makes the rest well formed): each
#: raised a raw TypeError, ValueError or OverflowError, or was taken (a wait of 1e300 s,
#: a port beyond 65535, an empty run id, verbose="yes").
_MULTI = {"nnodes": 2, "rdzv_endpoint": "127.0.0.1:29400", "node_rank": 0}
_BAD = [
    *[("nprocs", v, {}) for v in (0, -2, 1.5, math.nan, True, None, "", "many", 2**63, [])],
    *[("nnodes", v, {}) for v in (0, "0", "1:0", "x", 2.5, True, math.nan, None, 2**63, "")],
    *[("node_rank", v, _MULTI) for v in (-1, True, 1.5, "0", math.nan, 2, 2**63)],
    *[
        ("rdzv_endpoint", v, {"nnodes": 2, "node_rank": 0})
        for v in ("127.0.0.1:99999", "127.0.0.1:-1", ":80", "h:", "", 7, "a b:80", "h", b"h:1")
    ],
    ("rdzv_endpoint", "127.0.0.1:0", {"nnodes": 2, "node_rank": 1}),
    *[("run_id", v, {}) for v in ("", "  ", " job", 7, b"x", "a\nb", "\0", True)],
    *[("max_restarts", v, {}) for v in (-1, 1.5, math.nan, "1", True, None, math.inf)],
    *[("start_method", v, {}) for v in ("", None, 7, "thread")],
    *[
        ("timeout", v, {})
        for v in (math.nan, 0, -1, math.inf, -math.inf, 1e300, 2**63, "5", None, True)
    ],
    *[("grace", v, {}) for v in (math.nan, -1, math.inf, 1e300, 2**63, "5", None, True)],
    *[("log_dir", v, {}) for v in ("", 7, __file__, b"\0", [])],
    *[("verbose", v, {}) for v in ("yes", 2, None, "")],
    *[("local_addr", v, _MULTI) for v in ("", "  ", 7, [])],
]


@pytest.mark.parametrize(("name", "value", "rest"), _BAD, ids=[f"{n}={v!r}" for n, v, _ in _BAD])
def test_each_argument_of_launch_refuses_nonsense_naming_it_and_the_value(name, value, rest):
    with pytest.raises(ad.DistributedError) as info:
        ad.launch(workers.fail_on, 1, **{"nprocs": 1, **rest, name: value})
    message = str(info.value)
    assert f"{name}={value!r}" in message, message
    assert "give" in message or "use" in message, message  # and what to do


@pytest.mark.parametrize("fn", [None, 5, "workers.fail_on"])
def test_launch_refuses_what_cannot_be_called(fn):
    with pytest.raises(ad.DistributedError, match="cannot be called. Pass the function itself"):
        ad.launch(fn, nprocs=1)


def test_launch_takes_the_edges_of_each_range():
    arguments.check(
        nprocs=arguments.MOST_PROCESSES, nnodes=f"1:{arguments.MOST_NODES}", node_rank=0,
        rdzv_endpoint="[::1]:65535", run_id="job 7", max_restarts=2**63, timeout=0.5,
        grace=0, verbose=False, local_addr="10.0.0.1",
    )  # fmt: skip
    arguments.check(timeout=arguments.MOST_SECONDS, grace=arguments.MOST_SECONDS)
    arguments.check(nnodes=1, rdzv_endpoint="127.0.0.1:0")  # one node: the OS picks


# ----------------------------------------------------------------------------- in place


def test_inside_a_launched_world_the_function_runs_here(monkeypatch):
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", "1")
    before = ad.launch(os.getpid, nprocs=2)
    assert before == {1: os.getpid()}  # nothing spawned: this process, as rank 1


def test_in_place_under_torchelastic_leaves_the_traceback_for_the_outer_agent(
    monkeypatch, tmp_path
):
    error_file = tmp_path / "error.json"
    env = {
        "TORCHELASTIC_RUN_ID": "outer", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_ERROR_FILE": str(error_file),
    }  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ZeroDivisionError):
        ad.launch(operator.truediv, 1, 0)  # runs here, as rank 0 of the outer world
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"].startswith("ZeroDivisionError")
    assert "ZeroDivisionError" in recorded["extraInfo"]["py_callstack"]


# ----------------------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def ddp_run():
    """Two spawned workers train with DDP through ad.launch (the default start method)."""
    steps, lr = 5, 0.2
    env_before = dict(os.environ)
    with process_tree_guard():
        results = ad.launch(workers.ddp_steps, steps, lr, nprocs=2, timeout=60)
        env_after = dict(os.environ)
    return {"results": results, "steps": steps, "lr": lr, "env": (env_before, env_after)}


@pytest.mark.slow
def test_launch_returns_each_ranks_value_by_global_rank(ddp_run):
    results = ddp_run["results"]
    assert list(results) == [0, 1]
    assert [r["rank"] for r in results.values()] == [0, 1]
    assert {r["world_size"] for r in results.values()} == {2}
    assert len({r["pid"] for r in results.values()} | {os.getpid()}) == 3


@pytest.mark.slow
def test_launched_workers_form_a_gloo_group_with_ddp_on_cpu(ddp_run):
    for r in ddp_run["results"].values():
        assert (r["launcher"], r["backend"], r["device"]) == ("torchelastic", "gloo", "cpu")
        assert r["wrapper"] == "DistributedDataParallel"
        assert r["unwrapped_is_user_module"]


@pytest.mark.slow
def test_launched_workers_split_the_cores(ddp_run):
    cores = ad.inventory(telemetry=False).host.cores_usable
    expected = ddp_run["env"][0].get("OMP_NUM_THREADS") or str(max(1, cores // 2))
    assert {r["omp_threads"] for r in ddp_run["results"].values()} == {expected}


@pytest.mark.slow
def test_launch_leaves_this_process_environment_as_it_was(ddp_run):
    before, after = ddp_run["env"]
    assert after == before


@pytest.mark.slow
def test_ddp_parameters_are_identical_on_every_rank(ddp_run):
    p0, p1 = (r["params"] for r in ddp_run["results"].values())
    assert p0.keys() == p1.keys()
    for k in p0:
        assert torch.equal(p0[k], p1[k]), k


@pytest.mark.slow
def test_ddp_matches_one_process_training_on_the_concatenated_batch(ddp_run):
    steps, lr = ddp_run["steps"], ddp_run["lr"]
    net = workers.model(seed=0)  # DDP starts every rank from rank 0's weights
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    x, y = workers.batches(steps, world_size=2)
    for s in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[s]), y[s]).backward()
        optimizer.step()
    trained = ddp_run["results"][0]["params"]
    untrained = workers.model(seed=0).state_dict()
    for k, v in net.state_dict().items():
        assert not torch.allclose(v, untrained[k])  # training moved them
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failing_worker_names_its_rank_and_traceback_in_bounded_time():
    # What SIGINT did before: Python's default_int_handler, or SIG_IGN when the run was
    # started in the background by a shell without job control.
    sigint = signal.getsignal(signal.SIGINT)
    t = time.perf_counter()
    with pytest.raises(ad.WorkerFailedError) as info:
        # Rank 1 raises, then lingers: rank 0 fails on the closed connection and is seen
        # first, and rank 1 is stopped before its exception leaves the worker. Rank 1 is
        # still the cause: ad.distributed recorded its error before closing the group.
        ad.launch(workers.fail_on, 1, 600.0, nprocs=2, timeout=60)
    elapsed = time.perf_counter() - t
    err = info.value
    assert err.rank == 1
    assert err.exitcode == 1
    assert "ValueError: injected failure on rank 1" in err.traceback
    assert "workers.py" in err.traceback  # the worker's own frame, not the launcher's
    assert str(err).startswith("Rank 1 ")
    assert "injected failure on rank 1" in str(err)
    assert "rank(s) 0" in str(err)  # the bystander is named as such
    # not the 600 s linger, however busy the machine
    assert elapsed < 300, f"the failure took {elapsed:.1f} s to surface"
    assert signal.getsignal(signal.SIGINT) is sigint  # restored


def test_worker_failed_error_survives_pickling():
    err = ad.WorkerFailedError("Rank 3 failed", rank=3, exitcode=-9, failures={3: -9, 1: -15})
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.rank, back.exitcode, back.failures) == (
        "Rank 3 failed",
        3,
        -9,
        {3: -9, 1: -15},
    )


@pytest.mark.slow
def test_a_missing_node_times_out_within_the_configured_time():
    t = time.perf_counter()
    with pytest.raises(ad.DistributedTimeoutError, match="Not all nodes joined within 3 s"):
        ad.launch(
            workers.fail_on,
            0,
            nprocs=1,
            nnodes=2,
            node_rank=0,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            timeout=3,
        )
    elapsed = time.perf_counter() - t
    assert 3 <= elapsed < 60, elapsed  # not torch's 600-900 s, however busy the machine
    assert isinstance(ad.DistributedTimeoutError("x"), TimeoutError)


@pytest.mark.slow
def test_fork_start_method_launches_from_this_process():
    """From a fresh interpreter: workers forked from this test process would inherit what
    earlier tests left in it (threads, process groups), and a rank once died of SIGSEGV
    collecting that garbage, which is the hazard of fork, not of the launch."""
    code = (
        "import operator, anydevice as ad\n"
        "if __name__ == '__main__':\n"
        "    print(ad.launch(operator.mul, 6, 7, nprocs=2, start_method='fork'))\n"
    )
    env = {**os.environ, "ANYDEVICE_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "{0: 42, 1: 42}", proc.stdout


@pytest.mark.long  # launches and waits of a minute (make test-long)
@pytest.mark.slow
def test_max_restarts_restarts_a_worker_that_fails_once():
    results = ad.launch(workers.fail_first_attempt, nprocs=2, max_restarts=1, timeout=60)
    assert results == {0: (0, 1), 1: (1, 1)}  # both ranks finished, on the second attempt


_AFTER_OPENMP = """
import torch

import anydevice as ad


def work():
    y = torch.nn.functional.gelu(torch.randn(2048, 2048))  # a parallel op in the worker
    return torch.get_num_threads() if bool(torch.isfinite(y).all()) else -1


if __name__ == "__main__":
    x = torch.randn(2048, 2048)
    for _ in range(3):
        torch.nn.functional.gelu(x)  # the launcher uses OpenMP's threads before forking
    print("result", ad.launch(work, nprocs=2, start_method="fork", timeout=60), flush=True)
"""


def test_fork_workers_compute_after_the_launcher_used_openmp(tmp_path):
    # GNU OpenMP hangs the first parallel op of a process forked after its parent ran
    # parallel regions: forked workers must compute on one thread, not wait forever.
    script = tmp_path / "after_openmp.py"
    script.write_text(_AFTER_OPENMP)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("forked workers hung in their first parallel op (killed after 100 s)")
    assert proc.returncode == 0, err[-2000:]
    assert "result {0: 1, 1: 1}" in out, out + err[-2000:]


# ----------------------------------------------------------------------------- main guard


def run_script(path, *args: str, timeout: float = 100.0) -> subprocess.CompletedProcess[str]:
    """``python PATH ARGS`` in its own session, killed with its whole group after
    ``timeout`` seconds (which fails the test)."""
    proc = subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{path} ran past {timeout} s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


_UNGUARDED = """
import anydevice as ad


def work(x):
    return x + 1


print("result", ad.launch(work, 1, nprocs=2, timeout=60))
"""

_GUARDED = """
import anydevice as ad


def work(x):
    return x + 1


def main():
    print("result", ad.launch(work, 1, nprocs=2, timeout=60))


if __name__ == "__main__":
    main()
"""

#: The script's top level is compiled from a string: no source line to look at before
#: starting, so the starting worker is what notices.
_UNGUARDED_WITHOUT_SOURCE = """
exec(compile('''
import anydevice as ad
from work_module import work
print("result", ad.launch(work, 1, nprocs=2, timeout=60))
''', "<generated>", "exec"))
"""


def test_a_script_that_launches_outside_the_main_guard_is_told_so_before_starting(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    proc = run_script(script)
    assert proc.returncode == 1
    assert "result" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert 'unguarded.py line 9 calls ad.launch outside `if __name__ == "__main__":`' in last
    assert "Put the call under that guard." in last
    assert "bootstrapping phase" not in proc.stderr  # multiprocessing's error, twice
    assert "no Python traceback" not in proc.stderr


def test_a_launch_under_the_main_guard_runs(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(_GUARDED)
    proc = run_script(script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "result {0: 2, 1: 2}" in proc.stdout


def test_a_worker_that_starts_a_launch_again_says_which_guard_is_missing(tmp_path):
    (tmp_path / "work_module.py").write_text("def work(x):\n    return x + 1\n")
    script = tmp_path / "generated.py"
    script.write_text(_UNGUARDED_WITHOUT_SOURCE)
    proc = run_script(script)
    assert proc.returncode != 0
    assert "ad.launch was called again in a starting worker" in proc.stderr
    assert 'outside `if __name__ == "__main__":`' in proc.stderr
    assert "bootstrapping phase" not in proc.stderr


@pytest.mark.parametrize(
    ("source", "line", "guarded"),
    [
        ("ad.launch(f)\n", 1, False),
        ("if __name__ == '__main__':\n    ad.launch(f)\n", 2, True),
        ("if '__main__' == __name__:\n    ad.launch(f)\n", 2, True),
        ("if __name__ == '__main__' and ok:\n    main()\n", 2, True),
        ("try:\n    if __name__ == '__main__':\n        main()\nexcept E:\n    pass\n", 3, True),
        ("try:\n    pass\nexcept E:\n    if __name__ == '__main__':\n        main()\n", 5, True),
        ("if ok:\n    main()\n", 2, False),
        ("if __name__ == '__main__':\n    pass\nelse:\n    main()\n", 4, False),
        ("def main():\n    ad.launch(f)\n\n\nmain()\n", 5, False),
    ],
)
def test_the_guard_is_found_around_the_launching_line(source, line, guarded):
    import ast

    from anydevice.launching.preflight import _guarded

    assert _guarded(ast.parse(source), line) is guarded


# ----------------------------------------------------------------------------- rendezvous faults


def launch_cli(*args: str) -> subprocess.Popen[str]:
    """``anydevice launch ARGS`` in its own session, on the CPU."""
    return subprocess.Popen(
        [sys.executable, "-m", "anydevice", "launch", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "ANYDEVICE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); the whole session is killed on timeout, failing."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout} s")
    return proc.returncode, out, err


@contextlib.contextmanager
def silent_server(accept: bool = True) -> Iterator[int]:
    """A port on 127.0.0.1 where a plain socket listens (and, with ``accept``, accepts
    every connection and never says a word); closed afterwards."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    if accept:
        thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        if accept:
            thread.join(5)
        for s in [*held, listener]:
            s.close()


#: A worker that waits for a file to appear (at most 90 s), then says so.
_WAITER = """
import os, sys, time
deadline = time.time() + 90
while not os.path.exists(sys.argv[1]) and time.time() < deadline:
    time.sleep(0.1)
print("done", os.environ["RANK"], flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)  # each wait below kills what hangs
def test_an_endpoint_that_accepts_and_never_answers_fails_within_the_timeout():
    with silent_server() as port:
        t = time.perf_counter()
        proc = launch_cli(
            *("-n", "1", "--nnodes", "2", "--node-rank", "1", "--timeout", "5"),
            *("--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "json.tool", "--help"),
        )
        code, _, err = finish(proc, timeout=150)  # without a bound: until killed
        elapsed = time.perf_counter() - t
    assert code == 1, err
    assert err.startswith(
        f"anydevice launch: Something at 127.0.0.1:{port} accepted the connection but did "
        "not answer torch's store handshake within 5 s"
    ), err
    assert f"pid {os.getpid()}" in err  # what listens there: this test
    assert len(err.strip().splitlines()) == 1, err  # torch's page of native frames stays out
    assert elapsed >= 5


@pytest.mark.long  # launches and waits of a minute (make test-long)
@pytest.mark.slow
@pytest.mark.timeout(600)  # each wait below kills what hangs
def test_a_store_that_stops_answering_fails_its_request_within_the_timeout(tmp_path):
    # Node 0 hosts the store of a 3-node rendezvous; node 1 joins, then node 0 is stopped
    # (SIGSTOP: the kernel still holds the connection, nothing answers on it).
    import psutil

    script = tmp_path / "waiter.py"
    script.write_text(_WAITER)
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("-n", "1", "--nnodes", "3", "--rdzv-endpoint", endpoint)
    host = launch_cli(*common, "--node-rank", "0", "--timeout", "120", str(script), "x")
    try:
        port = int(endpoint.rpartition(":")[2])
        deadline = time.monotonic() + 120
        while not any(
            c.status == psutil.CONN_LISTEN and c.laddr[1] == port
            for c in psutil.Process(host.pid).net_connections()
        ):
            assert host.poll() is None and time.monotonic() < deadline, "node 0 never listened"
            time.sleep(0.1)
        node = launch_cli(*common, "--node-rank", "1", "--timeout", "10", str(script), "x")
        while len(getattr(_rendezvous_state(endpoint), "participants", ())) < 2:
            # node 1 has joined: the store answered its handshake and its requests
            assert node.poll() is None, node.communicate()
            assert time.monotonic() < deadline, "node 1 never joined"
            time.sleep(0.1)
        os.killpg(host.pid, signal.SIGSTOP)
        code, _, err = finish(node, timeout=150)  # without a bound: until node 0 goes on
    finally:
        os.killpg(host.pid, signal.SIGKILL)
        os.killpg(host.pid, signal.SIGCONT)
        host.communicate()
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        f"anydevice launch: The rendezvous store at {endpoint} answered, then a request to "
        "it got no reply within 10 s: the node that hosts it (node_rank=0) is stuck"
    ), err


@pytest.mark.slow
@pytest.mark.timeout(600)  # the wait below kills what hangs
@pytest.mark.parametrize("nodes", [(), ("--nnodes", "2", "--node-rank", "0")], ids=["one", "0"])
def test_a_taken_port_is_said_to_be_in_use_and_by_whom(nodes):
    with silent_server(accept=False) as port:  # listens, accepts nothing
        proc = launch_cli(
            *("-n", "1", *nodes, "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "5"),
            *("-m", "json.tool", "--help"),
        )
        code, _, err = finish(proc, timeout=150)  # torch's client: until killed
    assert code == 1, err
    assert err.startswith(
        f"anydevice launch: Port {port} of 127.0.0.1 is in use (pid {os.getpid()}: "
    ), err
    assert "cannot host the rendezvous there. Choose another port" in err
    assert "node_rank=0 on that host first" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(600)  # each wait below kills what hangs
def test_a_second_job_on_the_same_endpoint_is_told_another_job_holds_it(tmp_path):
    script, go = tmp_path / "waiter.py", tmp_path / "go"
    script.write_text(_WAITER)
    endpoint = f"127.0.0.1:{free_port()}"
    first = launch_cli("-n", "1", "--rdzv-endpoint", endpoint, "--timeout", "60", str(script),
                       str(go))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _runs(first.pid, "waiter.py"):  # its rendezvous is complete: its worker runs
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        second = [
            launch_cli("-n", "1", "--rdzv-endpoint", endpoint, "--timeout", "10", str(script),
                       str(go)),
            launch_cli("-n", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                       endpoint, "--timeout", "10", str(script), str(go)),
        ]  # fmt: skip
        results = [finish(p, timeout=150) for p in second]
    finally:
        go.touch()
        code, out, err = finish(first, timeout=150)
    for other_code, other_out, other_err in results:
        assert other_code == 1, other_err
        assert other_err.startswith(
            f"anydevice launch: Another job holds the rendezvous endpoint {endpoint}"
        ), other_err
        assert "Choose another port for rdzv_endpoint (--rdzv-endpoint)" in other_err
        assert "is_failed" not in other_err and "done" not in other_out
        assert len(other_err.strip().splitlines()) == 1, other_err
    assert (code, out.split()) == (0, ["done", "0"]), err  # undisturbed: one run, no restart


def _runs(pid: int, name: str) -> bool:
    """Whether a descendant of ``pid`` has ``name`` in its command line."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if name in " ".join(child.cmdline()):
                return True
    return False


def _rendezvous_state(endpoint: str, run_id: str = "anydevice") -> Any:
    """The state torch's c10d rendezvous keeps in the store at ``endpoint``, or None."""
    import base64
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    key = f"torch.rendezvous.{run_id}"
    if not store.check([key]):
        return None
    try:
        return pickle.loads(base64.b64decode(store.get(key)))
    except Exception:  # the null sentinel before the first write
        return None


@pytest.mark.slow
@pytest.mark.timeout(600)  # each wait below kills what hangs
def test_a_spare_node_whose_rendezvous_closes_says_so(tmp_path):
    # A node of a 1:2 range that arrives at a complete 2-node round waits as a spare (torch
    # gives it no timeout) until that job ends and closes the rendezvous: torch's agent
    # then returns no result at all.
    script, go = tmp_path / "waiter.py", tmp_path / "go"
    script.write_text(_WAITER)
    endpoint = f"127.0.0.1:{free_port()}"
    job = [
        launch_cli("-n", "1", "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint",
                   endpoint, "--timeout", "60", str(script), str(go))
        for r in (0, 1)
    ]  # fmt: skip
    spare = None
    try:
        deadline = time.monotonic() + 120
        while not all(_runs(p.pid, "waiter.py") for p in job):
            assert all(p.poll() is None for p in job) and time.monotonic() < deadline
            time.sleep(0.1)
        spare = launch_cli("-n", "1", "--nnodes", "1:2", "--rdzv-endpoint", endpoint,
                           "--timeout", "60", str(script), str(go))  # fmt: skip
        while not getattr(_rendezvous_state(endpoint), "redundancy_list", None):
            assert spare.poll() is None, spare.communicate()
            assert time.monotonic() < deadline, "the spare never joined"
            time.sleep(0.2)
    finally:
        go.touch()
        ends = [finish(p, timeout=150) for p in job]
        if spare is not None:
            code, out, err = finish(spare, timeout=150)
    assert [(c, o.split()) for c, o, _ in ends] in (
        [(0, ["done", "0"]), (0, ["done", "1"])],
        [(0, ["done", "1"]), (0, ["done", "0"])],
    ), ends
    assert code == 1, err
    assert "is_failed" not in err, err
    # It sees the rendezvous closed, or (a moment later) its store gone with node 0.
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            (
                f"anydevice launch: The rendezvous 'anydevice' at {endpoint} was closed while this "
                "node was in it",
                f"anydevice launch: The rendezvous store at {endpoint} closed the connection",
            )
        )
    ), err
    assert "done" not in out
