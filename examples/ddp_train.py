"""Data-parallel training that runs unchanged in one process or many.

    python examples/ddp_train.py                          # one process, the best device
    anydevice launch -n 2 examples/ddp_train.py           # two processes: DDP (gloo on CPU)
    torchrun --nproc-per-node 2 examples/ddp_train.py     # the same through torchrun
    python examples/ddp_train.py --spawn 2                # launched from Python: ad.launch
    python examples/ddp_train.py --checkpoints ckpts      # save as it goes; run again: resume

The tutorial version of this script reads LOCAL_RANK, picks the backend, sets the CUDA
device, calls init_process_group, builds a DistributedSampler, remembers set_epoch, passes
device_ids to DDP (but not on the CPU, where torch refuses them), averages the loss by
hand, evaluates on a padded sampler that counts some samples twice, and forgets to tear
down. Here that is ``ad.distributed()``, ``ad.prepare()``, ``ad.all_reduce()`` and
``ad.gather_for_metrics()``.

The loop is the whole modern step: mixed precision by hardware (``ad.precision``: bf16,
or fp16 with loss scaling), gradient accumulation to a fixed global batch whatever the
number of processes (``d.accumulate``: one gradient all-reduce per optimizer step, not one
per micro-batch), and gradient clipping after the loss scale is taken back out.
``--batch-size auto`` finds the largest micro-batch that fits (``ad.fit_batch_size``).

With ``--checkpoints DIR`` it saves every ``--save-every`` steps without stalling the step
(``ad.save_state(..., background=True, keep=2)``: copied to host memory, written while the
next steps run, the newest two kept in ``DIR/step-N``), and a run started again resumes
from the newest complete one (``ad.load_state(latest_in=DIR)``): model, optimizer, the
precision policy's loss scale, and the loader's place in its epoch, so a job stopped
mid-epoch goes on at the next batch in the same order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import anydevice as ad


def dataset(n: int, seed: int) -> TensorDataset:
    """Two classes split by a fixed random hyperplane in 16 dimensions."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x @ w > 0).long())


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))


def largest_micro_batch(d: ad.Distributed, global_batch: int) -> int:
    """The largest micro-batch that fits on this device and divides the global batch."""
    model = make_model().to(d.device)  # searched outside DDP: no collectives per try
    data = dataset(global_batch, seed=3)

    def step(size: int) -> None:
        x, y = (t[:size].to(d.device) for t in data.tensors)
        nn.functional.cross_entropy(model(x), y).backward()

    fits = ad.fit_batch_size(step, high=global_batch // d.world_size)
    return d.micro_batch_size(global_batch, fits)


def fit(
    d: ad.Distributed,
    epochs: int,
    batch_size: int,
    global_batch: int,
    lr: float,
    checkpoints: str | None = None,
    save_every: int = 10,
) -> float:
    """Train, evaluate, and return the test accuracy (the same on every rank).

    The DDP model lives in this function, so it is freed before ``ad.distributed`` tears
    the process group down.
    """
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    train = DataLoader(dataset(2000, seed=1), batch_size=batch_size, shuffle=True)
    test = DataLoader(dataset(999, seed=2), batch_size=256)  # 999: uneven on purpose
    model, train, optimizer = ad.prepare(model, train, optimizer)
    model, test = ad.prepare(model, test)  # an already wrapped model is left as it is
    p = ad.precision(d.device)  # bf16, fp16 (with loss scaling) or fp32, by hardware
    loss_fn = nn.CrossEntropyLoss()
    start, step_count = 0, 0
    state = {"model": model, "optimizer": optimizer, "precision": p, "loader": train}
    if checkpoints and any(Path(checkpoints).glob("step-*")):  # the newest complete one
        extra = ad.load_state(latest_in=checkpoints, **state)
        start, step_count = extra["epoch"], extra["step"]
        if d.is_main:
            print(f"resumed at step {step_count}, epoch {start} ({len(train)} batches left)")
    for epoch in range(start, epochs):
        model.train()
        total = torch.zeros((), device=d.device)
        steps = d.accumulate(model, train, global_batch=global_batch)  # same on any world
        batches, n_steps = len(train), len(steps)  # fewer in a pass resumed mid-epoch
        for step in steps:  # one optimizer step: micro-batches of batch_size on each rank
            for x, y in step:  # on d.device already; a new shuffle every epoch, unasked
                with p.autocast():
                    loss = loss_fn(model(x), y)
                p.backward(step.scale(loss))  # loss / micro-batches; one all-reduce, at the end
                total += loss.detach() / batches
            p.unscale_(optimizer)  # once per step, before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            p.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            step_count += 1
            if checkpoints and step_count % save_every == 0:  # returns once copied to host
                ad.save_state(checkpoints, **state, background=True, keep=2,
                              epoch=epoch, step=step_count)  # fmt: skip
        mean_loss = ad.all_reduce(total)  # averaged over ranks
        if d.is_main:
            print(
                f"epoch {epoch}: loss {mean_loss.item():.4f} ({n_steps} steps of "
                f"{steps.micro_batches} x {batch_size} x {d.world_size} = {global_batch}, {p.mode})"
            )
    model.eval()
    with torch.no_grad():
        outputs = [(model(x).argmax(1), y) for x, y in test]  # one pass, both on d.device
    preds = torch.cat([pred for pred, _ in outputs])
    labels = torch.cat([y for _, y in outputs])
    preds, labels = ad.gather_for_metrics((preds, labels), test)  # each sample once
    assert len(preds) == len(test.dataset)  # type: ignore[arg-type]
    return (preds == labels).float().mean().item()


def main(
    epochs: int = 3,
    batch_size: int | str = 16,
    global_batch: int = 64,
    lr: float = 0.05,
    checkpoints: str | None = None,
    save_every: int = 10,
) -> float:
    with ad.distributed() as d:
        if d.is_main:
            print(f"{d.world_size} process(es), {d.backend or 'no process group'}, on {d.device}")
        if batch_size == "auto":
            batch_size = largest_micro_batch(d, global_batch)
        accuracy = fit(d, epochs, int(batch_size), global_batch, lr, checkpoints, save_every)
        # (the last background save is waited for as ad.distributed ends)
        if d.is_main:
            print(f"test accuracy {accuracy:.3f}")
        return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", default="16", help="micro-batch per process, or auto")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--spawn", type=int, default=0, metavar="N", help="ad.launch N procs")
    parser.add_argument("--checkpoints", metavar="DIR", help="save there; resume from there")
    parser.add_argument("--save-every", type=int, default=10, help="steps between saves")
    args = parser.parse_args()
    size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    run = (args.epochs, size, args.global_batch, args.lr, args.checkpoints, args.save_every)
    if args.spawn:
        results = ad.launch(main, *run, nprocs=args.spawn)
        print(f"accuracy by rank: {results}")
    else:
        main(*run)
