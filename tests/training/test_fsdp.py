"""``ad.prepare(..., strategy="fsdp")``: torch's FSDP2 on real gloo ranks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import anydevice as ad
from anydevice.training.sharding import blocks, mixed_precision
from ranks import process_tree_guard, run_ranks
from workers import BATCH, batches, model


@pytest.fixture(autouse=True)
def no_process_left_behind():
    with process_tree_guard():
        yield


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    """A stem, a stack of blocks (the largest ModuleList) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.layers = nn.ModuleList(Block(8) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ----------------------------------------------------------------------------- in process


def test_blocks_are_the_largest_stacks_children_or_what_shard_names():
    net = Net()
    assert blocks(net) == list(net.layers)
    assert blocks(net, shard=nn.Linear)[-1] is net.stem  # innermost first, root excluded
    assert set(blocks(net, shard=nn.Linear)) == {m for m in net.modules() if type(m) is nn.Linear}
    assert blocks(net, shard=lambda m: m is net.head) == [net.head]
    assert blocks(nn.Linear(2, 2)) == []  # no stack: only the root is sharded
    with pytest.raises(TypeError, match="module class"):
        blocks(net, shard="layers")  # type: ignore[arg-type]


def test_mixed_precision_gathers_in_the_mode_and_reduces_in_fp32():
    cpu = torch.device("cpu")
    bf16 = mixed_precision("bf16", cpu)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision(ad.precision(cpu, "fp16"), cpu).param_dtype == torch.float16
    assert mixed_precision("fp32", cpu).param_dtype is None
    auto = ad.precision(cpu, "auto")  # the hardware decides (fp32 where bf16 is emulated)
    expected = None if auto.mode == "fp32" else auto.dtype
    assert mixed_precision("auto", cpu).param_dtype == expected


def test_world_of_one_runs_unchanged_and_a_factory_builds_the_optimizer():
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(torch.randn(4, 6), batch_size=2)
    same, dl, same_opt = ad.prepare(net, loader, opt, strategy="fsdp", device="cpu")
    assert same is net and same_opt is opt and dl.loader is loader
    _, built = ad.prepare(net, optimizer=functools.partial(torch.optim.AdamW, lr=0.01))
    assert isinstance(built, torch.optim.AdamW) and built.param_groups[0]["lr"] == 0.01
    assert built.param_groups[0]["params"] == list(net.parameters())
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        ad.prepare(net, optimizer=lambda params: list(params))  # type: ignore[arg-type,return-value]


# ----------------------------------------------------------------------------- two ranks

STEPS, LR = 4, 0.05


def _fsdp_rank(init_method: str) -> dict:
    with ad.distributed(init_method=init_method, timeout=30) as d:
        facts: dict = {}
        # 1. the workers' model, trained on this rank's slice of each global batch, with
        # an optimizer made before prepare and two param groups
        net = model(seed=0)
        opt = torch.optim.SGD(
            [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": LR / 2}],
            lr=LR,
            momentum=0.9,
        )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
        # fp32, as the one-process reference trains ("auto" is bf16 on a CPU with native bf16)
        wrapped, same_opt = ad.prepare(net, optimizer=opt, strategy="fsdp", precision="fp32")
        facts["same_objects"] = (wrapped is net, same_opt is opt, ad.unwrap(wrapped) is net)
        facts["class"] = type(wrapped).__name__
        facts["group_lrs"] = [g["lr"] for g in opt.param_groups]
        weight = net[0].weight
        facts["param_type"] = type(weight).__name__
        facts["local_rows"] = weight.to_local().shape[0]
        facts["full_rows"] = weight.shape[0]
        facts["opt_holds_sharded"] = all(
            type(p).__name__ == "DTensor" for g in opt.param_groups for p in g["params"]
        )
        x, y = batches(STEPS, d.world_size)
        mine = slice(d.rank * BATCH, (d.rank + 1) * BATCH)
        for s in range(STEPS):
            opt.zero_grad()
            nn.functional.mse_loss(wrapped(x[s, mine]), y[s, mine]).backward()
            opt.step()
            sched.step()
        facts["params"] = {k: v.full_tensor().detach().clone() for k, v in net.state_dict().items()}
        # 2. gather_for_metrics sees plain outputs
        out = wrapped(x[0, mine]).detach()
        facts["gathered"] = ad.gather_for_metrics(out, d.world_size * BATCH).shape[0]
        # 3. an optimizer that already stepped cannot follow the parameters
        other = model(seed=1)
        stepped = torch.optim.Adam(other.parameters())
        other(x[0]).sum().backward()
        stepped.step()
        try:
            ad.prepare(other, optimizer=stepped, strategy="fsdp")
        except ad.DistributedError as e:
            facts["stepped"] = str(e)
        # 4. shard= classes, a bf16 policy, cpu offload, and a factory
        net2 = Net()
        sharded, built = ad.prepare(
            net2,
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
            strategy="fsdp",
            shard=Block,
            precision="bf16",
            cpu_offload=True,
        )
        facts["fsdp_modules"] = sorted(
            n for n, m in net2.named_modules() if type(m).__name__.startswith("FSDP")
        )
        loss = sharded(torch.randn(4, 6)).float().pow(2).mean()
        facts["bf16_output"] = str(sharded(torch.randn(2, 6)).dtype)
        loss.backward()
        built.step()
        facts["factory_params_sharded"] = all(
            type(p).__name__ == "DTensor" for p in built.param_groups[0]["params"]
        )
        facts["grad_dtype"] = str(net2.stem.weight.grad.dtype)
        return facts


def test_fsdp_on_two_ranks_shards_trains_like_one_process_and_keeps_the_objects(tmp_path):
    results = run_ranks(_fsdp_rank, 2, tmp_path)
    # the same model trained in one process on the whole batch
    net = model(seed=0)
    opt = torch.optim.SGD(
        [{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": LR / 2}],
        lr=LR,
        momentum=0.9,
    )
    x, y = batches(STEPS, 2)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(net(x[s]), y[s]).backward()
        opt.step()
    for facts in results:
        assert facts["same_objects"] == (True, True, True)
        assert facts["class"] == "FSDPSequential"
        assert facts["group_lrs"] == [LR, LR / 2]  # groups and hyper-parameters kept
        assert facts["param_type"] == "DTensor" and facts["opt_holds_sharded"]
        assert (facts["local_rows"], facts["full_rows"]) == (8, 16)  # half on each rank
        for k, v in net.state_dict().items():
            torch.testing.assert_close(facts["params"][k], v, rtol=1e-5, atol=1e-6)
        assert facts["gathered"] == 2 * BATCH
        assert "already has state" in facts["stepped"]
        assert facts["fsdp_modules"] == ["", "layers.0", "layers.1", "layers.2"]
        assert facts["bf16_output"] == "torch.bfloat16"  # parameters gathered in bf16
        assert facts["grad_dtype"] == "torch.float32"  # reduced into fp32 shards
        assert facts["factory_params_sharded"]


# ----------------------------------------------------------------------------- a GPU


@pytest.mark.cuda
@pytest.mark.real_gpu("an NCCL process group: collectives on the simulated GPUs are refused")
def test_fully_shard_on_a_gpu_gathers_in_bf16_and_offloads_to_the_host(monkeypatch):
    from anydevice.training import sharding
    from ranks import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for k, v in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    with ad.distributed(timeout=60) as d:
        assert d.device.type == "cuda"
        p = ad.precision(d.device)
        expected = None if p.mode == "fp32" else p.dtype
        assert mixed_precision("auto", d.device).param_dtype == expected  # by hardware
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        names = sharding.parameter_names(net)
        sharding.fully_shard_model(net, d.device, 1, mode="bf16", cpu_offload=True)
        sharding.swap_parameters(opt, names, net)
        assert net.stem.weight.to_local().device.type == "cpu"  # offloaded shard
        assert net.stem.weight.to_local().is_pinned()
        out = net(torch.randn(4, 6, device=d.device))
        assert out.device.type == "cuda" and out.dtype == torch.bfloat16
        out.float().pow(2).mean().backward()
        assert net.stem.weight.grad.to_local().dtype == torch.float32
        before = net.stem.weight.to_local().clone()  # a world of one: the whole tensor
        opt.step()
        assert not torch.equal(before, net.stem.weight.to_local())
        del net, opt, out
