"""CPU table entries (:mod:`.cpu`) for Megatron-core's mixture of experts: the alltoall token dispatcher's
split sizes and streams, the router, the aux-loss tracker and the expert modules.
"""

from __future__ import annotations

from typing import List

import torch

from ._patching import MARK
from .table import CPU, MCORE_0_19, Patch, Spot
from .cpu_entry import _MC, _redirect


def _moe_split_sizes_on_cpu() -> None:
    """`maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA tensors; on CPU the split
    sizes stay tensors, which `all_to_all_single` rejects. Convert CPU tensors too when asked."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, MARK, None) is not None:
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    setattr(maybe_move_tensor_to_cpu, MARK, original)
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


#: MOE_PATCHES: a part of :data:`.cpu.PATCHES` (reason CPU).
MOE_PATCHES: List[Patch] = [
    Patch(
        name="cpu.moe_split_sizes_numpy",
        reason=CPU,
        spot=f"{_MC}.transformer.moe.moe_utils: maybe_move_tensor_to_cpu(as_numpy=True) leaves CPU tensors as "
        "tensors (alltoall dispatcher split sizes; all_to_all_single wants a sequence)",
        action="CPU tensors become numpy arrays when as_numpy (rebound in token_dispatcher)",
        targets=MCORE_0_19,
        removal="remove when maybe_move_tensor_to_cpu honours as_numpy for tensors already on the CPU",
        spots=(
            Spot(
                f"{_MC}.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
                params=("tensor", "as_numpy", "record_stream"),
                uses=("and tensor.is_cuda:",),
            ),
            Spot(f"{_MC}.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu"),
        ),
        apply=_moe_split_sizes_on_cpu,
    ),
    _redirect(
        "cpu.moe_token_dispatcher",
        f"{_MC}.transformer.moe.token_dispatcher",
        f"{_MC}.transformer.moe.token_dispatcher: MoEAlltoAllTokenDispatcher (torch.cuda.Stream(), "
        "current_stream, stream context, record_event; device-to-host split sizes)",
        ("torch.cuda.Stream", "torch.cuda.current_stream"),
        "remove when the alltoall dispatcher takes its streams from the device of its tensors",
    ),
    _redirect(
        "cpu.moe_router",
        f"{_MC}.transformer.moe.router",
        f"{_MC}.transformer.moe.router: TopKRouter.gating/__init__ (weights moved to "
        "torch.cuda.current_device(); expert-bias buffers on it)",
        ("torch.cuda.current_device()",),
        "remove when TopKRouter keeps its weight and buffers on the device of its config/input",
    ),
]
