"""Where the runner's tensors live: eager torch on the CPU, or torch_xla (TPU, or PJRT CPU).

The runner asks the backend three things: which device to put tensors on, whether shapes must be
static (a compiling backend pads every step to a bucket), and how to end a step (``sync`` cuts
and runs the lazy XLA graph). Nothing else in meshserve imports torch_xla directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Backend:
    name: str  # "cpu" or "xla"
    device: torch.device
    static_shapes: bool
    on_tpu: bool = False

    def sync(self) -> None:
        if self.name == "xla":
            import torch_xla

            torch_xla.sync()


def tpu_present() -> bool:
    """True on a TPU VM or GKE TPU node: libtpu or the TPU runtime environment is there."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        return True
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_ID") is not None:
        return os.path.exists("/dev/accel0") or os.path.exists("/dev/vfio/0")
    return False


def resolve_device(device: str) -> str:
    """``auto`` picks xla on a TPU host and cpu elsewhere."""
    if device == "auto":
        return "xla" if tpu_present() else "cpu"
    if device not in ("cpu", "xla"):
        raise ValueError(f"device: {device!r} is not one of auto, cpu, xla")
    return device


def create_backend(device: str) -> Backend:
    name = resolve_device(device)
    if name == "cpu":
        return Backend("cpu", torch.device("cpu"), static_shapes=False)
    raise NotImplementedError("device='xla' is not available yet; use device='cpu'")
