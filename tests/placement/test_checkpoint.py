"""ad.save / ad.load with real files: atomic writes, real write failures, damaged files."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import anydevice as ad
from anydevice.hardware.backends.cuda import cuda_built

META = torch.device("meta")


def state() -> dict[str, object]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}, "step": 7, "name": "run"}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# ----------------------------------------------------------------------------- round trips


def test_save_then_load_round_trips(tmp_path):
    saved = state()
    path = ad.save(saved, tmp_path / "ckpt.pt")
    assert path == tmp_path / "ckpt.pt"
    loaded = ad.load(path, "cpu")
    assert loaded["step"] == 7 and loaded["name"] == "run"
    assert torch.equal(loaded["model"]["w"], saved["model"]["w"])  # type: ignore[index]
    assert leftovers(tmp_path) == []


def test_load_puts_every_tensor_on_the_target_device(tmp_path):
    path = ad.save(state(), str(tmp_path / "ckpt.pt"))
    loaded = ad.load(path, META)
    assert {t.device for t in loaded["model"].values()} == {META}
    assert ad.load(path, None)["model"]["w"].device == torch.device("cpu")
    assert ad.load(path)["model"]["w"].device == ad.device()  # "auto"


def test_load_with_mmap(tmp_path):
    path = ad.save(state(), tmp_path / "ckpt.pt")
    loaded = ad.load(path, "cpu", mmap=True, verify=False)
    assert torch.equal(loaded["model"]["b"], state()["model"]["b"])  # type: ignore[index]


def test_weights_only_refusal_passes_through_as_torch_raises_it(tmp_path):
    path = ad.save({"when": __import__("datetime").date(2024, 1, 1)}, tmp_path / "ckpt.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ad.load(path, "cpu")
    assert ad.load(path, "cpu", weights_only=False)["when"].year == 2024


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        ad.load(tmp_path / "nope.pt", "cpu")


def relocate_to_cuda(src: Path, dst: Path) -> None:
    """Rewrite a CPU checkpoint as if saved on cuda:0 (its storages say 'cuda:0')."""
    reader = torch._C.PyTorchFileReader(str(src))
    writer = torch._C.PyTorchFileWriter(str(dst))
    for name in reader.get_all_records():
        record = bytes(reader.get_record(name))
        if name.endswith("data.pkl"):
            record = record.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
        writer.write_record(name, record, len(record))
    writer.write_end_of_file()


@pytest.mark.skipif(cuda_built(), reason="needs a torch that cannot load onto CUDA")
def test_checkpoint_saved_on_gpu_loads_on_a_cpu_machine(tmp_path):
    cpu_file, gpu_file = tmp_path / "cpu.pt", tmp_path / "gpu.pt"
    ad.save({"w": torch.arange(4.0)}, cpu_file)
    relocate_to_cuda(cpu_file, gpu_file)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(gpu_file, weights_only=True)  # torch alone refuses
    assert torch.equal(ad.load(gpu_file)["w"], torch.arange(4.0))  # "auto" is the CPU here
    assert torch.equal(ad.load(gpu_file, "cpu")["w"], torch.arange(4.0))
    with pytest.raises(ad.CheckpointError, match='saved on a GPU.*device="cpu"'):
        ad.load(gpu_file, None)


# ----------------------------------------------------------------------------- atomic save


def test_unpicklable_object_leaves_previous_file_intact(tmp_path):
    path = tmp_path / "ckpt.pt"
    ad.save({"good": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(ad.CheckpointError, match="cannot be saved") as info:
        ad.save({"good": torch.ones(3), "bad": lambda: 1}, path)
    assert "the previous ckpt.pt is intact" in str(info.value)
    assert info.value.__cause__ is not None
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_failed_first_save_creates_nothing(tmp_path):
    with pytest.raises(ad.CheckpointError, match="ckpt.pt was not created"):
        ad.save({"bad": lambda: 1}, tmp_path / "ckpt.pt")
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ad.CheckpointError, match="cannot create a file in") as info:
        ad.save({"x": 1}, tmp_path / "no" / "such" / "ckpt.pt")
    assert isinstance(info.value.__cause__, FileNotFoundError)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_real_write_failure_from_a_file_size_limit_keeps_previous_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    ad.save({"w": torch.ones(1000)}, path)  # ~4 KB
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, torch
        import anydevice as ad
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
        try:
            ad.save({{"w": torch.ones(1_000_000)}}, {str(path)!r})  # ~4 MB
        except ad.CheckpointError as e:
            print("CheckpointError:", e)
            print("cause:", type(e.__cause__).__name__)
            sys.exit(3)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(ad.__file__).parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "a file-size limit (ulimit -f) stopped the write" in proc.stdout
    assert "the previous ckpt.pt is intact" in proc.stdout
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []
    assert torch.equal(ad.load(path, "cpu")["w"], torch.ones(1000))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")
def test_new_file_gets_umask_permissions_and_replaced_file_keeps_its_own(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    path = ad.save({"x": 1}, tmp_path / "ckpt.pt")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o600)
    ad.save({"x": 2}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ad.load(path, "cpu") == {"x": 2}


# ----------------------------------------------------------------------------- damaged files


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return ad.save(state(), tmp_path / "ckpt.pt")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_truncated_file_is_named_and_called_truncated(good, keep):
    data = good.read_bytes()
    good.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ad.CheckpointError, match="truncated") as info:
        ad.load(good, "cpu")
    assert str(good) in str(info.value) and info.value.path == str(good)


def test_truncated_file_is_also_caught_without_verify(good):
    good.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ad.CheckpointError, match="truncated") as info:
        ad.load(good, "cpu", verify=False)
    assert info.value.__cause__ is not None  # torch's own error, kept


def test_empty_file_is_called_empty(good):
    good.write_bytes(b"")
    with pytest.raises(ad.CheckpointError, match=r"empty \(0 bytes\)"):
        ad.load(good, "cpu")


def _member_offset(path: Path, suffix: str) -> int:
    with zipfile.ZipFile(path) as archive, path.open("rb") as f:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
        f.seek(info.header_offset + 26)
        name_len, extra_len = (
            int.from_bytes(f.read(2), "little"),
            int.from_bytes(f.read(2), "little"),
        )
        return info.header_offset + 30 + name_len + extra_len


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_bit_in_tensor_data_is_caught_although_torch_loads_it(good):
    _flip(good, _member_offset(good, "data/0") + 1000)
    silently_wrong = torch.load(good, weights_only=True)  # torch checks no CRC
    assert not torch.equal(silently_wrong["model"]["w"], state()["model"]["w"])  # type: ignore[index]
    with pytest.raises(ad.CheckpointError, match=r"record '.*data/0' fails its CRC-32") as info:
        ad.load(good, "cpu")
    assert "corrupt" in str(info.value)


def test_flipped_bit_in_the_pickle_is_caught(good):
    _flip(good, _member_offset(good, "data.pkl") + 20)
    with pytest.raises(ad.CheckpointError, match=r"data\.pkl' fails its CRC-32"):
        ad.load(good, "cpu")


def test_damaged_zip_directory_is_corrupt(good):
    data = bytearray(good.read_bytes())
    entry = data.find(b"PK\x01\x02")  # the first entry of the zip's central directory
    data[entry + 2] ^= 0xFF
    good.write_bytes(bytes(data))
    with pytest.raises(ad.CheckpointError, match="corrupt"):
        ad.load(good, "cpu")


def test_file_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello, world")
    with pytest.raises(ad.CheckpointError, match="not a torch checkpoint: it starts with b'hell'"):
        ad.load(path, "cpu")


def test_legacy_format_still_loads(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(ad.load(path, "cpu")["w"], torch.ones(2))


def test_nanogpt_style_resume_round_trips_model_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "model_args": {"n_layer": 2, "bias": False},
        "iter_num": 1,
        "best_val_loss": torch.tensor(3.25),
        "config": {"dataset": "shakespeare_char", "dtype": "bfloat16"},
    }
    path = ad.save(checkpoint, tmp_path / "ckpt.pt")

    loaded = ad.load(path, "cpu")  # weights_only=True is enough for all of it
    resumed = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    resumed.load_state_dict(loaded["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    resumed_opt.load_state_dict(loaded["optimizer"])
    assert loaded["iter_num"] == 1 and float(loaded["best_val_loss"]) == 3.25
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], resumed_opt.state[b]["exp_avg"])


# ----------------------------------------------------------------------------- killed writers

BLOCKED_WRITER = """
import sys, time, anydevice as ad

