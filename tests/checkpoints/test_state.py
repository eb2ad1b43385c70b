"""``ad.save_state`` / ``ad.load_state``: one file in a world of one, DCP folders on real gloo
ranks, resumed on other world sizes and across DDP and FSDP."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import anydevice as ad
from ranks import process_tree_guard, run_ranks
from workers import batches, model


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


def test_the_state_module_imports_by_its_dotted_name_and_ad_distributed_stays_the_function():
    # ``ad.distributed`` (the function) once shared its name with this module's package.
    code = (
        "import anydevice.checkpoints.state as st\n"
        "import anydevice.launching.agent as ag\n"  # a submodule loaded after the package
        "import anydevice as ad, types\n"
        "assert st.save_state is ad.save_state and st.__name__ == 'anydevice.checkpoints.state'\n"
        "assert ag.__name__ == 'anydevice.launching.agent'\n"
        "assert not isinstance(ad.distributed, types.ModuleType)\n"
        "with ad.distributed() as d:\n"
        "    print(d.world_size)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


STEPS = 4  # saved after 2, resumed for 2 more
#: FSDP in fp32, as the references train ("auto" is bf16 on a CPU with native bf16).
FSDP_FP32 = {"strategy": "fsdp", "precision": "fp32"}
GLOBAL = 16  # samples per step


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.02, weight_decay=0.01)


def train(net, opt, steps: range, rank: int = 0, world: int = 1) -> list[float]:
    """Steps of the same global batches on any world size: each rank takes its share of the
    16 samples and its loss is scaled so that the ranks' averaged gradient is the gradient
    of the global mean."""
    x, y = batches(STEPS, 1, seed=7)  # (STEPS, 8, 6): pad to 16 samples
    x, y = torch.cat([x, x.flip(1)], 1), torch.cat([y, y.flip(1)], 1)
    share = torch.arange(GLOBAL).tensor_split(world)[rank]
    losses = []
    for s in steps:
        opt.zero_grad()
        err = (net(x[s, share]) - y[s, share]).pow(2).sum()
        (err * world / GLOBAL).backward()
        opt.step()
        losses.append(float(ad.all_reduce(err.detach(), op="sum")) / GLOBAL)
    return losses


def full(net: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in ad.unwrap(net).state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = v.detach().clone()
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    """The run that is never interrupted, in one process: losses and parameters."""
    net = model(seed=0)
    opt = optimizer(net.parameters())
    first = train(net, opt, range(2))
    at_two = full(net)
    rest = train(net, opt, range(2, STEPS))
    return {"losses": first + rest, "at_two": at_two, "final": full(net)}


def assert_params(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- world of one


def test_world_of_one_round_trip_is_one_checked_file(tmp_path, reference):
    net = model(seed=0)
    opt = optimizer(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(net, opt, range(2))
    sched.step()
    rng = torch.get_rng_state()
    path = ad.save_state(tmp_path / "one.pt", model=net, optimizer=opt, step=2,
                         sched=sched.state_dict(), rng=rng)  # fmt: skip
    assert path.is_file() and [p.name for p in tmp_path.iterdir()] == ["one.pt"]
    fresh = model(seed=5)
    fresh_opt = optimizer(fresh.parameters())
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    extra = ad.load_state(path, model=fresh, optimizer=fresh_opt)
    fresh_sched.load_state_dict(extra["sched"])
    assert extra["step"] == 2 and torch.equal(extra["rng"], rng)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.01
    assert_params(full(fresh), reference["at_two"])
    for g in (opt, fresh_opt):
        g.param_groups[0]["lr"] = 0.02  # the reference ran without the scheduler
    assert train(fresh, fresh_opt, range(2, STEPS)) == train(net, opt, range(2, STEPS))


def test_missing_or_mismatched_checkpoints_name_what_is_missing(tmp_path):
    net = model(seed=0)
    with pytest.raises(ad.CheckpointError, match=r"no checkpoint there \(missing: nope in"):
        ad.load_state(tmp_path / "nope", model=net)
    (tmp_path / ".nope.1234abcd.tmp").mkdir()
    with pytest.raises(ad.CheckpointError, match=r"unfinished save is there \(.nope.1234abcd.tmp"):
        ad.load_state(tmp_path / "nope", model=net)
    path = ad.save_state(tmp_path / "m.pt", model=net)
    with pytest.raises(ad.CheckpointError, match="holds no optimizer state"):
        ad.load_state(path, model=net, optimizer=optimizer(net.parameters()))
    with pytest.raises(ad.CheckpointError, match="does not fit this model"):
        ad.load_state(path, model=nn.Linear(6, 1))
    ad.save({"w": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(ad.CheckpointError, match="not written by ad.save_state"):
        ad.load_state(tmp_path / "plain.pt", model=net)


def _backed_off(p: ad.Precision) -> float:
    """Drive the fp16 scaler through two overflowing steps (a real inf gradient): its scale
    backs off from 65536 to 16384, a state a fresh scaler does not have."""
    net = nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        with p.autocast():
            loss = net(torch.full((2, 3), float("inf"))).float().sum()
        p.backward(loss)
        assert not p.step(opt)  # skipped: the gradient is not finite
        opt.zero_grad()
    scale = p.state_dict()["scaler"]["scale"]
    assert scale == 16384.0
    return scale


def test_save_state_carries_the_precision_policys_scaler(tmp_path, caplog):
    p = ad.precision("cpu", "fp16")
    scale = _backed_off(p)
    net = model(seed=0)
    path = ad.save_state(tmp_path / "amp.pt", model=net, precision=p, step=3)
    fresh = ad.precision("cpu", "fp16")
    assert fresh.state_dict()["scaler"]["scale"] == 65536.0
    assert ad.load_state(path, model=model(seed=1), precision=fresh) == {"step": 3}
    assert fresh.state_dict() == p.state_dict() and fresh.state_dict()["scaler"]["scale"] == scale
    # resumed in another mode: the scaler state is dropped, as Precision.load_state_dict does
    assert ad.load_state(path, model=net, precision=ad.precision("cpu", "fp32")) == {"step": 3}
    # saved without one: the policy keeps its state, and the log says so
    bare = ad.save_state(tmp_path / "bare.pt", model=net)
    with caplog.at_level("WARNING", logger="anydevice"):
        ad.load_state(bare, model=net, precision=fresh)
    assert "holds no precision state" in caplog.text
    assert fresh.state_dict()["scaler"]["scale"] == scale
    with pytest.raises(TypeError, match=r"precision=p"):
        ad.load_state(path, model=net, precision=p.state_dict())  # type: ignore[arg-type]
    # the old way, a state dict passed by hand, is still an extra
    old = ad.save_state(tmp_path / "old.pt", model=net, precision=p.state_dict())
    assert ad.load_state(old, model=net)["precision"] == p.state_dict()


def _save_precision_on_two(folder):
    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=30) as d:
            p = ad.precision("cpu", "fp16")
            # a rank forked from pytest avoids fp16 autocast (its oneDNN state is the
            # parent's): the scaler is set where an overflow would have left it
            assert p.scaler is not None
            p.scaler.scale(torch.ones(()))  # creates the scale tensor
            p.scaler.update(16384.0)
            scale = p.state_dict()["scaler"]["scale"]
            net, opt = ad.prepare(model(seed=0), optimizer=optimizer, strategy="ddp")
            ad.save_state(folder / "amp", model=net, optimizer=opt, precision=p, rank=d.rank)
            fresh = ad.precision("cpu", "fp16")
            ad.load_state(folder / "amp", model=net, optimizer=opt, precision=fresh)
            return {"scale": scale, "resumed": fresh.state_dict()["scaler"]["scale"]}

    return rank


def test_sharded_save_state_carries_the_precision_policys_scaler(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (tmp_path / "two").mkdir()
    two = run_ranks(_save_precision_on_two(folder), 2, tmp_path / "two", timeout=90)
    assert [out["resumed"] for out in two] == [out["scale"] for out in two] == [16384.0] * 2
    assert {"precision.rank0.pt", "precision.rank1.pt"} <= {
        p.name for p in (folder / "amp").iterdir()
    }
    fresh = ad.precision("cpu", "fp16")
    assert ad.load_state(folder / "amp", model=model(seed=2), precision=fresh) == {"rank": 0}
    assert fresh.state_dict()["scaler"]["scale"] == 16384.0


# ----------------------------------------------------------------------------- several ranks


def _save_on_two(folder):
    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=30) as d:
            out: dict = {}
            fsdp, fsdp_opt = ad.prepare(model(seed=0), optimizer=optimizer, **FSDP_FP32)
            ddp, ddp_opt = ad.prepare(model(seed=0), optimizer=optimizer, strategy="ddp")
            train(fsdp, fsdp_opt, range(2), d.rank, 2)
            train(ddp, ddp_opt, range(2), d.rank, 2)
            ad.save_state(folder / "fsdp", model=fsdp, optimizer=fsdp_opt, step=2, rank=d.rank)
            ad.save_state(folder / "fsdp", model=fsdp, optimizer=fsdp_opt, step=2, rank=d.rank)
            ad.save_state(folder / "ddp", model=ddp, optimizer=ddp_opt, step=2, rank=d.rank)
            ad.save_state(folder / "model-only", model=fsdp)
            # a rank that cannot write its part (a real EFBIG: rank 1's 8 MB extra over a
            # 4 MB file-size limit) fails the save on every rank; the previous checkpoint
            # stays whole and no temporary folder is left
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            big = torch.zeros(2_000_000 if d.rank == 1 else 1)
            if d.rank == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, limit[1]))
            try:
                ad.save_state(folder / "fsdp", model=fsdp, optimizer=fsdp_opt, step=99, big=big)
            except ad.CheckpointError as e:
                out["failed_save"] = str(e)
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            # an extra that load_state could not read back is refused on every rank, at
            # the call, naming the rank, the key and the type
            bad = {"hook": (lambda: None) if d.rank == 1 else None}
            try:
                ad.save_state(folder / "fsdp", model=fsdp, optimizer=fsdp_opt, step=98, **bad)
            except ad.CheckpointError as e:
                out["refused_save"] = str(e)
            out["losses"] = train(fsdp, fsdp_opt, range(2, STEPS), d.rank, 2)
            out["final"] = full(fsdp)
            return out

    return rank


def _resume_on_three(folder):
    def rank(init_method: str) -> dict:
        with ad.distributed(init_method=init_method, timeout=30) as d:
            out: dict = {}
            runs = [("fsdp", "fsdp"), ("ddp", "fsdp"), ("fsdp", "ddp"), ("one.pt", "fsdp")]
            for saved, strategy in runs:
                how = FSDP_FP32 if strategy == "fsdp" else {"strategy": strategy}
                net, opt = ad.prepare(model(seed=9), optimizer=optimizer, **how)
                extra = ad.load_state(folder / saved, model=net, optimizer=opt)
                losses = train(net, opt, range(2, STEPS), d.rank, 3)
                out[saved, strategy] = (extra, losses, full(net))
            return out

    return rank


def test_sharded_checkpoints_resume_on_one_and_three_ranks_and_across_ddp_and_fsdp(
    tmp_path, reference
):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (tmp_path / "two").mkdir()
    two = run_ranks(_save_on_two(folder), 2, tmp_path / "two", timeout=90)
    for out in two:
        assert out["losses"] == pytest.approx(reference["losses"][2:], rel=1e-5)
        assert_params(out["final"], reference["final"])
        assert "rank(s) [1] could not write their part" in out["failed_save"]
        assert "a file-size limit (ulimit -f) stopped the write" in out["failed_save"]
        assert "extra 'hook' is a function" in out["refused_save"]
        assert "(on rank(s) [1])" in out["refused_save"]
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["ddp", "fsdp", "model-only"]  # nothing temporary left over
    shards = sorted(p.name for p in (folder / "fsdp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "anydevice.json",
                      "extra.rank0.pt", "extra.rank1.pt"]  # fmt: skip

    # a world of one reads the folder without a process group
    net, opt = model(seed=3), None
    opt = optimizer(net.parameters())
    assert ad.load_state(folder / "fsdp", model=net, optimizer=opt) == {"step": 2, "rank": 0}
    assert_params(full(net), reference["at_two"])  # the failed save left step 2 whole
    assert train(net, opt, range(2, STEPS)) == pytest.approx(reference["losses"][2:], rel=1e-5)
    assert_params(full(net), reference["final"])
    ad.save_state(folder / "one.pt", model=model(seed=0), optimizer=None)  # replaced below
    net, opt = model(seed=3), None
    opt = optimizer(net.parameters())
    ad.load_state(folder / "fsdp", model=net, optimizer=opt)
    ad.save_state(folder / "one.pt", model=net, optimizer=opt, step=2, rank=0)

    (tmp_path / "three").mkdir()
    three = run_ranks(_resume_on_three(folder), 3, tmp_path / "three", timeout=90)
    for r, out in enumerate(three):
        for (saved, strategy), (extra, losses, final) in out.items():
            where = f"{saved} into {strategy} on rank {r} of 3"
            saver = 0 if saved == "one.pt" or r == 2 else r  # rank 0's where there is no other
            assert extra == {"step": 2, "rank": saver}, where
            assert losses == pytest.approx(reference["losses"][2:], rel=1e-5), where
            assert_params(final, reference["final"])

    # partial folders say what is missing
    broken = tmp_path / "broken"
    shutil.copytree(folder / "fsdp", broken)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(
        ad.CheckpointError, match=r"missing __1_0.distcp \(1 of the 5 files it was written with"
    ):
        ad.load_state(broken, model=model(0))
    (broken / ".metadata").unlink()
    with pytest.raises(ad.CheckpointError, match="partial checkpoint, missing .metadata"):
        ad.load_state(broken, model=model(0))
    with pytest.raises(ad.CheckpointError, match="holds no optimizer state"):
        ad.load_state(folder / "model-only", model=net, optimizer=opt)

    # a world of one saves its single file over a folder
    ad.save_state(folder / "ddp", model=net, step=5)
    assert (folder / "ddp").is_file() and ad.load_state(folder / "ddp", model=net) == {"step": 5}

    # a crash between the two renames: the previous checkpoint is aside, and found
    aside = folder / ".fsdp.0badc0de.old"
    (folder / "fsdp").rename(aside)
    net = model(seed=3)
    assert ad.load_state(folder / "fsdp", model=net)["step"] == 2
    assert_params(full(net), reference["at_two"])


# ----------------------------------------------------------------------------- killed savers

BLOCKED_SAVE = """
import os, sys, time
import torch, torch.distributed as dist
import anydevice as ad

