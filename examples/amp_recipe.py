"""PyTorch's "Automatic Mixed Precision" recipe, with anydevice.

Before (the recipe, CUDA only)::

    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        loss = loss_fn(net(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.1)
    scaler.step(opt)
    scaler.update()

with fp16 hard-coded (wrong on an H100, which wants bf16 and no scaler) and a CPU branch to
write by hand. After: the same loop on any device, with the mode chosen by the hardware and
the reason printed; ``ad.save_state`` checkpoints the precision policy with the model and
optimizer, and resuming works on other hardware too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import anydevice as ad


def make_model(width: int, layers: int) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, width))


def main() -> None:
    dev = ad.device()
    torch.manual_seed(0)
    net = make_model(width=256, layers=3).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    data = [torch.randn(64, 256, device=dev) for _ in range(8)]
    targets = [x.roll(1, dims=1) for x in data]  # something learnable

    p = ad.precision(dev)
    print(p)
    for epoch in range(5):
        skipped = 0
        for x, y in zip(data, targets, strict=True):
            with p.autocast():
                loss = loss_fn(net(x), y)
            p.backward(loss)
            p.unscale_(opt)  # the gradients are true ones from here: clip them
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.1)
            skipped += not p.step(opt)  # fp16 skips steps with inf/NaN gradients
            opt.zero_grad(set_to_none=True)
        print(f"epoch {epoch}: loss {loss.item():.4f}, skipped steps {skipped}")

    # One call saves the model, the optimizer and the precision policy's state (in fp16 the
    # loss scaler's scale: a resumed run does not start again at 65536 and skip steps).
    with tempfile.TemporaryDirectory() as tmp:
        path = ad.save_state(
            Path(tmp) / "checkpoint", model=net, optimizer=opt, precision=p, epoch=5
        )
        net2 = make_model(width=256, layers=3).to(dev)
        opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-3)
        p2 = ad.precision(dev)
        extra = ad.load_state(path, model=net2, optimizer=opt2, precision=p2)
        same = p2.state_dict() == p.state_dict()
        print(f"resumed at epoch {extra['epoch']}; the checkpoint was trained in "
              f"{p.state_dict()['mode']}; precision state restored: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
