"""One rank's boundary plan of one edge: only its own sends, receives and local copies.

Pure data, no torch.distributed. What a rank computes at start and for every new sequence shape:
its blocks on each side and its transfers in both directions, by interval arithmetic
(`plan/interval_route.py`: O(the rank's pieces), whatever the world size). The transfers are exactly
those of the whole-edge plan (`plan/boundary.py` `plan_boundary`) that touch the rank, in the same
order; the whole plan stays for the places that need every rank (`plan` report, drawings, benches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import Edge, HeteroLayout
from megatron_hetero.plan.blocks import Block, BoundaryShape, Transfer
from megatron_hetero.plan.boundary import check_shape, transform_of
from megatron_hetero.plan.interval_route import Side, needer_pieces, sender_pieces
from megatron_hetero.plan.route import LeaderRoute, plan_leader_route

DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class RankTransfers:
    """One direction of a rank's plan: what it `sends` to other ranks, `recvs` from other ranks, and
    the `local` pieces it copies from what it already holds, each in plan order."""

    sends: tuple[Transfer, ...] = ()
    recvs: tuple[Transfer, ...] = ()
    local: tuple[Transfer, ...] = ()


@dataclass(frozen=True)
class RankBoundaryPlan:
    """Rank `rank`'s part of one edge's plan for one shape.

    `is_src`: the rank is on the source module's last stage (it holds `holds`, its local source
    tensor's blocks in local order); `is_dst`: on the destination module's first stage (it needs
    `needs`). `forward` moves activations from holders to needers, `backward` their gradients back
    (`plan/boundary.py` module docstring). `route`: the leader route of the whole edge, only when
    asked for (hierarchical mode of a disjoint edge).
    """

    edge: Edge
    rank: int
    placement: str
    transform: str
    factor: int
    shape: BoundaryShape
    is_src: bool
    is_dst: bool
    holds: tuple[Block, ...]
    needs: tuple[Block, ...]
    forward: RankTransfers
    backward: RankTransfers
    route: Optional[LeaderRoute] = None

    @property
    def pass_through(self) -> bool:
        """True where this rank's destination tensor is its source tensor, element for element: it is
        on both sides, holds exactly the blocks it needs in the same local order, and sends and
        receives nothing in either direction (colocated equal-DP, same TP/CP on both sides). The
        runtime then hands the tensor (and, backward, its gradient) through without a copy."""
        return (
            self.is_src
            and self.is_dst
            and self.holds == self.needs
            and not any(d.sends or d.recvs for d in (self.forward, self.backward))
        )

    def _of(self, direction: str) -> RankTransfers:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def sends(self, direction: str = "forward") -> list[Transfer]:
        """Transfers this rank sends to other ranks, in plan order."""
        return list(self._of(direction).sends)

    def recvs(self, direction: str = "forward") -> list[Transfer]:
        """Transfers this rank receives from other ranks, in plan order."""
        return list(self._of(direction).recvs)

    def local_copies(self, direction: str = "forward") -> list[Transfer]:
        """Intervals this rank selects from what it already holds."""
        return list(self._of(direction).local)

    def peers(self, direction: str = "forward") -> tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]:
        """(what this rank sends, by destination peer; what it receives, by source peer), in plan order."""
        d = self._of(direction)
        sends: dict[int, list[Transfer]] = {}
        recvs: dict[int, list[Transfer]] = {}
        for t in d.sends:
            sends.setdefault(t.dst, []).append(t)
        for t in d.recvs:
            recvs.setdefault(t.src, []).append(t)
        return sends, recvs


def _split(pieces: list[Transfer], sent: list[Transfer]) -> RankTransfers:
    """A direction from the rank's incoming pieces (local copies and receives) and its sends."""
    return RankTransfers(
        sends=tuple(sent),
        recvs=tuple(t for t in pieces if not t.local),
        local=tuple(t for t in pieces if t.local),
    )


def plan_rank_boundary(
    layout: HeteroLayout, edge: Edge | str, shape: BoundaryShape, rank: int, with_route: bool = False
) -> RankBoundaryPlan:
    """Rank `rank`'s plan of one edge of a resolved layout for `shape` (ValueError on bad input);
    `with_route`: also the edge's leader route (disjoint placement only)."""
    if isinstance(edge, str):
        edge = Edge.parse(edge)
    if edge not in layout.edges:
        raise ValueError(f"edge {edge} is not declared; edges are {[str(e) for e in layout.edges]}")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the layout's world size {layout.world_size}")
    src, dst = layout.module(edge.src), layout.module(edge.dst)
    check_shape(edge, src, dst, shape)
    transform, factor = transform_of(src, dst)
    s, d = Side.source(src, shape), Side.destination(dst, shape)
    is_src, is_dst = s.contains(rank), d.contains(rank)
    # forward: destinations need, sources hold; backward: the other way round
    fwd_in = needer_pieces(rank, d, s) if is_dst else []
    fwd_out = sender_pieces(rank, d, s) if is_src else []
    bwd_in = needer_pieces(rank, s, d) if is_src else []
    bwd_out = sender_pieces(rank, s, d) if is_dst else []
    route = None
    if with_route:
        if layout.placement != "disjoint":
            raise ValueError(f"edge {edge}: the leader route is for disjoint placement only")
        route = plan_leader_route(src, dst, shape)
    return RankBoundaryPlan(
        edge=edge,
        rank=rank,
        placement=layout.placement,
        transform=transform,
        factor=factor,
        shape=shape,
        is_src=is_src,
        is_dst=is_dst,
        holds=s.blocks(rank) if is_src else (),
        needs=d.blocks(rank) if is_dst else (),
        forward=_split(fwd_in, fwd_out),
        backward=_split(bwd_in, bwd_out),
        route=route,
    )


class BoundaryPlanCache:
    """One rank's boundary plans of a layout, computed once per (edge, shape, with_route) and shared by
    every user on the rank (the schedules' boundaries, one per edge, and anything else that asks)."""

    def __init__(self, layout: HeteroLayout, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self._plans: dict[tuple[Edge, BoundaryShape, bool], RankBoundaryPlan] = {}

    def get(self, edge: Edge, shape: BoundaryShape, with_route: bool = False) -> RankBoundaryPlan:
        key = (edge, shape, with_route)
        if key not in self._plans:
            self._plans[key] = plan_rank_boundary(self.layout, edge, shape, self.rank, with_route)
        return self._plans[key]

    def __len__(self) -> int:
        return len(self._plans)
