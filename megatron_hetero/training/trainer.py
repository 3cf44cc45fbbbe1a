"""The training loop of one rank, for colocated and disjoint layouts alike."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hetero.runtime.config import runtime_config
from megatron_hetero.compat import ensure_global_memory_buffer, require_compat, set_local_device
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.schedules import schedule_for
from megatron_hetero.config.job import Job, JobConfig
from megatron_hetero.training.llava_spec import LlavaTrainSpec
from megatron_hetero.training.session import Session
from megatron_hetero.training.signals import ExitSignal
from megatron_hetero.training.autotune_run import train_autotuned
from megatron_hetero.training.iteration_log import IterationLog
from megatron_hetero.training.loop import run_loop
from megatron_hetero.training.writers import open_writers


def prepare_rank(job: JobConfig) -> None:
    """Per-process state Megatron-core needs before models are built: the device, the attention
    score buffer and the RNG tracker (dropout is 0, so the tracker's streams are never drawn).
    Assumes the entry point applied `megatron_hetero.compat` (a forked rank inherits it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    require_compat("training.trainer.prepare_rank")
    set_local_device(int(os.environ.get("LOCAL_RANK", "0")))  # GPU: one device per rank; CPU: no-op
    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(job.spec.seed, tp_rank=0, ep_rank=0, etp_rank=0)


def make_schedule(plan: RankPlan, job: JobConfig, topo, states, runner=None):
    """The schedule of the plan's placement (`runtime.schedules.schedule_for`), driving `runner` (the
    LLaVA runner by default), with this rank's tracer when `job.trace` names a file."""
    runner = runner if runner is not None else LlavaStageRunner(job.spec, plan, states)
    return schedule_for(plan, runtime_config(job, plan.rank), topo, states, runner)


def train_session(
    job: Job,
    log,
    step_hook: Optional[Callable[[int], Any]] = None,
    tracer=None,
) -> Session:
    """The `Session` LLaVA trains with under the validated `job`'s layout
    (`training.llava_spec.LlavaTrainSpec`; the rank's plan from the job's checked arithmetic): its
    iteration lines through `log` (None: none), `step_hook` after every step, `tracer` instead of the
    job's (`--hetero-autotune`'s windows). The `make_session` of `training.autotune_run.train_autotuned`.
    Collective."""
    return Session(job, LlavaTrainSpec(job, log, step_hook), tracer=tracer)


def train_rank(
    job: Job,
    collect_params: bool = False,
    log_write: Optional[Callable[[str], None]] = None,
    step_hook: Optional[Callable[[int], Any]] = None,
) -> dict[str, Any]:
    """Run iterations [start, train_iters) of the validated `job` (`training.setup.validate_job`) on
    this rank (start: 0, or the iteration of the checkpoint under its --load); returns per-step
    records (loss is global, the same on every rank) and, if asked, this rank's parameters by module
    (for parity tests). Saves a checkpoint every --save-interval iterations and after the last one
    with --save. Global rank 0 writes iteration lines through `log_write` (--log-interval,
    --progress). `step_hook(iteration)` runs after every step on every rank; its return value is the
    record's `probe`. With --exit-signal-handler, SIGTERM stops every rank after the same step
    (training/signals.py). With --hetero-autotune the run may move to another layout on the way
    (`training/autotune_run.py`); the records and parameters are those of the layout it ends on. The
    rank builds its plan from the job's checked arithmetic, computed once per process."""

    config = job.config
    prepare_rank(config)
    stop = ExitSignal(config.exit_signal_handler).install()  # SIGTERM sets a flag (signals.py)
    writers = None
    session: Optional[Session] = None
    try:
        rank = dist.get_rank()
        writers = open_writers(config, rank, job.layout.world_size)  # the last rank's TensorBoard / W&B
        log = IterationLog(
            log_write if rank == 0 else None,
            config.train_iters,
            config.global_batch_size,
            config.log_interval,
            config.progress,
        )
        if config.autotune is not None:
            session, records = train_autotuned(job, log, stop, writers, train_session, step_hook)
        else:
            session = train_session(job, log, step_hook)
            outcome = run_loop(
                session.loop_schedule(),
                session.schedulers,
                session.loop_spec(session.start, config.train_iters),
                session.front,
                stop,
                write=log.write,
                writers=writers,
            )
            records = outcome.records
        log.close()
        session.finish()
        out: dict[str, Any] = {"records": records}
        if collect_params:
            out.update(session.params())
        return out
    finally:
        if writers is not None:
            writers.close()
        stop.restore()
        if session is not None:
            session.destroy()
