"""The geometry every boundary plan is written in: the edge tensor's shape, its blocks, transfers of
blocks between ranks, and Megatron's load-balanced context-parallel chunking.

Pure data, no torch. Shared by the direct plan (`plan/boundary.py`), the leader route
(`plan/route.py`) and `models.cp_attention.cp_chunk_positions` (the one definition of the CP chunks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BoundaryShape:
    """Shape of the edge tensor for one step: [batch, seq, hidden] and element size in bytes.

    `dst_seq`/`dst_offset` describe an edge whose tokens are inserted into a longer destination
    sequence (image tokens at placeholder positions [dst_offset, dst_offset+seq) of a dst_seq-long
    text sequence): the destination's CP chunks are then taken over dst_seq *before* sharding, and
    a destination CP rank needs only the edge tokens that fall into its chunks.
    """

    batch: int
    seq: int
    hidden: int
    dtype_bytes: int = 4
    dst_seq: Optional[int] = None
    dst_offset: int = 0


@dataclass(frozen=True, order=True)
class Block:
    """A rectangle of the global edge tensor: samples [b0, b1) x positions [s0, s1) x all hidden."""

    b0: int
    b1: int
    s0: int
    s1: int

    def numel(self, hidden: int) -> int:
        return (self.b1 - self.b0) * (self.s1 - self.s0) * hidden

    def intersect(self, other: "Block") -> Optional["Block"]:
        b0, b1 = max(self.b0, other.b0), min(self.b1, other.b1)
        s0, s1 = max(self.s0, other.s0), min(self.s1, other.s1)
        return Block(b0, b1, s0, s1) if b0 < b1 and s0 < s1 else None

    def contains(self, other: "Block") -> bool:
        return self.b0 <= other.b0 and other.b1 <= self.b1 and self.s0 <= other.s0 and other.s1 <= self.s1

    def __str__(self) -> str:
        return f"b[{self.b0}:{self.b1}] s[{self.s0}:{self.s1}]"


@dataclass(frozen=True)
class Transfer:
    """`block` goes from global rank `src` to global rank `dst` (src == dst: a local copy, no bytes)."""

    src: int
    dst: int
    block: Block

    @property
    def local(self) -> bool:
        return self.src == self.dst


def seq_chunks(seq: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """Sequence intervals CP rank `cp_rank` owns under Megatron's load-balanced 2*cp chunking:
    chunks `cp_rank` and `2*cp-1-cp_rank` of 2*cp equal chunks, in that order (the whole sequence
    when cp == 1). The one definition of Megatron's `get_batch_on_this_cp_rank` layout here."""
    if cp == 1:
        return [(0, seq)]
    n = seq // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return [(first * n, (first + 1) * n), (second * n, (second + 1) * n)]


def local_extent(blocks: tuple[Block, ...]) -> tuple[int, int]:
    """(rows, tokens) of the local tensor made of `blocks` concatenated along seq (blocks of one
    rank share their sample rows)."""
    if not blocks:
        return (0, 0)
    return (blocks[0].b1 - blocks[0].b0, sum(b.s1 - b.s0 for b in blocks))


def locate(blocks: tuple[Block, ...], piece: Block) -> tuple[slice, slice]:
    """Local (batch, seq) slices of `piece` inside a tensor made of `blocks` concatenated along seq."""
    offset = 0
    for blk in blocks:
        if blk.contains(piece):
            s = offset + piece.s0 - blk.s0
            b = piece.b0 - blk.b0
            return slice(b, b + piece.b1 - piece.b0), slice(s, s + piece.s1 - piece.s0)
        offset += blk.s1 - blk.s0
    raise AssertionError(f"piece {piece} is not inside the local blocks {blocks}")