class Slow:
    def __reduce__(self):  # runs while torch.save writes the temporary file
        print("writing", flush=True)
        time.sleep(120)
        return (int, (0,))

ad.save({"x": Slow()}, sys.argv[1])
"""


@pytest.fixture
def writers():
    """Start writers that block in the middle of ad.save; kill every one at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: Path) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, "-c", BLOCKED_WRITER, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "writing", p.stderr.read() if p.stderr else ""
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_temp_file_of_a_writer_killed_mid_save_is_removed_by_the_next_save(tmp_path, writers):
    path = tmp_path / "ckpt.pt"
    ad.save({"step": 1}, path)
    writer = writers(path)
    [stale] = leftovers(tmp_path)
    assert stale.startswith(".ckpt.pt.") and f".{writer.pid}@" in stale
    writer.kill()  # SIGKILL: no handler, no cleanup
    writer.wait(timeout=30)
    assert leftovers(tmp_path) == [stale]  # what a killed writer leaves
    assert ad.load(path, "cpu") == {"step": 1}  # and the checkpoint is intact
    ad.save({"step": 2}, path)
    assert leftovers(tmp_path) == []
    assert ad.load(path, "cpu") == {"step": 2}


def test_temp_file_of_a_live_writer_is_left_alone(tmp_path, writers):
    path = tmp_path / "ckpt.pt"
    writer = writers(path)
    [busy] = leftovers(tmp_path)
    ad.save({"step": 3}, path)
    assert leftovers(tmp_path) == [busy]
    assert writer.poll() is None  # still writing, undisturbed


