"""The CPU stand-ins that :mod:`megatron_hetero.compat.cpu` swaps into Megatron modules: a ``torch``
whose ``cuda`` namespace and tensor factories mean the CPU (:class:`_TorchOnCpu`), and context
managers that make ``tensor.cuda()`` the identity or ``tensor.type()`` report CUDA type names for
the duration of one wrapped Megatron call. Nothing here patches anything by itself.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable

import torch

from ._patching import MARK, swapped

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return torch.device(device).type == "cuda"
    # A bare int is a CUDA ordinal for torch factories.
    return isinstance(device, int) and not isinstance(device, bool)


def _factory_on_cpu(factory: Callable) -> Callable:
    """``factory(..., device="cuda"|int|cuda device, pin_memory=True)`` -> CPU, unpinned."""

    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs an accelerator
        return factory(*args, **kwargs)

    setattr(wrapper, MARK, factory)
    return wrapper


class _CudaOnCpu:
    """What ``torch.cuda`` means inside a redirected Megatron module on a CPU-only machine.

    The CUDA generator is the CPU generator, the current device is the CPU, synchronisation and
    cache release are no-ops. Anything else falls through to the real ``torch.cuda``.
    """

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    # Streams and events (MoE's alltoall token dispatcher moves its split sizes to the host on a
    # side stream): on CPU there is one stream and everything is already synchronous.
    Stream = staticmethod(lambda *a, **k: _CPU_STREAM)

    @staticmethod
    def current_stream(device: Any = None) -> "_CpuStream":
        return _CPU_STREAM

    @staticmethod
    def stream(s: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuStream:
    """The one CPU 'stream': waits and events are no-ops (CPU work is synchronous)."""

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self  # doubles as the event: synchronize() is a no-op

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _TorchOnCpu(types.ModuleType):
    """Stands in for the global name ``torch`` inside one Megatron module.

    Differs from ``torch`` only in ``torch.cuda`` (:class:`_CudaOnCpu`) and in the tensor factories
    below, whose ``device="cuda"`` becomes CPU. Every other attribute is the real torch one.
    """

    _FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange")

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in self._FACTORIES:
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))
        setattr(self, MARK, torch)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __repr__(self) -> str:
        return "<torch redirected to CPU by megatron_hetero.compat>"


_TORCH_ON_CPU = _TorchOnCpu()


def _tensor_cuda_is_identity() -> contextlib.AbstractContextManager:
    """``tensor.cuda(...)`` returns the tensor itself (it is already where CPU code wants it)."""
    return swapped(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


_TYPE = torch.Tensor.type


def _type_with_cuda_names(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _TYPE(self, dtype, non_blocking, **kwargs)


def _tensor_type_reports_cuda() -> contextlib.AbstractContextManager:
    """``tensor.type()`` of a CPU tensor reads ``'torch.cuda.FloatTensor'`` (etc.)."""
    return swapped(torch.Tensor, "type", _type_with_cuda_names)
