"""Variable image tokens: how a variable encoder's tiles become the edge tensor, and how the
language model puts the edge tensor's tokens at a sample's image placeholders.

A sample with n tiles of T tokens each has n*T image tokens. One boundary call (colocated: the step's
global batch; disjoint: one micro-batch) carries `[rows, seq, h]`: row r holds its sample's n_r*T
tokens (tile by tile) followed by zeros, `seq` = the largest n_r*T of the call's samples rounded up to
a multiple of what the boundary's CP chunking needs (`edge_seq`), the same on every rank because
every rank reads the tile counts (not the images) of the call's samples. The padding never reaches a
placeholder; its gradient is zero.

Nothing here communicates except `gather_cp_chunks` (an all-gather over the language model's CP
group, whose backward is a reduce-scatter).
"""

from __future__ import annotations

from typing import Sequence

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_hetero.models.cp_attention import cp_chunk_positions


def edge_seq(tiles: Sequence[int], tokens: int, multiple: int) -> int:
    """The edge sequence of one boundary call: max_r tiles_r * tokens rounded up to `multiple`
    (at least `multiple`: a call of text-only samples still sends a minimal, all-zero tensor)."""
    longest = max((t * tokens for t in tiles), default=0)
    return max(multiple, -(-longest // multiple) * multiple)


def pack_tiles(y: torch.Tensor, tiles: Sequence[int], seq: int) -> torch.Tensor:
    """[sum(tiles), T, h] encoder output (the rows' tiles, row by row) -> [rows, seq, h]: row r's
    tiles_r*T tokens first, zeros after. ValueError if a row does not fit in `seq`."""
    n, t, h = y.shape
    if n != sum(tiles):
        raise ValueError(f"the encoder returned {n} tiles, the rows have {list(tiles)} = {sum(tiles)}")
    if max((k * t for k in tiles), default=0) > seq:
        raise ValueError(f"rows of {[k * t for k in tiles]} image tokens do not fit in an edge sequence of {seq}")
    index = (
        torch.cat([r * seq + torch.arange(k * t) for r, k in enumerate(tiles)])
        if n
        else torch.zeros(0, dtype=torch.long)
    )
    out = y.new_zeros(len(tiles) * seq, h)
    return out.index_copy(0, index.to(y.device), y.reshape(n * t, h)).reshape(len(tiles), seq, h)


def gather_cp_chunks(got: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, seq/cp, h], this CP rank's load-balanced chunks of the edge sequence -> [b, seq, h], the
    whole edge sequence on every CP rank, in sequence order. Forward: an all-gather of [seq/cp, b, h]
    over `group` (Megatron's `gather_from_sequence_parallel_region`); backward: a reduce-scatter, the
    sum of every CP rank's gradient of the whole sequence, of which this rank keeps its chunks."""
    part = gather_from_sequence_parallel_region(got.transpose(0, 1).contiguous(), group=group)
    seq = part.shape[0]
    order = torch.cat([cp_chunk_positions(seq, r, cp) for r in range(cp)])
    return part.index_select(0, torch.argsort(order).to(part.device)).transpose(0, 1)


def place_by_mask(emb: torch.Tensor, got: torch.Tensor, mask: torch.Tensor, what: str) -> torch.Tensor:
    """`emb` [S, b, h] (the whole text sequence's embeddings) with row r's first mask[r].sum() tokens
    of `got` [b, seq, h] at the positions where mask[r] ([b, S] bool) is set, in order; autograd
    carries the gradient of those tokens back to `got` (zero for the padding). ValueError naming
    `what` if a row's mask has more positions than `got` has tokens."""
    rows, seq, h = got.shape
    counts = mask.sum(1)
    if rows != mask.shape[0] or (rows and int(counts.max()) > seq):
        raise ValueError(f"{what} delivered {tuple(got.shape)} for image masks of {counts.tolist()} tokens per row")
    r, p = torch.nonzero(mask, as_tuple=True)  # row-major: each row's positions in order
    j = torch.cumsum(mask.to(torch.long), 1)[r, p] - 1  # r's k-th image token goes to its k-th placeholder
    src = got.reshape(rows * seq, h).index_select(0, r * seq + j).to(emb.dtype)
    s, b, _ = emb.shape
    return emb.reshape(s * b, h).index_copy(0, p * b + r, src).reshape(s, b, h)