def test_temp_files_of_other_paths_and_other_hosts_are_left_alone(tmp_path):
    from anydevice.placement.checkpoint import _host

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    pid = int(dead.stdout)
    other_host = tmp_path / f".ckpt.pt.{pid}@elsewhere-{_host()}.0123abcd.tmp"
    other_path = tmp_path / f".other.pt.{pid}@{_host()}.0123abcd.tmp"
    legacy = tmp_path / ".ckpt.pt.0123abcd.tmp"  # written before temp names carried the pid
    ours = tmp_path / f".ckpt.pt.{pid}@{_host()}.0123abcd.tmp"
    for f in (other_host, other_path, legacy, ours):
        f.write_bytes(b"partial")
    ad.save({"step": 4}, tmp_path / "ckpt.pt")
    assert not ours.exists()  # its writer has exited
    assert other_host.exists() and other_path.exists() and legacy.exists()


@pytest.mark.parametrize("name", ["c" * 252 + ".pt", "é" * 126 + ".pt"])  # 255 bytes
def test_a_name_as_long_as_the_file_system_allows_saves_as_torch_save_does(tmp_path, name):
    path = tmp_path / name
    assert len(name.encode()) == 255
    torch.save({"step": 0}, path)  # legal for torch
    path.unlink()
    ad.save({"step": 1}, path)
    ad.save({"step": 2}, path)  # and replaced
    assert ad.load(path, "cpu") == {"step": 2}
    assert leftovers(tmp_path) == []
    state = ad.save_state(tmp_path / name[:-3], model=torch.nn.Linear(2, 1), step=4)
    assert ad.load_state(state, model=torch.nn.Linear(2, 1)) == {"step": 4}


def test_temp_file_of_a_killed_writer_of_a_long_name_is_removed_by_the_next_save(tmp_path, writers):
    path = tmp_path / ("k" * 250 + ".pt")
    writer = writers(path)
    [stale] = leftovers(tmp_path)
    assert len(stale.encode()) <= 255 and f".{writer.pid}@" in stale
    writer.kill()
    writer.wait(timeout=30)
    other = tmp_path / ("k" * 249 + "j.pt")  # shares the start: its save leaves it alone
    ad.save({"step": 0}, other)
    assert leftovers(tmp_path) == [stale]
    ad.save({"step": 1}, path)
    assert leftovers(tmp_path) == []
    assert ad.load(path, "cpu") == {"step": 1}


def test_a_pid_reused_after_the_writer_died_is_told_apart_by_its_start_time(tmp_path):
    from anydevice.placement.checkpoint import _host

    old = tmp_path / f".ckpt.pt.{os.getpid()}@{_host()}.0123abcd.tmp"
    fresh = tmp_path / f".ckpt.pt.{os.getpid()}@{_host()}.4567cdef.tmp"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    long_ago = 1_000_000_000  # 2001: long before this process started
    os.utime(old, (long_ago, long_ago))
    ad.save({"step": 5}, tmp_path / "ckpt.pt")
    assert not old.exists()  # written by an earlier process that had this pid
    assert fresh.exists()  # may be a save running in another thread of this process


# ----------------------------------------------------------------------------- wrong paths


def test_save_to_a_folder_says_so_and_suggests_a_file(tmp_path):
    with pytest.raises(ad.CheckpointError, match=r"that is a folder; name a file inside it"):
        ad.save({"x": 1}, tmp_path)
    with pytest.raises(ad.CheckpointError, match=r"ends with a separator"):
        ad.save({"x": 1}, f"{tmp_path}/new-folder/")
    assert list(tmp_path.iterdir()) == []


def test_save_and_load_of_an_empty_path_say_it_is_empty():
    with pytest.raises(ad.CheckpointError, match="the path is empty"):
        ad.save({"x": 1}, "")
    with pytest.raises(ad.CheckpointError, match="the path is empty"):
        ad.load("", "cpu")


def test_load_of_a_folder_lists_the_checkpoints_in_it(tmp_path):
    ad.save({"x": 1}, tmp_path / "epoch-1.pt")
    ad.save({"x": 2}, tmp_path / "epoch-2.pt")
    with pytest.raises(ad.CheckpointError, match=r"folder, not a checkpoint.*epoch-1.pt, epoch-2"):
        ad.load(tmp_path, "cpu")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    with pytest.raises(ad.CheckpointError, match=r"DCP.*ad.load_state"):
        ad.load(dcp, "cpu")
