"""One rank's plan of a training step (pure): its coordinates and pipeline peers in every module it
serves, the step's micro-batch arithmetic, and its schedule table. The runtime asks this object,
never the layout, for rank arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.batch import MicroBatching, check_divides, micro_batching
from megatron_hetero.plan.colocated import (
    ColocatedTable,
    check_colocated,
    colocated_table,
    colocated_tables,
    stage_peer,
)
from megatron_hetero.plan.placement import Coord, coord_of, stage_ranks
from megatron_hetero.plan.roles import Roles, roles as layout_roles
from megatron_hetero.plan.schedule import Stage, StageTable, build_tables, rank_tables


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


def check_rank_plans(
    layout: HeteroLayout, global_batch: int, micro_batch_size: int, offload_encoders: bool = False
) -> tuple[Roles, MicroBatching, dict]:
    """Everything the rank plans of a resolved layout rest on, checked once per process: the roles,
    the step's micro-batch arithmetic, the colocated schedule's arithmetic or the disjoint 1F1B
    tables (one per pipeline stage). Arithmetic on module degrees, never a loop over ranks; ValueError
    for bad batch arithmetic. Returns (roles, micro-batching, {stage: its table} when disjoint)."""
    who = layout_roles(layout)
    mb = step_micro_batching(layout, global_batch, micro_batch_size, who)
    stages: dict = {}
    if layout.placement == "colocated":
        check_colocated(layout, global_batch, micro_batch_size, who)
    else:
        stages = build_tables(layout, mb.count)
    return who, mb, stages


def _module_ranks(layout: HeteroLayout, rank: int) -> dict[str, ModuleRank]:
    """This rank's coordinates and pipeline peers in every module it serves."""
    mods = {}
    for m in layout.modules:
        if m.rank_range.start <= rank <= m.rank_range.end:
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
    return mods


def _stage_of(layout: HeteroLayout, rank: int, mods: dict[str, ModuleRank]) -> Optional[Stage]:
    """The pipeline stage a rank of a disjoint layout runs (None on an idle rank)."""
    for name, mr in mods.items():
        return Stage(name, mr.coord.pp)  # disjoint: a rank serves at most one module
    return None


def rank_plan(
    layout: HeteroLayout,
    rank: int,
    global_batch: int,
    micro_batch_size: int,
    offload_encoders: bool = False,
    checked: Optional[tuple[Roles, MicroBatching, dict]] = None,
) -> RankPlan:
    """The plan of one rank, from its own coordinates: its modules, peers and schedule table, never
    the other ranks' (O(modules + pipeline stages)). `checked`: `check_rank_plans`'s result when the
    caller ran it for the layout and batch (else it runs here: it is arithmetic on module degrees)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside the layout's world size {layout.world_size}")
    who, mb, stages = checked or check_rank_plans(layout, global_batch, micro_batch_size, offload_encoders)
    mods = _module_ranks(layout, rank)
    coloc = disj = None
    if layout.placement == "colocated":
        coloc = colocated_table(layout, rank, global_batch, micro_batch_size, offload_encoders, who, mb)
    else:
        stage = _stage_of(layout, rank, mods)
        disj = stages[stage] if stage is not None else None
    return RankPlan(rank, layout, who, global_batch, micro_batch_size, mb, mods, colocated=coloc, disjoint=disj)


def rank_plans(
    layout: HeteroLayout, global_batch: int, micro_batch_size: int, offload_encoders: bool = False
) -> dict[int, RankPlan]:
    """{rank: RankPlan} for every rank of a resolved layout (the whole picture: reports, the
    schedule checker's tests); a rank that runs builds only its own (`rank_plan`). ValueError for bad
    batch arithmetic."""
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
        mods = _module_ranks(layout, rank)
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
