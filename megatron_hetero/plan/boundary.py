"""Boundary plans: what every rank sends to whom on one edge, forward and backward.

Pure data computed from a resolved layout, an edge and the shape of the edge tensor
`[batch, seq, hidden]` (the whole step's batch that crosses the edge). No torch.distributed.

Data ownership (both sides, Megatron semantics):
- batch: DP rank d of a module owns the contiguous samples `plan.batch.dp_rows(B, dp, d)`
  = [d*B/dp, (d+1)*B/dp);
- sequence: with cp > 1, CP rank c owns Megatron's load-balanced chunks c and 2*cp-1-c of
  2*cp equal chunks (in that order, `plan.blocks.seq_chunks`); with cp == 1 the whole sequence;
- TP ranks are replicas: each holds the same tensor.
The source side of an edge is the source module's last pipeline stage; the destination side is the
destination module's first stage.

Forward moves activations from the ranks that hold them to the ranks that need them. Backward
moves gradients the other way: every source replica (TP rank) needs the gradient of everything it
holds; destination TP replicas hold identical gradients (Megatron all-reduces the input gradient
over TP), so exactly one of them supplies each element - gradients are never summed over replicas.

Two modes:
- direct (every edge; the only mode of a colocated edge): each piece travels once, point to point,
  from one rank that holds it to each rank that needs it; a rank that already holds a piece
  (colocated) copies it locally. This moves exactly the minimum (`forward`/`backward` transfers).
- hierarchical (disjoint edges only; leader-based, as the upstream bridge): source DP leaders
  send their shards to one destination leader, which broadcasts over its TP row, then each TP
  position broadcasts down its DP x CP column; every rank then selects its interval. Its explicit
  steps are `BoundaryPlan.route` (`plan/route.py`), and its priced bytes are those steps' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.blocks import Block, BoundaryShape, Transfer, seq_chunks
from megatron_hetero.plan.placement import coord_of, stage_ranks
from megatron_hetero.plan.route import LeaderRoute, leaders, plan_leader_route

__all__ = [
    "MODES",
    "TRANSFORMS",
    "Block",
    "BoundaryPlan",
    "BoundaryShape",
    "ModeCost",
    "Transfer",
    "check_shape",
    "needed_blocks",
    "owned_blocks",
    "plan_all",
    "plan_boundary",
    "route",
    "seq_chunks",
    "transform_of",
]

TRANSFORMS = ("equal-dp", "fan-in", "fan-out")
MODES = ("direct", "hierarchical")


@dataclass(frozen=True)
class ModeCost:
    """Bytes a mode moves between ranks and its serial hops (the longest chain of dependent messages)."""

    bytes: int
    hops: int


@dataclass(frozen=True)
class BoundaryPlan:
    """The complete plan of one edge for one shape."""

    edge: Edge
    placement: str
    transform: str
    factor: int
    shape: BoundaryShape
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    holds: dict[int, tuple[Block, ...]]
    needs: dict[int, tuple[Block, ...]]
    forward: tuple[Transfer, ...]
    backward: tuple[Transfer, ...]
    src_leaders: tuple[int, ...]
    dst_leader: int
    min_bytes_forward: int
    min_bytes_backward: int
    costs: dict[str, ModeCost] = field(default_factory=dict)
    route: Optional[LeaderRoute] = None  # the hierarchical mode's explicit steps (disjoint edges)

    def _transfers(self, direction: str) -> tuple[Transfer, ...]:
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def sends(self, rank: int, direction: str = "forward") -> list[Transfer]:
        """Transfers `rank` sends to other ranks, in plan order."""
        return [t for t in self._transfers(direction) if t.src == rank and not t.local]

    def recvs(self, rank: int, direction: str = "forward") -> list[Transfer]:
        """Transfers `rank` receives from other ranks, in plan order."""
        return [t for t in self._transfers(direction) if t.dst == rank and not t.local]

    def local_copies(self, rank: int, direction: str = "forward") -> list[Transfer]:
        """Intervals `rank` selects from what it already holds."""
        return [t for t in self._transfers(direction) if t.local and t.dst == rank]

    def planned_bytes(self, direction: str = "forward") -> int:
        """Bytes the direct mode moves between different ranks."""
        return _moved_bytes(self._transfers(direction), self.shape)

    def bytes_sent_per_rank(self, direction: str = "forward") -> dict[int, int]:
        h, nb = self.shape.hidden, self.shape.dtype_bytes
        out: dict[int, int] = {}
        for t in self._transfers(direction):
            if not t.local:
                out[t.src] = out.get(t.src, 0) + t.block.numel(h) * nb
        return out

    def local_groups(self) -> list[tuple[int, ...]]:
        """Sets of ranks that exchange data (connected by forward transfers), each sorted.

        For a colocated edge these are the local groups of the collective; a rank that only copies
        locally forms a group of one.
        """
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            parent.setdefault(x, x)
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for t in self.forward:
            parent[find(t.src)] = find(t.dst)
        groups: dict[int, list[int]] = {}
        for r in parent:
            groups.setdefault(find(r), []).append(r)
        return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0])

    @property
    def recommended_mode(self) -> str:
        """The mode that moves fewer bytes (ties: fewer serial hops)."""
        return min(self.costs, key=lambda k: (self.costs[k].bytes, self.costs[k].hops))


def transform_of(src: ModuleLayout, dst: ModuleLayout) -> tuple[str, int]:
    """('equal-dp' | 'fan-in' | 'fan-out', factor) for a src -> dst edge."""
    if src.dp == dst.dp:
        return "equal-dp", 1
    hi, lo = max(src.dp, dst.dp), min(src.dp, dst.dp)
    if hi % lo:
        raise ValueError(f"edge {src.name}->{dst.name}: dp {src.dp} -> {dst.dp}: factor {hi}/{lo} is not an integer")
    return ("fan-in" if src.dp > dst.dp else "fan-out"), hi // lo


def owned_blocks(m: ModuleLayout, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    """The blocks of the edge tensor that `rank` owns in module `m` (see module docstring)."""
    c = coord_of(m, rank)
    rows = dp_rows(shape.batch, m.dp, c.dp)
    return tuple(Block(rows.start, rows.stop, s0, s1) for s0, s1 in seq_chunks(shape.seq, m.cp, c.cp))


def needed_blocks(m: ModuleLayout, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    """The blocks of the edge tensor that destination `rank` of module `m` needs, in its local order.

    Without `dst_seq` these are the blocks it owns. With `dst_seq`, each of its CP chunks of the
    destination sequence is intersected with the placeholder span and mapped back to edge positions
    (a chunk that holds no edge token contributes nothing).
    """
    if shape.dst_seq is None:
        return owned_blocks(m, rank, shape)
    c = coord_of(m, rank)
    rows = dp_rows(shape.batch, m.dp, c.dp)
    out = []
    for a, b in seq_chunks(shape.dst_seq, m.cp, c.cp):
        lo, hi = max(a, shape.dst_offset), min(b, shape.dst_offset + shape.seq)
        if lo < hi:
            out.append(Block(rows.start, rows.stop, lo - shape.dst_offset, hi - shape.dst_offset))
    return tuple(out)


def check_shape(edge: Edge, src: ModuleLayout, dst: ModuleLayout, shape: BoundaryShape) -> None:
    """ValueError unless the shape splits evenly over both sides' DP and CP."""
    for name in ("batch", "seq", "hidden", "dtype_bytes"):
        v = getattr(shape, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"edge {edge}: {name} must be a positive integer, got {v!r}")
    if shape.dst_seq is not None:
        for name in ("dst_seq", "dst_offset"):
            v = getattr(shape, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "dst_seq" else 0):
                raise ValueError(
                    f"edge {edge}: {name} must be a {'positive' if name == 'dst_seq' else 'non-negative'} "
                    f"integer, got {v!r}"
                )
        if shape.dst_offset + shape.seq > shape.dst_seq:
            raise ValueError(
                f"edge {edge}: placeholder span [{shape.dst_offset}, {shape.dst_offset}+{shape.seq}) does not fit "
                f"in the destination sequence of {shape.dst_seq}"
            )
        if dst.cp > 1 and shape.dst_seq % (2 * dst.cp):
            raise ValueError(
                f"edge {edge}: destination sequence {shape.dst_seq} is not divisible by 2*cp = 2*{dst.cp} = "
                f"{2 * dst.cp} of destination {dst.name} (load-balanced context-parallel chunks)"
            )
    for side, m in (("source", src), ("destination", dst)):
        if shape.batch % m.dp:
            raise ValueError(
                f"edge {edge}: batch {shape.batch} is not divisible by {side} {m.name} dp({m.dp}) "
                f"(remainder {shape.batch % m.dp}); every DP rank must get the same number of samples"
            )
        # the destination's CP chunks are over dst_seq when the tokens land in a longer sequence
        if m.cp > 1 and shape.seq % (2 * m.cp) and not (side == "destination" and shape.dst_seq is not None):
            raise ValueError(
                f"edge {edge}: sequence {shape.seq} is not divisible by 2*cp = 2*{m.cp} = {2 * m.cp} "
                f"of {side} {m.name} (load-balanced context-parallel chunks)"
            )