class Slow:
    def __reduce__(self):  # runs while DCP writes the rank's shard into the temporary folder
        print("writing", flush=True)
        time.sleep(120)
        return (int, (0,))

dist.init_process_group("gloo", init_method=sys.argv[2], rank=int(sys.argv[3]), world_size=2)
net = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
ad.save_state(sys.argv[1], model=net, step=1)
opt.param_groups[0][f"blocker{sys.argv[3]}"] = Slow()  # DCP pickles it as it writes
ad.save_state(sys.argv[1], model=net, optimizer=opt, step=2)
"""


@pytest.fixture
def savers(tmp_path):
    """Start 2-rank save_states (real gloo) that block mid-write; kill all at the end."""
    import subprocess
    import sys

    from ranks import free_port

    procs: list[subprocess.Popen[str]] = []

    def start(path) -> list[subprocess.Popen[str]]:
        rdzv = f"tcp://127.0.0.1:{free_port()}"
        argv = [sys.executable, "-c", BLOCKED_SAVE, str(path), rdzv]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        pair = [subprocess.Popen([*argv, str(r)], **pipes) for r in range(2)]
        procs.extend(pair)
        for p in pair:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            assert line == "writing", p.stderr.read() if p.stderr else ""
        return pair

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.long  # saves killed at each phase (make test-long)
@pytest.mark.timeout(180)
def test_load_and_save_state_sweep_the_folders_of_a_killed_save(tmp_path, savers):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    pair = savers(folder / "ckpt")
    [left] = hidden(folder)
    assert left.startswith(".ckpt.") and left.endswith(".tmp") and f".{pair[0].pid}@" in left
    ad.load_state(folder / "ckpt", model=nn.Linear(2, 1))  # a live writer's: left alone
    assert hidden(folder) == [left]
    for p in pair:
        p.kill()  # SIGKILL mid-save: no handler, no cleanup
        p.wait(timeout=30)
    assert hidden(folder) == [left]  # what a killed save leaves
    assert ad.load_state(folder / "ckpt", model=nn.Linear(2, 1)) == {"step": 1}
    assert hidden(folder) == []  # swept by the load
    # a set-aside previous checkpoint of a dead writer is swept by the next save
    import subprocess
    import sys

    from anydevice.placement.checkpoint import _host

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    aside = folder / f".ckpt.{int(dead.stdout)}@{_host()}.0123abcd.old"
    shutil.copytree(folder / "ckpt", aside)
    ad.save_state(folder / "ckpt", model=nn.Linear(2, 1), step=3)
    assert hidden(folder) == []
    assert ad.load_state(folder / "ckpt", model=nn.Linear(2, 1)) == {"step": 3}
