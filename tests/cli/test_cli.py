"""The ``anydevice`` command, run as a real subprocess (launches in their own session, so a
timeout stops the whole process tree)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from anydevice.cli import commands as cli
from conftest import cuda_gpu_present
from ranks import process_tree_guard


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "anydevice", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_info_json_is_the_inventory():
    out = run("info", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["schema"] == "anydevice.inventory/1"
    assert data["devices"][-1]["kind"] == "cpu"


def test_info_table_shows_host_and_devices():
    out = run("info")
    assert out.returncode == 0, out.stderr
    assert "host" in out.stdout and "torch" in out.stdout
    assert "cpu" in out.stdout


def test_info_json_without_torch_has_the_schema_of_info_torch():
    light, full = run("info", "--json"), run("info", "--json", "--torch")
    assert light.returncode == full.returncode == 0, light.stderr + full.stderr
    a, b = json.loads(light.stdout), json.loads(full.stdout)
    assert a["schema"] == b["schema"]
    assert set(a["host"]) == set(b["host"])
    assert [set(d) for d in a["devices"]] == [set(d) for d in b["devices"]]
    for key in ("torch", "torch_build", "cuda_runtime", "cpu_model", "cores_usable"):
        assert a["host"][key] == b["host"][key], key
    assert a["host"]["torch_threads"] is None and b["host"]["torch_threads"] >= 1
    assert any("thread count is not probed" in n for n in a["notes"])


# The command under a harness that reports afterwards whether torch was imported.
HARNESS = """
import json, sys
from anydevice.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def imports_torch(*args: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", HARNESS, *args], capture_output=True, text=True, timeout=120
    )
    report = json.loads(out.stderr.strip().splitlines()[-1])
    return report["torch"], report["code"]


@pytest.mark.parametrize(
    "args",
    [
        ("--help",),
        ("info", "--help"),
        ("top", "--help"),
        ("select", "--help"),
        ("doctor", "--help"),
        ("launch", "--help"),
        ("info",),
        ("info", "--json"),
        ("select", "-n", "2"),
        ("top", "--once"),
        ("top", "--json", "--once"),
    ],
)
def test_help_info_top_and_select_do_not_import_torch(args):
    torch_imported, code = imports_torch(*args)
    assert code in (0, 1), code
    assert not torch_imported


def test_info_torch_does_import_torch():
    assert imports_torch("info", "--torch", "--json") == (True, 0)


# ----------------------------------------------------------------------------- top


@pytest.mark.skipif(cuda_gpu_present(), reason="the no-GPU view")
def test_top_once_without_a_gpu_shows_the_host_and_says_there_is_no_gpu():
    out = run("top", "--once")
    assert out.returncode == 0, out.stderr
    assert "CPU" in out.stdout and "RAM" in out.stdout and socket.gethostname() in out.stdout
    assert "no GPU" in out.stdout


def test_top_json_prints_one_record_per_interval():
    out = run("top", "--json", "--interval", "0.05", "--count", "3")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(records) == 3
    assert all(r["schema"] == "anydevice.top/2" for r in records)
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[-1] - times[0] >= 0.1
    host = records[0]["host"]
    assert 0 <= host["cpu_percent"] <= 100
    assert 0 < host["memory_used"] < host["memory_total"]
    if not cuda_gpu_present():
        assert records[0]["devices"] == [] and "no GPU" in records[0]["notes"][0]


@pytest.mark.parametrize("bad", [["--interval", "0"], ["--interval", "x"], ["--count", "0"]])
def test_top_refuses_bad_arguments(bad):
    out = run("top", *bad)
    assert out.returncode == 2 and "anydevice top: error" in out.stderr


