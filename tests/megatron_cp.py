"""Megatron's own context-parallel sequence split, asked without a process group: the reference the
CP tests compare our chunk positions (models/cp_attention.cp_chunk_positions, the boundary plan) with."""

from __future__ import annotations


class _FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def megatron_cp_positions(seq: int, cp: int, cp_rank: int) -> list[int]:
    """Sequence positions ``megatron.core.utils.get_batch_on_this_cp_rank`` gives ``cp_rank`` of ``cp``
    (megatron-core 0.19: it asks ``torch.distributed.get_rank/get_world_size(cp_group)``, which are
    answered from a stand-in group during the call)."""
    import torch
    import torch.distributed as dist
    from megatron.core import utils as mcore_utils

    saved = dist.get_rank, dist.get_world_size
    dist.get_rank = lambda group=None: group.rank()  # type: ignore[assignment]
    dist.get_world_size = lambda group=None: group.size()  # type: ignore[assignment]
    try:
        batch = {"tokens": torch.arange(seq).view(1, seq)}
        out = mcore_utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=_FakeGroup(cp_rank, cp))
    finally:
        dist.get_rank, dist.get_world_size = saved
    return out["tokens"][0].tolist()
