"""`megatron-hetero train`'s model spec (`training.session.ModelSpec`): LLaVA's module states and
schedulers (resumed from `--load` with the project's checkpoint), its stage runner (synthetic data,
or the caption / conversation data of `--data-*`), the job's runtime configuration, `train`'s front
end (`training.train_front_end.TrainFrontEnd`) and its `--trace` gathered when the run finishes."""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.config import RuntimeConfig, runtime_config
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.runtime.trace import gather_trace
from megatron_hetero.config.job import Job, JobConfig
from megatron_hetero.training.memory_log import ActivationMeter
from megatron_hetero.checkpoint.save_load import load_checkpoint, save_checkpoint
from megatron_hetero.models.job_data import runner_factory  # captions or conversations
from megatron_hetero.training.lr_schedule import build_scheduler
from megatron_hetero.training.setup import build_states


class LlavaTrainSpec:
    """LLaVA under the validated `job` (a `config.job.Job`; module docstring): `self.job` is its
    `JobConfig`, `self.validated` the whole, whose layout the checkpoints save and load. `log`: the
    run's `IterationLog` (None: no lines, e.g. the dry run's real rank); `step_hook(iteration)`: runs after every step, its value the record's
    `probe`. Holds nothing of its own between sessions: `prepare` and `release` do nothing."""

    scheduler_increment = 1  # train's schedulers count iterations (training/lr_schedule.py)
    barrier_at_finish = False

    def __init__(self, job: Job, log=None, step_hook: Optional[Callable[[int], Any]] = None) -> None:
        self.validated = job
        self.job: JobConfig = job.config
        self.log, self.step_hook = log, step_hook
        job_config = job.config
        self.comm_timeout_s = job_config.comm_timeout_s
        self.global_batch_size, self.micro_batch_size = job_config.global_batch_size, job_config.micro_batch_size
        self.offload_encoder = job_config.offload_encoder
        self.save_dir, self.save_interval = job_config.save, job_config.save_interval
        self.meter: Optional[ActivationMeter] = None  # --log-memory's, attached in `front_end`

    def prepare(self, layout: HeteroLayout) -> None:
        """Nothing: `training.trainer.prepare_rank` set up the process before the first session."""

    def build_states(self, plan: RankPlan, topo: Topology) -> tuple[dict, dict, int]:
        job = self.job
        states = build_states(plan, job, topo)
        schedulers = {
            n: build_scheduler(
                s.optimizer,
                job.schedule,
                job.optim.lr,
                job.optim.weight_decay,
                job.train_iters,
                override=job.override_opt_param_scheduler,
            )
            for n, s in states.items()
            if s.optimizer is not None
        }
        start = load_checkpoint(job.load, self.validated, topo, states, schedulers) if job.load else 0
        return states, schedulers, start

    def build_runner(self, plan: RankPlan, states: dict):
        job = self.job
        if job.data is not None:
            runner = runner_factory(job.data, job.spec, job.global_batch_size, heldout=bool(job.eval_interval))(
                plan, states
            )
            if runner is not None:
                return runner
        return LlavaStageRunner(job.spec, plan, states)

    def runtime_config(self, plan: RankPlan) -> RuntimeConfig:
        return runtime_config(self.job, plan.rank)

    def front_end(self, session):
        """`TrainFrontEnd` with --log-memory's activation meter attached to the modules (after the
        schedule is built), the run's figures (`RunStats`) and the project's checkpoint as `save`."""
        from megatron_hetero.training.run_stats import RunStats
        from megatron_hetero.training.train_front_end import TrainFrontEnd

        job, validated, topo, states, schedulers = (
            session.job,
            self.validated,
            session.topo,
            session.states,
            session.schedulers,
        )
        if job.log_memory:  # activation peaks of every training step (training/memory_log.py)
            self.meter = ActivationMeter()
            for n, s in states.items():
                self.meter.attach(n, s.module)
        writers = bool(job.tensorboard_dir or job.wandb_project)
        stats = RunStats(validated, session.plan, states, self.meter, writers=writers)
        return TrainFrontEnd(
            job,
            session.plan,
            states,
            session.schedule,
            self.log,
            save=lambda it: save_checkpoint(job.save, it, validated, topo, states, schedulers),
            step_hook=self.step_hook,
            stats=stats,
        )

    def describe(self, session) -> str:
        layout = session.layout
        return (
            f"training with {layout.placement} layout "
            + ", ".join(f"{m.name} {m.short()}@{m.ranks}" for m in layout.modules)
            + f", from iteration {session.start}"
        )

    def announce(self, session) -> None:
        """Nothing: train's first lines come from the iteration log."""

    def finish(self, session) -> None:
        """The job's --trace: gathered over the world, written by rank 0 (collective when tracing)."""
        layout = session.layout
        gather_trace(
            session.schedule.config.tracer,
            {
                "placement": layout.placement,
                "layout": {m.name: f"{m.short()} @{m.ranks}" for m in layout.modules},
            },
        )

    def release(self) -> None:
        """Nothing held."""