@pytest.mark.cuda
@pytest.mark.real_gpu("NVML telemetry, read by the CLI in its own process")
def test_top_json_lists_every_gpu_with_both_indices():
    from anydevice.hardware.inventory import inventory_without_torch

    out = run("top", "--json", "--once")
    (record,) = [json.loads(line) for line in out.stdout.splitlines()]
    gpus = [d for d in record["devices"] if d["source"] == "nvml"]
    visible = inventory_without_torch(kinds=("cuda",)).of_kind("cuda")
    by_uuid = {g["uuid"]: g for g in gpus}
    for d in visible:
        g = by_uuid[d.uuid]
        assert (g["torch_name"], g["index"]) == (d.spec, d.smi_index)
        assert g["name"] == d.name and g["memory_total"] == d.memory_total
        assert g["utilization"] is not None and g["temperature"] is not None
        assert g["processes"] is not None
    table = run("top", "--once").stdout
    assert "devices" in table and f"cuda:{visible[0].index}" in table


# ----------------------------------------------------------------------------- select


@pytest.mark.skipif(cuda_gpu_present(), reason="the no-GPU answer")
def test_select_without_a_gpu_exits_1_and_says_why():
    out = run("select", "-n", "2")
    assert out.returncode == 1 and out.stdout == ""
    assert "anydevice select: no CUDA GPU to select:" in out.stderr


@pytest.mark.parametrize(
    "bad",
    [["-n", "0"], ["--min-free", "8 apples"], ["--max-util", "150"], ["--format", "name"]],
)
def test_select_refuses_bad_arguments(bad):
    out = run("select", *bad)
    assert out.returncode == 2 and "anydevice select: error" in out.stderr


@pytest.mark.cuda
@pytest.mark.real_gpu("NVML's GPUs, read by the CLI in its own process")
def test_select_prints_the_freest_gpus_by_uuid_and_index():
    from anydevice.hardware.freest import choose_free
    from anydevice.hardware.inventory import inventory_without_torch

    gpus = inventory_without_torch(kinds=("cuda",)).of_kind("cuda")
    out = run("select", "-n", "1")
    assert out.returncode == 0, out.stderr
    (uuid,) = out.stdout.strip().split(",")
    picked = next(d for d in gpus if d.uuid == uuid)
    # The freest by the rule. Other processes may move memory between the two readings:
    # the pick must then be within 1 GiB of the freest seen here.
    best = choose_free(gpus, 1).picked[0]
    assert picked == best or picked.memory_free >= best.memory_free - 2**30
    index = run("select", "-n", "1", "--format", "index")
    if index.returncode == 0:
        assert int(index.stdout) in {d.smi_index for d in gpus}
    else:
        assert "CUDA_DEVICE_ORDER" in index.stderr
    too_many = run("select", "-n", str(len(gpus) + 1))
    assert too_many.returncode == 1
    assert f"{len(gpus) + 1} GPU(s) wanted, {len(gpus)} qualify" in too_many.stderr
    none_fit = run("select", "--min-free", "100TiB")
    assert none_fit.returncode == 1 and "free < 100.0 TiB" in none_fit.stderr


def test_doctor_json_exit_code_matches_verdict():
    out = run("doctor", "--json", "--no-measure")
    data = json.loads(out.stdout)
    assert data["schema"] == "anydevice.doctor/1"
    assert out.returncode == (0 if data["ok"] else 1)
    assert len(data["checks"]) >= 6
    assert data["measurements"] is None


@pytest.mark.timeout(360)
def test_doctor_quick_json_measures_this_machine_within_its_budget(tmp_path):
    picture = tmp_path / "doctor.png"
    out = run("doctor", "--quick", "--json", "--plot", str(picture), timeout=300)
    assert out.returncode in (0, 1), out.stderr
    data = json.loads(out.stdout)
    m = data["measurements"]
    assert m["plan"] == "quick" and m["budget"] == 10.0
    # One call predicted from the size below may run over, by more on a loaded machine: a
    # bound only an ignored budget would break, not a speed.
    assert 0 < m["seconds"] < 10.0 + 30.0
    cpu = {r["name"]: r for r in m["results"] if r["device"] == "cpu"}
    assert cpu["matmul-fp32"]["unit"] == "GFLOP/s" and cpu["matmul-fp32"]["value"] > 0
    assert cpu["memory-copy"]["unit"] == "GB/s" and cpu["memory-copy"]["value"] > 0
    levers = {lv["name"] for lv in m["levers"]}
    for name, step in (("autocast", "training step"), ("channels-last", "channels_last")):
        # measured, or (where other jobs slowed the steps before it) said not to be
        spent = f"cpu: {step}: not measured (the 10 s budget was spent)"
        assert name in levers or spent in m["notes"], (name, m["notes"])
    assert all("spread" in lv and "noisy" in lv for lv in m["levers"])
    assert [d["device"] for d in m["devices"]][-1] == "cpu"
    assert m["advice"] and m["load"]["usable"] >= 1
    assert data["inventory"]["host"]["cpu_model"]  # the machine the numbers belong to
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size > 10_000
    assert f"wrote {picture}" in out.stderr


