"""The reference for the interval routing: the direct boundary route as it was first written, every
needed block intersected with every held block (O(n_src x n_dst)). Tests compare the package's
per-rank and whole-edge plans against it; the package itself no longer contains it.
"""

from __future__ import annotations

from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.blocks import Block, BoundaryShape, Transfer, seq_chunks
from megatron_hetero.plan.placement import coord_of, stage_ranks


def owned(m: ModuleLayout, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    c = coord_of(m, rank)
    rows = dp_rows(shape.batch, m.dp, c.dp)
    return tuple(Block(rows.start, rows.stop, s0, s1) for s0, s1 in seq_chunks(shape.seq, m.cp, c.cp))


def needed(m: ModuleLayout, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    if shape.dst_seq is None:
        return owned(m, rank, shape)
    c = coord_of(m, rank)
    rows = dp_rows(shape.batch, m.dp, c.dp)
    out = []
    for a, b in seq_chunks(shape.dst_seq, m.cp, c.cp):
        lo, hi = max(a, shape.dst_offset), min(b, shape.dst_offset + shape.seq)
        if lo < hi:
            out.append(Block(rows.start, rows.stop, lo - shape.dst_offset, hi - shape.dst_offset))
    return tuple(out)


def route(
    holders: dict[int, tuple[Block, ...]], needers: dict[int, tuple[Block, ...]], pick: dict[int, int]
) -> list[Transfer]:
    """Every needer's every needed block against every held region (regions sorted); a piece the
    needer holds is local, else replica `pick[needer] % len(replicas)` (replicas sorted) sends it."""
    by_block: dict[Block, list[int]] = {}
    for r, blocks in sorted(holders.items()):
        for b in blocks:
            by_block.setdefault(b, []).append(r)
    regions = sorted(by_block)
    out: list[Transfer] = []
    for n in sorted(needers):
        for need in needers[n]:
            for region in regions:
                piece = need.intersect(region)
                if piece is None:
                    continue
                replicas = by_block[region]
                src = n if n in replicas else replicas[pick[n] % len(replicas)]
                out.append(Transfer(src=src, dst=n, block=piece))
    return out


def min_bytes(
    holders: dict[int, tuple[Block, ...]], needers: dict[int, tuple[Block, ...]], shape: BoundaryShape
) -> int:
    total = 0
    for n, needs in needers.items():
        held = holders.get(n, ())
        for need in needs:
            own = sum(x.numel(shape.hidden) for x in (need.intersect(h) for h in held) if x is not None)
            total += need.numel(shape.hidden) - own
    return total * shape.dtype_bytes


def allpairs(layout: HeteroLayout, edge: Edge, shape: BoundaryShape) -> dict:
    """{'holds', 'needs', 'forward', 'backward', 'min_forward', 'min_backward'} of one edge."""
    src, dst = layout.module(edge.src), layout.module(edge.dst)
    src_ranks, dst_ranks = stage_ranks(src, src.pp - 1), stage_ranks(dst, 0)
    holds = {r: owned(src, r, shape) for r in src_ranks}
    needs = {r: needed(dst, r, shape) for r in dst_ranks}
    return {
        "holds": holds,
        "needs": needs,
        "forward": route(holds, needs, {r: i for i, r in enumerate(dst_ranks)}),
        "backward": route(needs, holds, {r: i for i, r in enumerate(src_ranks)}),
        "min_forward": min_bytes(holds, needs, shape),
        "min_backward": min_bytes(needs, holds, shape),
    }


def of_rank(transfers: list[Transfer], rank: int) -> tuple[list[Transfer], list[Transfer], list[Transfer]]:
    """(sends, receives, local copies) of `rank`, filtered from the whole route in its order."""
    return (
        [t for t in transfers if t.src == rank and not t.local],
        [t for t in transfers if t.dst == rank and not t.local],
        [t for t in transfers if t.dst == rank and t.local],
    )
