"""Direct routing of one edge by interval arithmetic: one rank's pieces without looking at the others.

Pure data, no torch. Ownership (`plan/boundary.py` module docstring): on each side of an edge, DP
rank d of the side's stage holds the contiguous rows [d*B/dp, (d+1)*B/dp), CP rank c its sequence
intervals (Megatron's load-balanced chunks; on the destination with `dst_seq`, the chunks clipped to
the placeholder span), and the TP ranks of one (dp, cp) are replicas. So the blocks of one side form
a grid: DP row intervals x the sorted sequence intervals of the CP ranks. The holders of a needed
block are found by division (rows) and bisection (sequence), in O(pieces), never by scanning every
block of the other side.

`needer_pieces` is the direct route of one needer: for each of its needed blocks (its local order),
the block cut along the holders' grid in block order (rows, then sequence); a piece the needer holds
itself is a local copy, otherwise TP replica `pick % tp` of the holding (dp, cp) sends it, where
`pick` is the needer's index in its stage (which spreads the sending over the replicas).
`sender_pieces` is the same route seen from a holder: the pieces it sends, in the order of the whole
edge's route (needers by rank, then their pieces). Both give exactly the transfers of the all-pairs
route (`BoundaryPlan.forward` / `.backward`) that touch the rank.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterator, Optional

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.blocks import Block, BoundaryShape, Transfer, seq_chunks
from megatron_hetero.plan.placement import coord_of


def owned_blocks(m: ModuleLayout, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    """The blocks of the edge tensor that `rank` owns in module `m` (see `plan/boundary.py`)."""
    c = coord_of(m, rank)
    rows = dp_rows(shape.batch, m.dp, c.dp)
    return tuple(Block(rows.start, rows.stop, s0, s1) for s0, s1 in seq_chunks(shape.seq, m.cp, c.cp))


def _needed_seq(m: ModuleLayout, cp_rank: int, shape: BoundaryShape) -> list[tuple[int, int]]:
    """Edge positions destination CP rank `cp_rank` needs, in its local order."""
    if shape.dst_seq is None:
        return seq_chunks(shape.seq, m.cp, cp_rank)
    out = []
    for a, b in seq_chunks(shape.dst_seq, m.cp, cp_rank):
        lo, hi = max(a, shape.dst_offset), min(b, shape.dst_offset + shape.seq)
        if lo < hi:
            out.append((lo - shape.dst_offset, hi - shape.dst_offset))
    return out


def needed_blocks(m: ModuleLayout, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    """The blocks of the edge tensor that destination `rank` of module `m` needs, in its local order.

    Without `dst_seq` these are the blocks it owns. With `dst_seq`, each of its CP chunks of the
    destination sequence is intersected with the placeholder span and mapped back to edge positions
    (a chunk that holds no edge token contributes nothing).
    """
    c = coord_of(m, rank)
    rows = dp_rows(shape.batch, m.dp, c.dp)
    return tuple(Block(rows.start, rows.stop, s0, s1) for s0, s1 in _needed_seq(m, c.cp, shape))


class Side:
    """One side of an edge for one shape: the source module's last stage holding its blocks
    (`needed=False`) or the destination module's first stage needing its blocks (`needed=True`).
    In the backward route the two swap roles (the destination holds the gradients)."""

    __slots__ = ("module", "stage", "shape", "needed", "start", "size", "rows_per")

    def __init__(self, module: ModuleLayout, stage: int, shape: BoundaryShape, needed: bool) -> None:
        self.module, self.stage, self.shape, self.needed = module, stage, shape, needed
        self.size = module.stage_size
        self.start = module.offset + stage * self.size  # the first global rank of the side's stage
        self.rows_per = shape.batch // module.dp

    @classmethod
    def source(cls, m: ModuleLayout, shape: BoundaryShape) -> "Side":
        return cls(m, m.pp - 1, shape, False)

    @classmethod
    def destination(cls, m: ModuleLayout, shape: BoundaryShape) -> "Side":
        return cls(m, 0, shape, True)

    @property
    def ranks(self) -> range:
        """The side's ranks (its stage), in rank order."""
        return range(self.start, self.start + self.size)

    def contains(self, rank: int) -> bool:
        return self.start <= rank < self.start + self.size

    def seq_of(self, cp_rank: int) -> list[tuple[int, int]]:
        """Sequence intervals of CP rank `cp_rank`'s blocks, in its local order."""
        if self.needed:
            return _needed_seq(self.module, cp_rank, self.shape)
        return seq_chunks(self.shape.seq, self.module.cp, cp_rank)

    def blocks(self, rank: int) -> tuple[Block, ...]:
        """The blocks `rank` (a rank of the side) holds or needs, in its local order."""
        return (
            needed_blocks(self.module, rank, self.shape) if self.needed else owned_blocks(self.module, rank, self.shape)
        )

    def grid(self) -> "Grid":
        """The side's sequence intervals sorted by position, with their CP ranks."""
        ivs = sorted((s0, s1, c) for c in range(self.module.cp) for s0, s1 in self.seq_of(c))
        return Grid(tuple(a for a, _, _ in ivs), tuple(b for _, b, _ in ivs), tuple(c for _, _, c in ivs))

    def rank_at(self, tp: int, cp: int, dp: int) -> int:
        m = self.module
        return self.start + tp + m.tp * (cp + m.cp * dp)


