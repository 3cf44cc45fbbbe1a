"""One rank's plan of a training step (pure): its coordinates and pipeline peers in every module it
serves, the step's micro-batch arithmetic, and its schedule table. The runtime asks this object,
never the layout, for rank arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.batch import MicroBatching, check_divides, micro_batching
from megatron_hetero.plan.colocated import ColocatedTable, colocated_tables, stage_peer
from megatron_hetero.plan.placement import Coord, coord_of, stage_ranks
from megatron_hetero.plan.roles import Roles, roles as layout_roles
from megatron_hetero.plan.schedule import StageTable, rank_tables


@dataclass(frozen=True)
class ModuleRank:
    """This rank inside one module: coordinates, pipeline position and peers (same tp/cp/dp one
    stage down/up; None at the ends)."""

    module: str
    coord: Coord
    pp: int
    dp: int
    cp: int
    prev_rank: Optional[int]
    next_rank: Optional[int]
    frozen: bool

    @property
    def first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.coord.pp == self.pp - 1


@dataclass(frozen=True)
class RankPlan:
    """Everything rank `rank` needs to run a step of `layout` (see the module docstring).
    `colocated` / `disjoint` is this rank's table for the layout's placement (`disjoint` is None on a
    rank no stage uses)."""

    rank: int
    layout: HeteroLayout
    roles: Roles
    global_batch: int
    micro_batch_size: int
    micro_batching: MicroBatching
    modules: dict[str, ModuleRank]
    colocated: Optional[ColocatedTable] = None
    disjoint: Optional[StageTable] = None

    def serves(self, module: str) -> bool:
        return module in self.modules

    def stage_ranks(self, module: str, pp: int) -> list[int]:
        """The global ranks of pipeline stage `pp` of `module` (any module of the layout)."""
        return stage_ranks(self.layout.module(module), pp)


def step_micro_batching(
    layout: HeteroLayout, global_batch: int, micro_batch_size: int, who: Optional[Roles] = None
) -> MicroBatching:
    """The step's micro-batches: M = G / dp / micro_batch_size of the first language module.
    Disjoint: micro-batch i is the global samples [i*G/M, (i+1)*G/M) of the step, split over every
    module's DP, so G/M must be divisible by every module's dp. ValueError with the arithmetic."""
    who = who or layout_roles(layout)
    first = layout.module(who.first_language)
    mb = micro_batching(global_batch, first.dp, micro_batch_size, what=f"module {first.name}")
    if layout.placement == "disjoint":
        for m in layout.modules:
            check_divides(
                mb,
                m.dp,
                f"module {m.name} (the disjoint schedule's micro-batch is --global-batch-size "
                f"{global_batch} over {mb.count} = {global_batch}/dp({first.dp})/"
                f"--micro-batch-size {micro_batch_size} micro-batches)",
            )
    return mb


def rank_plans(
    layout: HeteroLayout, global_batch: int, micro_batch_size: int, offload_encoders: bool = False
) -> dict[int, RankPlan]:
    """{rank: RankPlan} for every rank of a resolved layout; ValueError for bad batch arithmetic."""
    who = layout_roles(layout)
    mb = step_micro_batching(layout, global_batch, micro_batch_size, who)
    coloc = (
        colocated_tables(layout, global_batch, micro_batch_size, offload_encoders, who)
        if layout.placement == "colocated"
        else {}
    )
    disj = rank_tables(layout, mb.count) if layout.placement == "disjoint" else {}
    out = {}
    for rank in range(layout.world_size):
        mods = {}
        for m in layout.modules:
            if rank in m.rank_range.ranks():
                mods[m.name] = ModuleRank(
                    m.name,
                    coord_of(m, rank),
                    m.pp,
                    m.dp,
                    m.cp,
                    stage_peer(layout, m.name, rank, -1),
                    stage_peer(layout, m.name, rank, +1),
                    m.frozen,
                )
        out[rank] = RankPlan(
            rank,
            layout,
            who,
            global_batch,
            micro_batch_size,
            mb,
            mods,
            colocated=coloc.get(rank),
            disjoint=disj.get(rank),
        )
    return out


def rank_plan(
    layout: HeteroLayout, rank: int, global_batch: int, micro_batch_size: int, offload_encoders: bool = False
) -> RankPlan:
    """The plan of one rank (computes every rank's tables: they are small and the checker needs all)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the layout's world size {layout.world_size}")
    return rank_plans(layout, global_batch, micro_batch_size, offload_encoders)[rank]