@pytest.mark.long  # the doctor measuring a while (make test-long)
@pytest.mark.timeout(360)
def test_doctor_table_prints_a_verdict_line_and_the_measurements():
    out = run("doctor", "--quick", "--device", "CPU", timeout=300)
    assert "check" in out.stdout
    assert ("no check failed" in out.stdout) == (out.returncode == 0)
    assert "what each lever buys here" in out.stdout and "side by side" in out.stdout
    assert "machine load while measuring" in out.stdout
    assert "measured in" in out.stdout


def _device_error(spec: str) -> str:
    import anydevice as ad
    from anydevice.errors import AnydeviceError

    with pytest.raises(AnydeviceError) as info:
        ad.device(spec)
    return str(info.value)


@pytest.fixture
def doctor_work(monkeypatch):
    """The calls the doctor made to check and measure (none, for a refusal), each recorded
    and then let through."""
    import anydevice.doctor

    calls: list[str] = []
    examine = anydevice.doctor.examine

    def recorded(*args, **kwargs):
        calls.append("examine")
        return examine(*args, **kwargs)

    monkeypatch.setattr(anydevice.doctor, "examine", recorded)
    return calls


@pytest.mark.parametrize("spec", ["cuda:7", "banana", "gpu:-1", "cpu:1"])
@pytest.mark.parametrize("plan", ["--no-measure", "--quick"])
def test_doctor_refuses_a_device_as_ad_device_does_before_any_work(spec, plan, capsys, doctor_work):
    assert cli.main(["doctor", plan, "--device", spec]) == 2
    out = capsys.readouterr()
    assert out.err.strip() == f"anydevice doctor: {_device_error(spec)}"
    assert out.out == "" and doctor_work == []  # nothing checked or measured


def test_doctor_takes_ad_devices_grammar_case_insensitive(capsys):
    assert cli.main(["doctor", "--no-measure", "--json", "--device", "CPU", "--device", "0"]) == 2
    assert "GPU" in capsys.readouterr().err  # "0" is a GPU index, as for ad.device(0)
    code = cli.main(["doctor", "--no-measure", "--json", "--device", "CPU", "--device", "cpu:0"])
    assert code in (0, 1)
    assert json.loads(capsys.readouterr().out)["measurements"] is None


