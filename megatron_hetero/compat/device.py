"""The one place that asks torch which accelerator this process runs on.

Everything outside ``megatron_hetero.compat`` takes its device and its process-group backend from
here and never calls ``torch.cuda.*`` itself (``is_available``/``device_count`` excepted).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = [
    "get_device",
    "default_backend",
    "set_local_device",
    "synchronize",
    "device_sync",
    "transformer_engine_unavailable",
    "memory_allocated",
]


def get_device() -> torch.device:
    """The device this process computes on: the current CUDA device when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """The torch.distributed backend that matches :func:`get_device`: ``"nccl"`` or ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def set_local_device(local_rank: Optional[int]) -> torch.device:
    """Bind this process to GPU ``local_rank % device_count`` (before creating NCCL groups).

    On a machine without CUDA this binds nothing and returns the CPU device.
    """
    if torch.cuda.is_available() and local_rank is not None:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return get_device()


def synchronize(device: Optional[torch.device] = None) -> None:
    """Wait for queued work on ``device`` (default: :func:`get_device`); a no-op on CPU."""
    device = get_device() if device is None else torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_sync() -> Optional[Callable[[], None]]:
    """What a timer calls before it reads the host clock, so that a span ends when the device's work
    ends and not when its kernels were queued: ``torch.cuda.synchronize`` of this process's current
    CUDA device (Megatron's own timers do the same); None on CPU, where nothing is queued."""
    device = get_device()
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


def memory_allocated(device: Optional[torch.device] = None) -> int:
    """Bytes of device memory held by tensors on `device` (default: :func:`get_device`); 0 on CPU."""
    device = get_device() if device is None else torch.device(device)
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def transformer_engine_unavailable() -> Optional[str]:
    """Why Megatron's Transformer Engine layer specs cannot run in this process (None: they can).

    Looks for the ``transformer_engine`` package without importing it (on a machine without CUDA
    its import breaks ``import megatron.core``) and asks torch for a CUDA GPU; never initialises CUDA.
    """
    import importlib.util

    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU")
    if importlib.util.find_spec("transformer_engine") is None:
        missing.append("no transformer_engine package")
    if not missing:
        return None
    return (
        "--transformer-impl transformer_engine needs a CUDA GPU and the transformer-engine package "
        "(pip install megatron-hetero[gpu] on a GPU machine); this machine has " + " and ".join(missing)
    )
