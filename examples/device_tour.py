"""A tour of the device facts tutorials print, from one ``ad.inventory()`` call.

Before (the tutorials, and pycuda's ``aboutCudaDevices`` class)::

    print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())
    print(torch.cuda.is_available(), torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        print(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i))
        print(torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i))
    print(next(model.parameters()).device)

Each of those ``torch.cuda`` calls initialises CUDA (and most create a context of hundreds
of MB on every GPU), ``get_device_name(i)`` numbers GPUs as CUDA does, not as nvidia-smi
does, and nothing of it works on a CPU-only machine. After: the same facts read through
NVML without a CUDA context, with both numberings, on any machine.
"""

from __future__ import annotations

import torch

import anydevice as ad


def main() -> None:
    inv = ad.inventory()
    h = inv.host
    print(f"Python {h.python}, torch {h.torch} ({h.torch_build})")
    print(f"CUDA runtime {h.cuda_runtime}, cuDNN {h.cudnn}, NCCL {h.nccl}")
    print(f"NVIDIA driver {h.driver} (CUDA {h.driver_cuda}), NVIDIA GPUs in the machine: "
          f"{h.nvidia_gpus}")  # fmt: skip
    print(f"CPU {h.cpu_model!r}: {h.cores_usable} of {h.cores_logical} cores usable, "
          f"torch uses {h.torch_threads} threads")  # fmt: skip
    accelerators = inv.accelerators
    print(f"accelerators torch can use: {len(accelerators)}")
    for d in accelerators:
        smi = f", nvidia-smi GPU {d.smi_index}" if d.smi_index is not None else ""
        cc = "{}.{}".format(*d.compute_capability) if d.compute_capability else "?"
        print(f"  {d.spec}{smi}: {d.name}, compute capability {cc}, "
              f"{ad.memory(d.spec)}")  # fmt: skip
        if d.smi_index is not None and d.smi_index != d.index:
            print(f"    note: torch's {d.spec} is nvidia-smi's GPU {d.smi_index}")
    for note in inv.notes:
        print(f"  note: {note}")

    print(f"CUDA initialised by reading all that: {torch.cuda.is_initialized()}")

    dev = ad.device()
    why = "the best accelerator here" if dev.type != "cpu" else "no accelerator here"
    print(f"device: {dev} ({why}: {ad.describe(dev, telemetry=False).name})")
    model = torch.nn.Linear(4, 2)
    print(f"a new model is on {ad.device_of(model)}")
    ad.to(model, dev)
    print(f"after ad.to(model, {str(dev)!r}) it is on {ad.device_of(model)}")
    print(f"memory on {dev}: {ad.memory(dev)}")


if __name__ == "__main__":
    main()
