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
the reason printed; resuming from the checkpoint works on other hardware too.
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

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "checkpoint.pt"
        torch.save(
            {"model": net.state_dict(), "optimizer": opt.state_dict(), "precision": p.state_dict()},
            path,
        )
        checkpoint = torch.load(path, map_location=dev)
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        p.load_state_dict(checkpoint["precision"])
        print(f"resumed; the checkpoint was trained in {checkpoint['precision']['mode']}")


if __name__ == "__main__":
    main()