@dataclass(frozen=True)
class Grid:
    """A side's sequence intervals in position order: starts, ends (both increasing; the intervals
    do not overlap) and the CP rank holding each."""

    s0: tuple[int, ...]
    s1: tuple[int, ...]
    cp: tuple[int, ...]

    def overlapping(self, s0: int, s1: int) -> range:
        """Indices of the intervals that overlap [s0, s1)."""
        return range(bisect_right(self.s1, s0), bisect_left(self.s0, s1))


def _route(needer: int, needers: Side, holders: Side, grid: Grid) -> Iterator[tuple[int, int, int, int, int]]:
    """(src, b0, b1, s0, s1) of each piece into `needer`, in route order (see the module docstring)."""
    h = holders.module
    per = holders.rows_per
    pick = needer - needers.start
    own = coord_of(h, needer) if holders.contains(needer) else None
    for need in needers.blocks(needer):
        span = grid.overlapping(need.s0, need.s1)
        for d in range(need.b0 // per, (need.b1 - 1) // per + 1):
            b0, b1 = max(need.b0, d * per), min(need.b1, (d + 1) * per)
            for i in span:
                c = grid.cp[i]
                if own is not None and own.dp == d and own.cp == c:
                    src = needer
                else:
                    src = holders.rank_at(pick % h.tp, c, d)
                yield src, b0, b1, max(need.s0, grid.s0[i]), min(need.s1, grid.s1[i])


def needer_pieces(needer: int, needers: Side, holders: Side, grid: Optional[Grid] = None) -> list[Transfer]:
    """The direct route's transfers into `needer` (a rank of `needers`), in route order: local
    copies (src == dst) and receives. `grid`: `holders.grid()`, when the caller has it."""
    return [
        Transfer(src, needer, Block(b0, b1, s0, s1))
        for src, b0, b1, s0, s1 in _route(needer, needers, holders, grid or holders.grid())
    ]


def message_counts(needers: Side, holders: Side) -> tuple[int, int]:
    """(messages, most peers of one rank) of the whole direction: a message is one (src, dst) pair
    with non-local pieces (pieces between one pair travel together). Counts only, no transfer lists:
    a needer's sources are the holder (dp, cp) regions its rows and sequence intervals overlap (one
    TP replica each, `pick % tp`), less the region it holds itself."""
    grid = holders.grid()
    n_mod, h_mod = needers.module, holders.module
    # holder CP ranks whose intervals overlap each needer CP rank's intervals; holder DP ranks per needer DP rank
    cps = {
        c: sorted({grid.cp[i] for a, b in needers.seq_of(c) for i in grid.overlapping(a, b)}) for c in range(n_mod.cp)
    }
    per_n, per_h = needers.rows_per, holders.rows_per
    h_start, h_end, h_tp, h_cp = holders.start, holders.start + holders.size, h_mod.tp, h_mod.cp
    peers: dict[int, set[int]] = {}
    messages = 0
    for local in range(needers.size):  # rank arithmetic inline: this loop runs once per needer
        n = needers.start + local
        c_n, d_n = (local // n_mod.tp) % n_mod.cp, local // (n_mod.tp * n_mod.cp)
        own = None
        if h_start <= n < h_end:  # the needer's own (dp, cp) on the holders' side
            own = ((n - h_start) // (h_tp * h_cp), ((n - h_start) // h_tp) % h_cp)
        base = h_start + local % h_tp  # TP replica pick % tp of every region
        srcs = [
            base + h_tp * (c + h_cp * d)
            for d in range(d_n * per_n // per_h, ((d_n + 1) * per_n - 1) // per_h + 1)
            for c in cps[c_n]
            if (d, c) != own
        ]
        if not srcs:
            continue
        messages += len(srcs)
        peers.setdefault(n, set()).update(srcs)
        for src in srcs:
            peers.setdefault(src, set()).add(n)
    return messages, max((len(p) for p in peers.values()), default=0)


def min_bytes(needers: Side, holders: Side) -> int:
    """Bytes of everything each needer needs and does not already hold, summed over the needers (a
    needer holds something only where both sides share ranks). The direct route moves exactly this."""
    shape, hn, hh = needers.shape, needers.module, holders.module
    need_seq = {c: needers.seq_of(c) for c in range(hn.cp)}
    held_seq = {c: holders.seq_of(c) for c in range(hh.cp)}
    rows, rows_h = needers.rows_per, holders.rows_per
    h_start, h_end = holders.start, holders.start + holders.size
    need_len = {c: sum(b - a for a, b in need_seq[c]) for c in need_seq}
    total = 0
    for local in range(needers.size):  # rank arithmetic inline: this loop runs once per needer
        n = needers.start + local
        c_n, d_n = (local // hn.tp) % hn.cp, local // (hn.tp * hn.cp)
        total += rows * need_len[c_n]
        if h_start <= n < h_end:
            o_dp, o_cp = (n - h_start) // (hh.tp * hh.cp), ((n - h_start) // hh.tp) % hh.cp
            r0, r1 = max(d_n * rows, o_dp * rows_h), min((d_n + 1) * rows, (o_dp + 1) * rows_h)
            if r0 < r1:
                both = sum(max(0, min(b, y) - max(a, x)) for a, b in need_seq[c_n] for x, y in held_seq[o_cp])
                total -= (r1 - r0) * both
    return total * shape.hidden * shape.dtype_bytes


def sender_pieces(sender: int, needers: Side, holders: Side, grid: Optional[Grid] = None) -> list[Transfer]:
    """The transfers `sender` (a rank of `holders`) sends to other ranks, in the order of the whole
    edge's route (needers by rank, then each needer's pieces). Only needers whose rows overlap the
    sender's and whose stage index picks the sender's TP replica can receive from it."""
    grid = grid or holders.grid()
    h, n = holders.module, needers.module
    me = coord_of(h, sender)
    per_h, per_n = holders.rows_per, needers.rows_per
    lo, hi = me.dp * per_h, (me.dp + 1) * per_h
    out: list[Transfer] = []
    for d in range(lo // per_n, (hi - 1) // per_n + 1):
        for c in range(n.cp):
            for t in range(n.tp):
                r = needers.rank_at(t, c, d)
                if (r - needers.start) % h.tp != me.tp or r == sender:
                    continue
                out += [x for x in needer_pieces(r, needers, holders, grid) if x.src == sender]
    return out
