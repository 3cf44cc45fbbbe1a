"""CPU table entries (:mod:`.cpu`) for Megatron-core's RNG tracker (``tensor_parallel.random``): the "CUDA"
generator state is the CPU generator's, and the tracker's CPU-state warning is dropped.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import List

import torch

from ._patching import rebind_function
from .table import CPU, MCORE_0_19, Patch, Spot
from .cpu_entry import _RNG, _redirect


def _cpu_rng_state_functions() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")

    def make_get(original):
        @functools.wraps(original)
        def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
            if graph_safe:
                raise RuntimeError("CUDA-graph-safe RNG states need CUDA")
            return torch.get_rng_state()

        return _get_cuda_rng_state

    def make_set(original):
        @functools.wraps(original)
        def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
            if graph_safe:
                raise RuntimeError("CUDA-graph-safe RNG states need CUDA")
            torch.set_rng_state(new_state)

        return _set_cuda_rng_state

    rebind_function([random.__name__], "_get_cuda_rng_state", make_get)
    rebind_function([random.__name__], "_set_cuda_rng_state", make_set)


class _DropCpuRngWarning(logging.Filter):
    """On CPU the tracked "CUDA" generator *is* the CPU generator, so the tracker's check that
    random ops inside ``fork()`` left the CPU generator alone always fires with dropout > 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _silence_cpu_rng_warning() -> None:
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    if not any(isinstance(f, _DropCpuRngWarning) for f in logger.filters):
        logger.addFilter(_DropCpuRngWarning())


#: RNG_PATCHES: a part of :data:`.cpu.PATCHES` (reason CPU).
RNG_PATCHES: List[Patch] = [
    Patch(
        name="cpu.rng_state_functions",
        reason=CPU,
        spot=f"{_RNG}: _get_cuda_rng_state, _set_cuda_rng_state",
        action="read/write the CPU generator state (the CUDA generator does not exist)",
        targets=MCORE_0_19,
        removal="remove when the RNG tracker keeps the states of the current device's generator (CPU included)",
        spots=(
            Spot(f"{_RNG}:_get_cuda_rng_state", params=("device", "clone", "graph_safe"), uses=("torch.cuda",)),
            Spot(f"{_RNG}:_set_cuda_rng_state", params=("new_state", "device", "graph_safe"), uses=("torch.cuda",)),
        ),
        apply=_cpu_rng_state_functions,
    ),
    _redirect(
        "cpu.rng_tracker",
        _RNG,
        f"{_RNG}: CudaRNGStatesTracker.add, model_parallel_cuda_manual_seed (torch.cuda.get_rng_state / manual_seed)",
        ("torch.cuda.get_rng_state", "torch.cuda.manual_seed"),
        "remove with cpu.rng_state_functions (a device-agnostic RNG tracker)",
        spots=(
            Spot(f"{_RNG}:CudaRNGStatesTracker.add", "method", params=("self", "name", "seed")),
            Spot(f"{_RNG}:model_parallel_cuda_manual_seed", params=("seed",)),
        ),
    ),
    Patch(
        name="cpu.rng_warning_filter",
        reason=CPU,
        spot=f"{_RNG}: CudaRNGStatesTracker.fork logs 'CPU RNG state changed within GPU RNG context'",
        action="logging filter drops that one message (on CPU the two generators are one)",
        targets=MCORE_0_19,
        removal="remove with cpu.rng_tracker (or when fork() no longer compares the CPU generator)",
        spots=(
            Spot(
                f"{_RNG}:CudaRNGStatesTracker.fork",
                "method",
                params=("self", "name"),
                uses=("CPU RNG state changed within GPU RNG context",),
            ),
        ),
        apply=_silence_cpu_rng_warning,
    ),
]
