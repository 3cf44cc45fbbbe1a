"""The one place that picks a plan's schedule: colocated three-phase or disjoint graph-1F1B."""

from __future__ import annotations

from typing import Any, Union

from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.colocated import ColocatedSchedule, colocated_boundaries
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.disjoint import DisjointSchedule, disjoint_boundaries
from megatron_hetero.runtime.stage_runner import StageRunner


def schedule_for(
    plan: RankPlan, config: RuntimeConfig, topo: Any, states: dict[str, Any], runner: StageRunner
) -> Union[ColocatedSchedule, DisjointSchedule]:
    """The schedule of the plan's placement, driving `runner` on this rank."""
    if plan.layout.placement == "colocated":
        return ColocatedSchedule(plan, config, topo, states, runner)
    return DisjointSchedule(plan, config, topo, states, runner)


def schedule_boundaries(plan: RankPlan, config: RuntimeConfig, topo: Any, runner: StageRunner) -> dict[Any, Boundary]:
    """The boundaries the schedule of the plan's placement builds on this rank (plans only, no
    communication): `dryrun` plans them without building the schedule."""
    if plan.layout.placement == "colocated":
        return colocated_boundaries(plan, config, topo, runner)
    return disjoint_boundaries(plan, config, runner, topo)
