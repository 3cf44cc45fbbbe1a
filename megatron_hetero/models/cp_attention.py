"""Context-parallel core attention for Megatron-core's local (non-TE) layer spec.

Megatron-core (0.19, as 0.16.1) only implements context parallelism inside ``TEDotProductAttention``; the
local ``DotProductAttention`` asserts ``context_parallel_size == 1``. This module is a drop-in
``core_attention`` that keeps Megatron's attention math (it *is* a ``DotProductAttention``) and
adds CP by all-gathering K and V over the CP group:

* Sequence layout: Megatron's load-balanced chunking. The global sequence of length ``S`` is cut
  into ``2*cp`` chunks of ``L = S / (2*cp)`` tokens; CP rank ``r`` holds chunks ``r`` and
  ``2*cp-1-r`` (``megatron.core.utils.get_batch_on_this_cp_rank``; RoPE is sliced the same way
  by ``get_pos_emb_on_this_cp_rank``).
* Forward: K and V (``[s_local, b, ng, hn]``) are all-gathered over CP
  (``gather_from_sequence_parallel_region``: all-gather forward, reduce-scatter backward), put back
  into global token order, and every local query attends to the full sequence under a mask that
  uses global positions. Backward therefore sums each K/V gradient over the CP ranks' queries.
* Masks: ``attention_mask=None`` with a causal layer means causal over global positions. A given
  boolean mask (``True`` = masked out) may be the full ``[..., S, S]`` mask (its rows are selected
  for the local queries) or already row-sliced ``[..., s_local, S]`` (what
  ``get_batch_on_this_cp_rank`` produces from a full mask).

Exact against CP=1 up to the order of the K/V gradient sum. Device-agnostic (pure torch and
Megatron mappings): correct on GPU too, though TE's ring attention is the fast path there.
With ``cp == 1`` it is exactly ``DotProductAttention``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.plan.blocks import seq_chunks

__all__ = ["ContextParallelDotProductAttention", "cp_chunk_positions"]


def cp_chunk_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """Global token positions held by ``cp_rank`` under Megatron's 2*cp load-balanced chunking
    (the intervals of the pure ``plan.blocks.seq_chunks``, as an index tensor)."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size}; context "
            f"parallelism cuts the sequence into 2*cp equal chunks"
        )
    return torch.cat([torch.arange(a, b, device=device) for a, b in seq_chunks(seq_len, cp_size, cp_rank)])


class ContextParallelDotProductAttention(DotProductAttention):
    """``DotProductAttention`` with context parallelism by K/V all-gather (see module docstring).

    Built like ``DotProductAttention`` (same constructor), so it can be the ``core_attention`` of a
    local layer spec. Needs ``pg_collection.cp`` (falls back to Megatron's global CP group when no
    pg_collection is given). ``cp_comm_type`` is accepted and ignored (always all-gather). Not
    supported with CP > 1: packed sequences (THD), sliding-window attention.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        cp_group = getattr(pg_collection, "cp", None)
        cp_size = cp_group.size() if cp_group is not None else 1
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"config.context_parallel_size = {config.context_parallel_size} but the CP "
                f"process group has {cp_size} ranks"
            )
        # DotProductAttention only refuses CP in __init__; build it from a CP=1 view of the config.
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1
        super().__init__(
            local_config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.config = config
        self.cp_group = cp_group
        self.cp_size = cp_size
        if cp_size > 1:
            if self.scale_mask_softmax.window_size is not None:
                raise NotImplementedError("sliding-window attention with context parallelism")
            # Queries are a subset of the keys: never use the square causal kernel/default mask;
            # this module always passes an explicit mask when cp > 1.
            self.scale_mask_softmax.attn_mask_type = AttnMaskType.arbitrary

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ):
        if self.cp_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        assert packed_seq_params is None, "packed sequences are not supported with CP here"
        cp, rank = self.cp_size, self.cp_group.rank()
        s_local = query.size(0)
        if s_local % 2:
            raise ValueError(
                f"local sequence length {s_local} is odd; with context parallelism each rank holds "
                f"two equal chunks (sequence length divisible by 2*cp = {2 * cp})"
            )
        seq_len = s_local * cp
        chunk = s_local // 2

        # [s_local, b, ng, hn] -> [cp * s_local, b, ng, hn] in rank order; rank r holds chunks
        # (r, 2cp-1-r). Reorder to global chunk order.
        key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        order = [0] * (2 * cp)  # global chunk -> index in the gathered tensor
        for r in range(cp):
            for j, (c, _) in enumerate(seq_chunks(2 * cp, cp, r)):  # a 2cp-long sequence: chunk c = [c, c+1)
                order[c] = 2 * r + j
        index = torch.tensor(order, device=key.device)
        key = key.reshape(2 * cp, chunk, *key.shape[1:]).index_select(0, index).flatten(0, 1)
        value = value.reshape(2 * cp, chunk, *value.shape[1:]).index_select(0, index).flatten(0, 1)

        q_pos = cp_chunk_positions(seq_len, rank, cp, device=query.device)
        attention_mask = self._local_mask(attention_mask, q_pos, seq_len, s_local)
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)

    def _local_mask(self, mask: Optional[Tensor], q_pos: Tensor, seq_len: int, s_local: int) -> Optional[Tensor]:
        if mask is None:
            if self.attn_mask_type != AttnMaskType.causal:
                return None
            k_pos = torch.arange(seq_len, device=q_pos.device)
            return (k_pos.view(1, -1) > q_pos.view(-1, 1)).view(1, 1, s_local, seq_len)
        if mask.size(-1) != seq_len:
            raise ValueError(
                f"attention mask with {mask.size(-1)} key positions; with context parallelism "
                f"the mask must cover the full sequence of {seq_len} keys"
            )
        if mask.size(-2) == seq_len:
            return mask.index_select(-2, q_pos)
        if mask.size(-2) in (1, s_local):  # broadcast rows, or already this rank's rows
            return mask
        raise ValueError(
            f"attention mask with {mask.size(-2)} query rows; expected {seq_len} (full) or "
            f"{s_local} (this CP rank's rows)"
        )
