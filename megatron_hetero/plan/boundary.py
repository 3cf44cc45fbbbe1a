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
from functools import cached_property
from typing import Iterable, Optional

from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout
from megatron_hetero.plan.blocks import Block, BoundaryShape, Transfer, seq_chunks
from megatron_hetero.plan.interval_route import Side, min_bytes, needed_blocks, needer_pieces, owned_blocks
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

    @cached_property
    def _by_rank(self) -> dict[str, dict[int, tuple[list[Transfer], list[Transfer], list[Transfer]]]]:
        """{direction: {rank: (sends, receives, local copies)}}, each in plan order (built once, on
        the first per-rank question: a report asks it for every rank)."""
        out: dict[str, dict[int, tuple[list[Transfer], list[Transfer], list[Transfer]]]] = {}
        for direction in ("forward", "backward"):
            idx: dict[int, tuple[list[Transfer], list[Transfer], list[Transfer]]] = {}
            for t in self._transfers(direction):
                if t.local:
                    idx.setdefault(t.dst, ([], [], []))[2].append(t)
                else:
                    idx.setdefault(t.src, ([], [], []))[0].append(t)
                    idx.setdefault(t.dst, ([], [], []))[1].append(t)
            out[direction] = idx
        return out

    def _of(self, rank: int, direction: str, which: int) -> list[Transfer]:
        self._transfers(direction)  # ValueError for a bad direction
        got = self._by_rank[direction].get(rank)
        return list(got[which]) if got else []

    def sends(self, rank: int, direction: str = "forward") -> list[Transfer]:
        """Transfers `rank` sends to other ranks, in plan order."""
        return self._of(rank, direction, 0)

    def recvs(self, rank: int, direction: str = "forward") -> list[Transfer]:
        """Transfers `rank` receives from other ranks, in plan order."""
        return self._of(rank, direction, 1)

    def local_copies(self, rank: int, direction: str = "forward") -> list[Transfer]:
        """Intervals `rank` selects from what it already holds."""
        return self._of(rank, direction, 2)

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
    src_side, dst_side = Side.source(src, shape), Side.destination(dst, shape)
    src_ranks, dst_ranks = src_side.ranks, dst_side.ranks
    holds = {r: src_side.blocks(r) for r in src_ranks}
    needs = {r: dst_side.blocks(r) for r in dst_ranks}
    # every needer's pieces by interval arithmetic, needers in rank order (plan/interval_route.py)
    src_grid, dst_grid = src_side.grid(), dst_side.grid()
    forward = [t for r in dst_ranks for t in needer_pieces(r, dst_side, src_side, src_grid)]
    backward = [t for r in src_ranks for t in needer_pieces(r, src_side, dst_side, dst_grid)]
    costs = {"direct": ModeCost(bytes=_moved_bytes(forward, shape), hops=_max_messages(forward))}
    leader_route = None
    if layout.placement == "disjoint":
        # priced by its own steps: the bytes of the forward leader route
        leader_route = plan_leader_route(src, dst, shape)
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
        min_bytes_forward=min_bytes(dst_side, src_side),
        min_bytes_backward=min_bytes(src_side, dst_side),
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
