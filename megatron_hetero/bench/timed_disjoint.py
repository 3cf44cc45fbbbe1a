"""The disjoint schedule with its passes timed, run on forked ranks: what `bench schedule` and
`bench zb` measure bubbles and per-pass times from.

Every Forward, Backward and WeightGrad a rank runs is recorded as ``(kind, micro-batch, start, end)``
with kind ``F``, ``B`` or ``W`` (``time.perf_counter`` seconds). Nothing extra goes over the wire; a
barrier over the world starts each step so that the ranks' clocks line up.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch.distributed as dist

from megatron_hetero.runtime.config import runtime_config
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.plan.rank_plan import rank_plan
from megatron_hetero.runtime.disjoint import DisjointSchedule
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.training.setup import JobConfig, build_states
from megatron_hetero.training.trainer import prepare_rank


class TimedDisjoint(DisjointSchedule):
    """The disjoint schedule with every Forward, Backward and WeightGrad timed on this rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[str, int, float, float]] = []

    def _timed(self, kind: str, fn: Callable[[int], None], mb: int) -> None:
        t0 = time.perf_counter()
        fn(mb)
        self.spans.append((kind, mb, t0, time.perf_counter()))

    def _forward(self, mb: int) -> None:
        self._timed("F", super()._forward, mb)

    def _backward(self, mb: int) -> None:
        self._timed("B", super()._backward, mb)

    def _weight_grad(self, mb: int) -> None:
        self._timed("W", super()._weight_grad, mb)


def _rank_main(doc: dict, job: JobConfig, steps: int) -> dict[str, Any]:
    prepare_rank(job)
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    try:
        plan = rank_plan(layout, topo.rank, job.global_batch_size, job.micro_batch_size)
        states = build_states(plan, job, topo)
        sched = TimedDisjoint(plan, runtime_config(job), topo, states, LlavaStageRunner(job.spec, plan, states))
        out = []
        for it in range(steps):
            dist.barrier()
            sched.spans = []
            t0 = time.perf_counter()
            res = sched.step(it)
            out.append({"t0": t0, "t1": time.perf_counter(), "spans": list(sched.spans), "loss": res.loss})
        sched.close()
        stage = sched.table.stage if sched.table is not None else None
        c = sched.me.coord if sched.table is not None else None
        timer = c is not None and c.tp == 0 and c.cp == 0 and c.dp == 0
        return {"stage": (stage.module, stage.pp) if stage else None, "timer": timer, "steps": out}
    finally:
        topo.destroy()


def run_timed(doc: dict, job: JobConfig, steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` steps of ``job`` on the disjoint layout ``doc`` on forked ranks. Per rank:
    ``stage`` (module, pp) or None, ``timer`` (the stage's first rank: TP, CP and DP coordinates 0),
    ``steps``: per step ``t0``/``t1`` and ``spans`` (see the module docstring) and ``loss``."""
    return run_ranks(layout_from_dict(doc).world_size, _rank_main, doc, job, steps, timeout=900)