def route(
    holders: dict[int, tuple[Block, ...]], needers: dict[int, tuple[Block, ...]], pick: dict[int, int]
) -> list[Transfer]:
    """Direct routing: every needed element comes from exactly one holder.

    For each needer and each needed block, the block is cut along the holders' blocks; a piece the
    needer itself holds is a local copy; otherwise replica number `pick[needer] % len(replicas)`
    (replicas sorted by rank; `pick` is the needer's index in its stage) sends it, which spreads
    the sending over the holders' TP replicas.
    """
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


def _min_bytes(
    holders: dict[int, tuple[Block, ...]], needers: dict[int, tuple[Block, ...]], shape: BoundaryShape
) -> int:
    """Elements each needer needs and does not already hold, summed over needers, in bytes."""
    total = 0
    for n, needs in needers.items():
        held = holders.get(n, ())
        for need in needs:
            own = sum(x.numel(shape.hidden) for x in (need.intersect(h) for h in held) if x is not None)
            total += need.numel(shape.hidden) - own
    return total * shape.dtype_bytes


def _moved_bytes(transfers: Iterable[Transfer], shape: BoundaryShape) -> int:
    return sum(t.block.numel(shape.hidden) for t in transfers if not t.local) * shape.dtype_bytes


def _max_messages(transfers: Iterable[Transfer]) -> int:
    """Most peers any one rank exchanges with (pieces between the same pair travel as one message)."""
    peers: dict[int, set[int]] = {}
    for t in transfers:
        if not t.local:
            peers.setdefault(t.src, set()).add(t.dst)
            peers.setdefault(t.dst, set()).add(t.src)
    return max((len(p) for p in peers.values()), default=0)


