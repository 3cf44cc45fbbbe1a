"""One `Session` for every front end: what one rank trains with under one layout.

A session assembles, in this order and the same way for `megatron-hetero train` (LLaVA,
`training.llava_spec.LlavaTrainSpec`) and the patched Megatron-LM scripts
(`megatron_lm.session.ScriptSpec`): the spec's `prepare()` (what must exist before any process
group), the layout's process groups (`runtime.topology.Topology`, with the spec's comm timeout), this
rank's plan (`plan.rank_plan.rank_plan`, with the validated arithmetic when given), the spec's module
states, learning-rate schedulers and start iteration, the spec's stage runner, the schedule
(`runtime.schedules.schedule_for`, with a recording tracer instead of the spec's when given) and the
spec's front end. A failure while building tears the topology down again. `finish()` gathers the
parameters, lets the spec finish (e.g. gather the trace), closes the schedule and, where the spec
asks, meets the world at a barrier; `destroy()` releases the spec's holdings and the process groups.

What differs between front ends is the `ModelSpec` (torchtitan's TrainSpec shape). Building a
session is collective over the world, and so are `finish()` and `destroy()`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import torch.distributed as dist

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.rank_plan import RankPlan, rank_plan
from megatron_hetero.runtime.config import RuntimeConfig
from megatron_hetero.runtime.schedules import Schedule, schedule_for
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.config.job import Job
from megatron_hetero.training.loop import LoopSpec
from megatron_hetero.training.run_stats import MeteredSchedule


class ModelSpec(Protocol):
    """What a front end's model adds to a `Session` (the module docstring's order)."""

    #: the seconds a collective may take before it names itself and fails (`--hetero-comm-timeout`)
    comm_timeout_s: float
    #: the batch the rank plan splits: samples per global batch and per micro-batch, and whether the
    #: encoders are offloaded (`--hetero-offload-encoder`)
    global_batch_size: int
    micro_batch_size: int
    offload_encoder: bool
    #: a step's increment of the schedulers (train: 1 per iteration; Megatron's: the global batch)
    scheduler_increment: int
    #: the interval of the run's checkpoints (0: only the last iteration's, when `save_dir` is set)
    save_interval: int
    #: True: `finish()` ends with a world barrier (the scripts do)
    barrier_at_finish: bool
    #: the activation meter the loop's schedule is wrapped with (--log-memory), or None
    meter: Any

    @property
    def save_dir(self) -> Optional[str]:
        """The directory of the run's checkpoints (None: none); read when a loop starts."""
        ...

    def prepare(self, layout: HeteroLayout) -> None:
        """What must exist before the layout's process groups (collective where it builds a model)."""
        ...

    def build_states(self, plan: RankPlan, topo: Topology) -> tuple[dict[str, Any], dict[str, Any], int]:
        """(module states by name, learning-rate schedulers by name, the iteration to start at), with
        a checkpoint's state loaded into them when the run resumes."""
        ...

    def build_runner(self, plan: RankPlan, states: dict[str, Any]) -> Any:
        """The `StageRunner` the schedule drives (the model side and its data)."""
        ...

    def runtime_config(self, plan: RankPlan) -> RuntimeConfig:
        """The schedule's runtime configuration on this rank (its tracer, timeouts, schedule name)."""
        ...

    def front_end(self, session: "Session") -> Any:
        """The training loop's front end (`training.loop.FrontEnd`: records, lines, evaluation, save)."""
        ...

    def describe(self, session: "Session") -> str:
        """One line naming the session: the layout and the iteration it starts at."""
        ...

    def announce(self, session: "Session") -> None:
        """What the front end prints when the session starts training (maybe nothing)."""
        ...

    def finish(self, session: "Session") -> None:
        """The spec's part after the last step, before the schedule is closed (collective)."""
        ...

    def release(self) -> None:
        """Let go of what `prepare` built (before the process groups are destroyed)."""
        ...


class Session:
    """Everything one rank trains with under the validated `job` (`config.job.Job`: the layout,
    its `JobConfig` where the front end has one, and the rank plans' checked arithmetic) and the
    front end's `spec` (module docstring): `topo`, `plan`, `states`, `schedulers`, `start`, `runner`,
    `schedule` and `front`. `tracer`: a recording tracer for the schedule instead of the spec's
    (`--hetero-autotune`'s windows). The rank's plan is built from `job.checked`, so nothing the door
    validated is computed again. Collective: every rank builds its session together."""

    def __init__(self, job: Job, spec: ModelSpec, tracer=None) -> None:
        layout = job.layout
        # the run's `JobConfig` (train), or the one `--hetero-autotune` prices (scripts; else None)
        self.layout, self.spec, self.job = layout, spec, job.config
        spec.prepare(layout)
        self.topo = topo = Topology.build(layout, timeout_s=spec.comm_timeout_s)
        try:
            self.plan = plan = rank_plan(
                layout,
                topo.rank,
                spec.global_batch_size,
                spec.micro_batch_size,
                spec.offload_encoder,
                checked=job.checked,
            )
            self.states, self.schedulers, self.start = spec.build_states(plan, topo)
            self.runner = spec.build_runner(plan, self.states)
            config = spec.runtime_config(plan)
            if tracer is not None:
                config = dataclasses.replace(config, tracer=tracer)
            self.schedule: Schedule = schedule_for(plan, config, topo, self.states, self.runner)
            self.front = spec.front_end(self)
        except BaseException:
            self.destroy()
            raise

    def describe(self) -> str:
        """The spec's line naming this session."""
        return self.spec.describe(self)

    def announce(self) -> None:
        """What the front end prints when this session starts training."""
        self.spec.announce(self)

    def loop_schedule(self):
        """The schedule `training.loop.run_loop` steps (metered with the spec's activation meter)."""

        meter = self.spec.meter
        return MeteredSchedule(self.schedule, meter) if meter is not None else self.schedule

    def loop_spec(self, start: int, end: int, final_save: bool = True):
        """The `LoopSpec` of iterations [start, end) with the spec's checkpoints and scheduler step."""

        spec = self.spec
        return LoopSpec(
            start=start,
            train_iters=end,
            scheduler_increment=spec.scheduler_increment,
            save=spec.save_dir,
            save_interval=spec.save_interval,
            rank=self.topo.rank,
            final_save=final_save,
        )

    def finish(self) -> None:
        """After the last step: --overlap-param-gather's gathered parameters, the spec's finish (train:
        its --trace), the schedule closed, and a world barrier where the spec asks (collective)."""
        for s in self.states.values():
            s.gather_params()
        self.spec.finish(self)
        self.schedule.close()
        if self.spec.barrier_at_finish:
            dist.barrier()

    def params(self) -> dict[str, Any]:
        """This rank's parameters by module and its coordinates (parity tests)."""
        return {
            "params": {
                n: {k: p.detach().cpu().clone() for k, p in s.module.named_parameters()} for n, s in self.states.items()
            },
            "coords": {n: self.topo.coord(n).as_dict() for n in self.states},
        }

    def destroy(self) -> None:
        """The spec's holdings released and the layout's process groups destroyed (collective)."""
        self.spec.release()
        self.topo.destroy()