def test_doctor_fails_a_bogus_anydevice_device_with_the_fix(monkeypatch, capsys):
    monkeypatch.setenv("ANYDEVICE_DEVICE", "bogus")
    assert cli.main(["doctor", "--no-measure", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    (check,) = [c for c in data["checks"] if c["name"] == "device-env"]
    assert check["status"] == "fail" and "bogus" in check["summary"]
    assert "unset ANYDEVICE_DEVICE" in check["fix"]
    assert data["ok"] is False


def test_doctor_plot_without_measurements_is_refused(tmp_path, capsys):
    assert cli.main(["doctor", "--no-measure", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs measurements" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("missing/d.png", "does not exist"),
        ("d.txt", "txt is not a picture format"),
        (".", "that is a folder"),
    ],
)
def test_doctor_plot_that_cannot_be_written_is_refused_before_measuring(
    tmp_path, target, words, capsys, doctor_work
):
    assert cli.main(["doctor", "--plot", str(tmp_path / target)]) == 2
    out = capsys.readouterr()
    assert words in out.err, out.err
    assert out.out == "" and doctor_work == []  # the 30 s plan never ran


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def _read_until(fd: int, done: Callable[[str], bool], seconds: float) -> str:
    """What a terminal shows, read from its pty until ``done(text)``, EOF or ``seconds``."""
    import select

    text, deadline = "", time.monotonic() + seconds
    while not done(ANSI.sub("", text)) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            text += chunk.decode(errors="replace")
    return ANSI.sub("", text)


@pytest.mark.timeout(600)
def test_ctrl_c_during_the_doctor_reports_what_was_measured_in_one_line_and_exits_130():
    """In a real terminal (a pty): SIGINT once the progress bar shows a step done. The
    report holds that step's number; one line says it was interrupted; no traceback. The
    full plan (3 minutes of measuring) is still measuring when the signal comes, however
    far behind the bar this test reads on a busy machine."""
    import pty

    main_fd, sub_fd = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "TERM": "xterm"}
    env.pop("ANYDEVICE_DEVICE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "anydevice", "doctor", "--full", "--device", "cpu"],
        stdin=subprocess.DEVNULL, stdout=sub_fd, stderr=sub_fd, env=env, start_new_session=True,
    )  # fmt: skip
    os.close(sub_fd)
    try:
        step_done = re.compile(r"measuring\b.*?\b[1-9]\d*/\d+", re.S)
        before = _read_until(main_fd, lambda t: bool(step_done.search(t)), 240)
        assert step_done.search(before), before
        assert proc.poll() is None, before  # still measuring
        proc.send_signal(signal.SIGINT)
        after = _read_until(main_fd, lambda t: False, 120)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(main_fd)
    assert code == 130, after
    assert "Traceback" not in after and "KeyboardInterrupt" not in after, after
    said = [line for line in after.splitlines() if line.startswith("anydevice doctor:")]
    assert len(said) == 1 and "interrupted (Ctrl-C)" in said[0], after
    assert "matmul fp32" in after  # the first step, measured before the signal
    assert "steps measured, the rest not" in after  # the report's note


def test_ctrl_c_before_measuring_says_so_in_one_line(monkeypatch, capsys):
    import anydevice.doctor

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(anydevice.doctor, "examine", interrupted)
    assert cli.main(["doctor", "--no-measure"]) == 130
    out = capsys.readouterr()
    assert out.err == "anydevice doctor: interrupted (Ctrl-C) before anything was measured.\n"
    assert out.out == ""


def test_doctor_plot_without_matplotlib_is_refused_before_measuring(
    tmp_path, monkeypatch, capsys, doctor_work
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli.main(["doctor", "--plot", str(tmp_path / "d.png")]) == 2
    out = capsys.readouterr()
    assert "--plot needs matplotlib" in out.err and "anydevice[plot]" in out.err
    assert out.out == "" and doctor_work == []


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["doctor", "--fast"], "--fast (did you mean --quick?)"),
        (["doctor", "--jsn"], "--jsn (did you mean --json?)"),
        (["doctor", "--devices", "cpu"], "--devices (did you mean --device?)"),
        (["info", "--jsno"], "--jsno (did you mean --json?)"),
        (["top", "--intervl", "2"], "--intervl (did you mean --interval?) 2"),
        (["select", "--max-utl", "5"], "--max-utl (did you mean --max-util?) 5"),
        (["launch", "--nporcs", "2", "x.py"], "--nporcs (did you mean --nprocs?)"),
        (["launch", "--gpus", "2", "x.py"], "--gpus (did you mean --nprocs?)"),
    ],
)
def test_an_unknown_flag_gets_the_nearest_one_of_its_command(argv, meant, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"anydevice {argv[0]}: error: unrecognized arguments: {meant}" in err, err
    assert err.startswith(f"usage: anydevice {argv[0]}")  # the command's usage, not the top's


def test_a_flag_like_nothing_we_have_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        cli.main(["doctor", "--banana"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --banana")


def test_a_notebook_cell_ending_in_main_shows_no_stray_exit_code(capsys):
    """A real IPython shell runs the cell as a notebook does; its display formatter is what
    a notebook shows of the cell's value: nothing for 0 (it showed ``0`` under the report),
    one line for a failure. The value is still the int that ``sys.exit`` takes."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        ok = shell.run_cell("from anydevice.cli import main\nmain(['info', '--json'])")
        assert ok.success and ok.result == 0 and isinstance(ok.result, int)
        assert shell.display_formatter.format(ok.result)[0] == {}  # nothing to show
        capsys.readouterr()
        bad = shell.run_cell("main(['doctor', '--no-measure', '--device', 'cuda:7'])")
        assert bad.result == 2
        assert shell.display_formatter.format(bad.result)[0] == {}
        assert capsys.readouterr().out.splitlines()[-1] == "exit status 2"
    finally:
        InteractiveShell.clear_instance()


def test_unknown_command_is_an_argparse_error():
    with pytest.raises(SystemExit) as info:
        cli.main(["teleport"])
    assert info.value.code == 2


def test_version():
    out = run("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("anydevice ")


# ----------------------------------------------------------------------------- launch

ROOT = Path(__file__).resolve().parents[2]
DDP_EXAMPLE = str(ROOT / "examples" / "ddp_train.py")


def bounded(
    argv: list[str], timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``argv`` in its own session, so a timeout can stop its whole process tree."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise AssertionError(f"{proc.args} did not finish within {timeout} s") from None
    return proc.returncode, out, err


def anydevice(*args: str, timeout: float = 120, env: dict[str, str] | None = None):
    return finish(bounded([sys.executable, "-m", "anydevice", *args], env=env), timeout)


CPU = {"ANYDEVICE_DEVICE": "cpu"}  # the launch tests are about CPU worlds, on any machine


@pytest.fixture
def no_process_left_behind():
    with process_tree_guard():
        yield


def test_launch_help_names_the_torchrun_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["launch", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts", "-n"):
        assert option in text


def test_launch_takes_torchruns_spellings_and_leaves_script_arguments_alone():
    args = cli.build_parser().parse_args(
        ["launch", "--standalone", "--nproc_per_node", "2", "--max_restarts", "1",
         "--rdzv_id", "job", "train.py", "-n", "5", "--lr", "0.1"]
    )  # fmt: skip
    assert (args.nprocs, args.max_restarts, args.rdzv_id) == (2, 1, "job")
    assert (args.target, args.args) == ("train.py", ["-n", "5", "--lr", "0.1"])


def harness(*args: str, unset: tuple[str, ...] = ()) -> tuple[bool, int, str]:
    """Run the command under HARNESS: (whether torch was imported, exit code, stderr)."""
    out = subprocess.run(
        [sys.executable, "-c", HARNESS, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in unset},
    )
    lines = out.stderr.strip().splitlines()
    report = json.loads(lines[-1])
    return report["torch"], report["code"], "\n".join(lines[:-1])


def test_launch_without_a_script_says_only_script_is_required():
    torch_imported, code, err = harness("launch")
    assert (torch_imported, code) == (False, 2)
    assert err.endswith("the following arguments are required: SCRIPT")


def test_launch_help_documents_m_with_the_positional_it_changes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: anydevice launch [-n N] [options] [-m] SCRIPT [ARGS...]")
    assert "SCRIPT is a module name" in text and "TARGET" not in text


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("-n", "0"), "argument -n/--nprocs"),
        (("-n", "abc"), "argument -n/--nprocs"),
        (("--nproc-per-node", "-2"), "argument -n/--nprocs"),
        (("--timeout", "0"), "argument --timeout"),
        (("--timeout", "nan"), "argument --timeout"),
        (("--hang-after", "-5"), "argument --hang-after: '-5' is not a number of seconds"),
        (("--hang-after", "soon"), "argument --hang-after: 'soon' is not a number of seconds"),
        (("--hang-after", "inf"), "argument --hang-after"),
        (("--nnodes", "2:1"), "argument --nnodes"),
        (("--nnodes", "two"), "argument --nnodes"),
        (("--max-restarts", "-1"), "argument --max-restarts"),
        (("--node-rank", "x"), "argument --node-rank"),
        (("--rdzv-endpoint", "10.0.0.1"), "argument --rdzv-endpoint"),
        (("--timeout", "inf"), "argument --timeout"),
        (("--timeout", "-inf"), "argument --timeout"),
        (("--grace", "nan"), "argument --grace"),
        (("--grace", "-1"), "argument --grace"),
        (("--grace", "inf"), "argument --grace"),
        (("--rdzv-endpoint", "127.0.0.1:99999"), "argument --rdzv-endpoint"),
        (("--rdzv-endpoint", "a b:80"), "argument --rdzv-endpoint"),
        (("--nnodes", "2"), "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (("--nnodes", "1:3"), "--nnodes 1:3 needs --rdzv-endpoint HOST:PORT"),
    ],
)
def test_launch_refuses_bad_flags_in_the_parser_without_importing_torch(flags, named):
    not_launched = cli._LAUNCHER_VARS  # as a command typed at a shell
    torch_imported, code, err = harness("launch", *flags, "train.py", unset=not_launched)
    assert (torch_imported, code) == (False, 2), err
    assert named in err and "usage: anydevice launch" in err
    assert "='" not in err  # the flags' names, not Python keywords (nnodes='2')


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--timeout", "1e300"), "timeout=1e+300 (--timeout): give the seconds"),
        (("--grace", str(2**63)), "grace=9.223372036854776e+18 (--grace): give the seconds"),
        (("-n", "99999"), "nprocs=99999 (-n): give the processes per node"),
        (("--rdzv-id", ""), "run_id='' (--rdzv-id): give the job's name"),
        (("--rdzv-id", " job"), "run_id=' job' (--rdzv-id): give the job's name"),
        (("--local-addr", ""), "local_addr='' (--local-addr): give this node's address"),
        (
            ("--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400", "--timeout", "10"),
            "node_rank=2 (--node-rank): give this node's rank, a whole number from 0 to 1",
        ),
        (
            ("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:0", "--timeout", "10"),
            "rdzv_endpoint='127.0.0.1:0' (--rdzv-endpoint): port 0 lets the system pick one",
        ),
    ],
)
def test_launch_refuses_flags_the_parser_cannot_judge_before_any_worker_starts(
    flags, named, tmp_path, capsys
):
    """Bounds and flags that must agree: each was taken (a 1e300 s wait, an empty run id,
    node rank 2 of 2 nodes) and the launch started."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker started')\n")
    with pytest.raises(SystemExit) as info:
        cli.main(["launch", *flags, str(script)])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert named in err and "usage: anydevice launch" in err, err


def test_a_log_dir_that_is_a_file_is_refused(tmp_path, capsys):
    script, taken = tmp_path / "train.py", tmp_path / "taken"
    script.write_text("raise SystemExit('a worker started')\n")
    taken.write_text("")
    with pytest.raises(SystemExit) as info:
        cli.main(["launch", "--log-dir", str(taken), str(script)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "it is a file, not a folder" in err, err


def test_a_launch_with_a_bad_anydevice_device_starts_no_worker(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "import anydevice as ad\nad.device()\n"
    )
    code, _, err = anydevice(
        "launch", "-n", "2", str(script), env={"ANYDEVICE_DEVICE": "bogus"}, timeout=120
    )
    assert code == 2, err
    assert "no worker was started" in err and "Unknown device 'bogus'" in err
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("no_such_module_here", "No module named 'no_such_module_here'"),
        ("json.no_such_module", "No module named 'json.no_such_module'"),
        ("json", "'json' is a package without a __main__ module"),
    ],
)
def test_launch_of_a_missing_module_says_so_before_starting_workers(module, message):
    torch_imported, code, err = harness("launch", "-n", "2", "-m", module)
    assert (torch_imported, code) == (False, 1), err
    assert err == f"anydevice launch: {message}" or err.startswith(f"anydevice launch: {message}")


def test_launch_finds_a_module_in_the_working_directory_as_the_workers_will(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('the package ran')\n")
    (tmp_path / "pkg" / "job.py").write_text("")
    assert cli._missing_module("pkg.job", [str(tmp_path), *sys.path[1:]]) is None
    assert "pkg" not in sys.modules  # found on disk, its __init__ not run
    assert "No module named 'pkg.nope'" in str(
        cli._missing_module("pkg.nope", [str(tmp_path), *sys.path[1:]])
    )


def test_launch_of_a_missing_script_says_so(capsys):
    assert cli.main(["launch", "-n", "2", "no/such/train.py"]) == 1
    assert "No script 'no/such/train.py'" in capsys.readouterr().err


@pytest.mark.long  # a whole program (make test-long)
@pytest.mark.slow
def test_ddp_example_runs_unchanged_in_one_process():
    code, out, err = finish(bounded([sys.executable, DDP_EXAMPLE, "--epochs", "1"], env=CPU))
    assert code == 0, err
    assert "1 process(es), no process group" in out
    assert float(re.search(r"test accuracy ([0-9.]+)", out).group(1)) > 0.8


@pytest.mark.long  # a whole program (make test-long)
@pytest.mark.slow
def test_launch_runs_the_ddp_example_on_two_processes(no_process_left_behind):
    code, out, err = anydevice("launch", "-n", "2", DDP_EXAMPLE, "--epochs", "1", env=CPU)
    assert code == 0, err
    assert "2 process(es), gloo, on cpu" in out
    assert out.count("test accuracy") == 1  # printed by rank 0 only
    assert float(re.search(r"test accuracy ([0-9.]+)", out).group(1)) > 0.8


@pytest.mark.slow
def test_two_nodes_on_this_machine_finish_together(no_process_left_behind):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "60"]
    procs = [
        bounded([sys.executable, "-m", "anydevice", "launch", "-n", "1", *common,
                 "--node-rank", str(node), DDP_EXAMPLE, "--epochs", "1"], env=CPU)
        for node in (0, 1)
    ]  # fmt: skip
    results = [finish(p, timeout=120) for p in procs]  # each bounded, and killed past it
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    outputs = "".join(out for _, out, _ in results)
    assert "2 process(es), gloo, on cpu" in outputs  # one world of two, across the nodes
    assert outputs.count("test accuracy") == 1


@pytest.mark.slow
def test_a_failing_script_names_the_rank_with_its_traceback_and_exit_code(
    tmp_path, no_process_left_behind
):
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "import anydevice as ad\n"
        "with ad.distributed(timeout=60) as d:\n"
        "    if d.rank == 1:\n"
        "        raise ZeroDivisionError('rank one divides by zero')\n"
        "    d.barrier()\n"
    )
    code, _, err = anydevice("launch", "-n", "2", str(script), env=CPU)
    assert code == 1
    summary = err[err.index("anydevice launch: Rank 1") :]
    assert "ZeroDivisionError: rank one divides by zero" in summary
    assert f'File "{script}", line 5' in summary  # the script's own line


def test_launch_inside_a_launched_world_runs_the_script_in_place(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import os, sys\nprint('ran', os.getpid(), sys.argv[1:])\n")
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = bounded(
        [sys.executable, "-m", "anydevice", "launch", "-n", "4", str(script), "x"], env=env
    )
    code, out, err = finish(proc, timeout=60)
    assert code == 0, err
    assert out.split() == ["ran", str(proc.pid), "['x']"]  # the launcher's own process


@pytest.mark.slow
def test_srun_one_task_per_node_launches_each_nodes_workers(tmp_path, no_process_left_behind):
    script = tmp_path / "world.py"
    script.write_text(
        "import anydevice as ad\n"
        "with ad.distributed(timeout=60) as d:\n"
        "    ranks = ad.all_gather((d.rank, d.node_rank, d.local_rank))\n"
        "    if d.is_main:\n"
        "        print('world', d.world_size, sorted(ranks))\n"
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slurm = {  # what srun --nodes 2 --ntasks-per-node 1 gives each task
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "127.0.0.1",
        "MASTER_PORT": str(port),
    }  # fmt: skip
    procs = [
        bounded(
            [
                sys.executable,
                "-m",
                "anydevice",
                "launch",
                "-n",
                "2",
                "--timeout",
                "60",
                str(script),
            ],
            env={**slurm, **CPU, "SLURM_PROCID": str(node), "SLURM_NODEID": str(node)},
        )
        for node in (0, 1)
    ]
    results = [finish(p, timeout=120) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    out = "".join(o for _, o, _ in results)
    assert "world 4 [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]" in out