def plan_boundary(layout: HeteroLayout, edge: Edge | str, shape: BoundaryShape) -> BoundaryPlan:
    """Plan one edge of a resolved layout for the given shape (ValueError on bad input)."""
    if isinstance(edge, str):
        edge = Edge.parse(edge)
    if edge not in layout.edges:
        raise ValueError(f"edge {edge} is not declared; edges are {[str(e) for e in layout.edges]}")
    src, dst = layout.module(edge.src), layout.module(edge.dst)
    check_shape(edge, src, dst, shape)
    transform, factor = transform_of(src, dst)
    src_ranks = stage_ranks(src, src.pp - 1)
    dst_ranks = stage_ranks(dst, 0)
    holds = {r: owned_blocks(src, r, shape) for r in src_ranks}
    needs = {r: needed_blocks(dst, r, shape) for r in dst_ranks}
    forward = route(holds, needs, {r: i for i, r in enumerate(dst_ranks)})
    backward = route(needs, holds, {r: i for i, r in enumerate(src_ranks)})
    costs = {"direct": ModeCost(bytes=_moved_bytes(forward, shape), hops=_max_messages(forward))}
    leader_route = None
    if layout.placement == "disjoint":
        # priced by its own steps: the bytes of the forward leader route
        leader_route = plan_leader_route(src, dst, shape, holds, needs)
        costs["hierarchical"] = ModeCost(bytes=leader_route.bytes("forward"), hops=leader_route.hops)
    src_leaders, dst_leader = leaders(src, dst)
    return BoundaryPlan(
        edge=edge,
        placement=layout.placement,
        transform=transform,
        factor=factor,
        shape=shape,
        src_ranks=tuple(src_ranks),
        dst_ranks=tuple(dst_ranks),
        holds=holds,
        needs=needs,
        forward=tuple(forward),
        backward=tuple(backward),
        src_leaders=src_leaders,
        dst_leader=dst_leader,
        min_bytes_forward=_min_bytes(holds, needs, shape),
        min_bytes_backward=_min_bytes(needs, holds, shape),
        costs=costs,
        route=leader_route,
    )


def plan_all(layout: HeteroLayout, shapes: dict[Edge, BoundaryShape] | BoundaryShape) -> list[BoundaryPlan]:
    """Plans for every edge; `shapes` is one shape for all edges or a mapping edge -> shape."""
    out = []
    for e in layout.edges:
        shape = shapes if isinstance(shapes, BoundaryShape) else shapes[e]
        out.append(plan_boundary(layout, e, shape))
    return out
