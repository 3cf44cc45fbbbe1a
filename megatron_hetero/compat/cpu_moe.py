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


def _gloo_uneven_all_gather() -> None:
    """`_gather_along_first_dim(input_, group, output_split_sizes)` (the alltoall dispatcher's
    expert-TP gather of each rank's routed tokens, `expt_tp` > 1; the backward of its reduce-scatter)
    all-gathers pieces of different sizes with `torch.distributed.all_gather`, which gloo refuses
    ("invalid tensor size"). On a gloo group with uneven sizes each rank's piece is padded with zeros
    to the largest, gathered in one equal all-gather and the padding cut off again: the same tensor
    over the wire plus the padding rows."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim
    if getattr(original, MARK, None) is not None:
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (
            output_split_sizes is None
            or group is None
            or group.size() == 1
            or len(set(output_split_sizes)) == 1
            or dist.get_backend(group) != "gloo"
        ):
            return original(input_, group, output_split_sizes, use_global_buffer)
        big = max(output_split_sizes)
        x = input_.contiguous()
        if x.shape[0] < big:
            x = torch.cat([x, x.new_zeros((big - x.shape[0], *x.shape[1:]))])
        parts = [torch.empty_like(x) for _ in output_split_sizes]
        dist.all_gather(parts, x, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    setattr(_gather_along_first_dim, MARK, original)
    mappings._gather_along_first_dim = _gather_along_first_dim


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
    Patch(
        name="cpu.gloo_uneven_all_gather",
        reason=CPU,
        spot=f"{_MC}.tensor_parallel.mappings: _gather_along_first_dim(output_split_sizes=...) all-gathers "
        "pieces of different sizes (the alltoall dispatcher's expert-TP gather), which gloo refuses",
        action="on gloo with uneven sizes: pad each piece to the largest, one equal all-gather, cut the padding",
        targets=MCORE_0_19,
        removal="remove when gloo's all_gather takes tensors of different sizes",
        spots=(
            Spot(
                f"{_MC}.tensor_parallel.mappings:_gather_along_first_dim",
                params=("input_", "group", "output_split_sizes", "use_global_buffer"),
                uses=("torch.distributed.all_gather(output_tensor_list, input_, group=group)",),
            ),
        ),
        apply=_gloo_uneven_all_gather,
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
