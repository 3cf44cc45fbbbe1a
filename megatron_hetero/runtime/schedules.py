"""The one place that picks a plan's schedule (colocated three-phase or disjoint graph-1F1B), and
`Schedule`, the protocol both interpreters implement and every caller uses.

A schedule runs this rank's share of a training (or evaluation) step: `step(step, train)` executes
the rank plan's table (`plan/colocated.py` or `plan/schedule.py`, in the action vocabulary of
`plan/actions.py`) over the global samples [step*G, (step+1)*G) and returns the step's `StepResult`;
`close()` releases what the schedule holds (callable once, after the last step). Over the wire, a
step sends the boundary and pipeline messages of its table and the closing collectives (gradient
reduction, optimizer step, loss all-reduce); `close()` sends nothing.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.colocated import ColocatedSchedule, colocated_boundaries
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.disjoint import DisjointSchedule, disjoint_boundaries
from megatron_hetero.runtime.stage_runner import StageRunner
from megatron_hetero.runtime.step import StepResult


@runtime_checkable
class Schedule(Protocol):
    """What the training loop, evaluation, the dry run and the front ends use of a schedule
    (`ColocatedSchedule` and `DisjointSchedule` implement it; see the module docstring)."""

    plan: RankPlan  # this rank's plan
    config: RuntimeConfig  # the runtime configuration (its tracer, timeouts, the schedule's name)
    runner: StageRunner  # the model side the schedule drives
    boundaries: Mapping[Any, Boundary]  # the boundaries this rank takes part in (edge name or link ->)

    def step(self, step: int, train: bool = True) -> StepResult:
        """One step over the global samples [step*G, (step+1)*G); train=False: evaluation (no
        gradient reduction, no optimizer step). Collective over the world."""
        ...

    def close(self) -> None:
        """Release what the schedule holds, once, after its last step."""
        ...


def schedule_for(
    plan: RankPlan, config: RuntimeConfig, topo: Any, states: dict[str, Any], runner: StageRunner
) -> Schedule:
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
