"""The training loop of one rank, for colocated and disjoint layouts alike."""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hetero.compat import ensure_global_memory_buffer, require_compat, set_local_device
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.plan.rank_plan import RankPlan, rank_plan
from megatron_hetero.runtime.loss_scale import loss_scale_of
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.runtime.schedules import schedule_for
from megatron_hetero.runtime.trace import gather_trace
from megatron_hetero.training.run_stats import RunStats
from megatron_hetero.training.setup import JobConfig, build_states
from megatron_hetero.training.signals import ExitSignal


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
    return schedule_for(plan, job.runtime_config(plan.rank), topo, states, runner)


def module_stats(plan: RankPlan, states: dict) -> tuple[Optional[float], dict[str, float], Optional[float]]:
    """(whole-model grad norm, per-module grad norms, learning rate) of the last step, the same on
    every rank: one all-reduce of each module's squared norm and rate, contributed by one rank of
    the module (TP 0, DP·CP 0, last pipeline stage: the one stage sure to hold an optimizer)."""
    import torch

    from megatron_hetero.compat.device import get_device
    from megatron_hetero.runtime.step import run_collective

    names, rank = plan.layout.names, plan.rank
    vec = torch.zeros(3 * len(names), dtype=torch.float64, device=get_device())
    for i, n in enumerate(names):
        s = states.get(n)
        if s is None or s.last_grad_norm is None:
            continue
        if s.pgs.tp.rank() == 0 and s.pgs.dp_cp.rank() == 0 and s.pgs.pp.rank() == s.pgs.pp.size() - 1:
            vec[i] = s.last_grad_norm**2
            vec[len(names) + i] = s.last_lr if s.last_lr is not None else 0.0
            vec[2 * len(names) + i] = 1.0
    run_collective("grad-norm all-reduce over the world", rank, dist.all_reduce, vec)
    k = len(names)
    have = [i for i in range(k) if vec[2 * k + i] > 0]
    per_module = {names[i]: math.sqrt(float(vec[i])) for i in have}
    total = math.sqrt(sum(float(vec[i]) for i in have)) if have else None
    lr = float(vec[k + have[0]]) if have else None
    return total, per_module, lr


def evaluate(schedule, iters: int, rank: int) -> dict[str, Any]:
    """Held-out evaluation: `iters` steps of the schedule with train=False over the runner's held-out
    samples (step k reads held-out samples [k*G, (k+1)*G)), then the runner's training data again.
    Returns the token-weighted held-out loss (`eval_loss`, per caption token, as the training loss)
    and, when the runner counts greedy captions (caption data), `eval_accuracy`: correct digit
    captions over held-out samples, summed over the world (the runner counts only on the ranks that
    count the loss). Collective: every rank calls it at the same iterations."""
    import torch

    from megatron_hetero.compat.device import get_device
    from megatron_hetero.runtime.step import run_collective

    runner = schedule.runner
    runner.set_eval(True)
    try:
        loss_sum = tokens = 0.0
        for k in range(iters):
            res = schedule.step(k, train=False)
            n = runner.loss_tokens(k)
            if n:  # a step without loss tokens has a NaN loss and weighs nothing
                loss_sum += res.loss * n
                tokens += n
        counts = runner.take_eval_counts()
        parts = runner.take_eval_parts()
    finally:
        runner.set_eval(False)
    out: dict[str, Any] = {"eval_loss": loss_sum / tokens if tokens else float("nan"), "eval_accuracy": None}
    if counts is not None:
        vec = torch.tensor(counts, dtype=torch.float64, device=get_device())
        run_collective("caption-accuracy all-reduce over the world", rank, dist.all_reduce, vec)
        hits, samples = vec.tolist()
        out["eval_accuracy"] = hits / samples if samples else None
        out["eval_samples"] = int(samples)
        out["eval_accuracy_name"], out["eval_counted"] = runner.accuracy_name
    if parts:  # per-part accuracy (spoken digits: the digit shown, the digit said); the same names on every rank
        names = sorted(parts)
        vec = torch.tensor([x for n in names for x in parts[n]], dtype=torch.float64, device=get_device())
        run_collective("per-part accuracy all-reduce over the world", rank, dist.all_reduce, vec)
        got = vec.tolist()
        out["eval_parts"] = {
            n: {"accuracy": got[2 * k] / got[2 * k + 1] if got[2 * k + 1] else None, "answers": int(got[2 * k + 1])}
            for k, n in enumerate(names)
        }
    return out


def eval_iters_of(job: JobConfig, runner) -> int:
    """--eval-iters, or one pass over the held-out split without repeats (caption data: N // G
    steps, at least 1), or 1 (synthetic data)."""
    if job.eval_iters:
        return job.eval_iters
    held = runner.heldout_size()
    return 1 if held is None else max(1, held // job.global_batch_size)


def validation_line(iteration: int, ev: dict[str, Any]) -> str:
    text = f" validation loss at iteration {iteration} | lm loss {ev['eval_loss']:.6f} |"
    if ev.get("eval_accuracy") is not None:
        name, counted = ev.get("eval_accuracy_name", "caption accuracy"), ev.get("eval_counted", "held-out samples")
        text += f" {name} {ev['eval_accuracy']:.4f} | {counted}: {ev['eval_samples']} |"
    for part, got in (ev.get("eval_parts") or {}).items():
        if got["accuracy"] is not None:
            text += f" {part} {got['accuracy']:.4f} ({got['answers']}) |"
    return text


class TrainFrontEnd:
    """`megatron-hetero train`'s part of the one training loop (`training/loop.py`): its records
    (whole-model and per-module grad norms, learning rate, memory, tokens per second, optimizer
    state bytes), its iteration lines (`training/iteration_log.py`), its held-out evaluation
    (`evaluate`, every --eval-interval and after the last iteration) and its checkpoint (`save`)."""

    def __init__(
        self,
        job: JobConfig,
        plan: RankPlan,
        states: dict,
        schedule,
        log,
        save: Callable[[int], Any],
        step_hook: Optional[Callable[[int], Any]] = None,
        stats: Optional[RunStats] = None,
    ) -> None:
        """`stats`: the --log-throughput / --log-memory / writers' figures of each record (None: none)."""
        self.job, self.plan, self.states, self.schedule, self.log_ = job, plan, states, schedule, log
        self.save_fn, self.step_hook, self.stats = save, step_hook, stats
        self.tokens = job.global_batch_size * job.spec.seq_length

    def record(self, iteration: int, res, seconds: float) -> dict[str, Any]:
        job, states = self.job, self.states
        grad_norm, per_module, lr = module_stats(self.plan, states)
        rec = {
            "iteration": iteration,
            "loss": res.loss,
            "step_time_s": seconds,
            "memory": res.memory,
            "consumed_samples": iteration * job.global_batch_size,
            "lr": lr,
            "grad_norm": grad_norm,
            "grad_norm_per_module": per_module,
            "tokens": self.tokens,
            "loss_parts": res.loss_parts,
            "aux_loss": getattr(res, "aux_loss", None),
            "tokens_per_s": self.tokens / seconds if seconds > 0 else 0.0,
            # non-finite gradients somewhere: no module stepped (runtime.optimizer_step)
            "skipped": res.skipped,
            # the global batch held no loss token: `loss` is NaN, its gradients 0 (runtime.step)
            "no_loss_tokens": res.no_loss_tokens,
            # --fp16: the whole model's loss scale after the step (the next step's; None otherwise)
            "loss_scale": loss_scale_of(states) if job.optim.fp16 else None,
            # this rank's optimizer state by module (ModuleState.optimizer_state_bytes)
            "optimizer_state_bytes": {n: s.optimizer_state_bytes() for n, s in states.items()},
        }
        if self.stats is not None:  # collective when active (training/run_stats.py)
            rec.update(self.stats.fields(seconds))
        if self.step_hook is not None:  # e.g. bench soak's resource probe; its value travels in the record
            rec["probe"] = self.step_hook(iteration)
        return rec

    def log(self, rec: dict[str, Any]) -> None:
        self.log_.record(rec)

    def evaluate(self, iteration: int, rec: dict[str, Any]) -> None:
        job = self.job
        if not job.eval_interval or (iteration % job.eval_interval and iteration != job.train_iters):
            return
        rec.update(evaluate(self.schedule, eval_iters_of(job, self.schedule.runner), self.plan.rank))
        log = self.log_
        if log.write is not None:
            prefix = "\r\033[K" if log.bar_shown else ""
            log.bar_shown = False
            log.write(prefix + validation_line(iteration, rec) + "\n")

    def save(self, iteration: int) -> None:
        self.save_fn(iteration)

    def finish(self, iteration: int) -> None:
        """Nothing more: the last iteration's evaluation ran in `evaluate`."""


class Session:
    """Everything one rank trains with under one layout: its topology (process groups), plan, module
    states, learning-rate schedulers, schedule and front end, and the iteration it starts at (0, or
    the checkpoint's under `job.load`). `tracer`: a recording tracer for the schedule instead of the
    job's (`--hetero-autotune`'s windows). `checked`: the rank plans' arithmetic for this layout and
    batch when this process validated it (`training.config.Job.checked`; else computed here).
    `destroy()` destroys the topology's groups. Collective: every rank builds its session together."""

    def __init__(
        self,
        layout: HeteroLayout,
        job: JobConfig,
        log,
        step_hook: Optional[Callable[[int], Any]] = None,
        tracer=None,
        checked: Optional[tuple] = None,
    ) -> None:
        import dataclasses

        from megatron_hetero.checkpoint.save_load import load_checkpoint, save_checkpoint
        from megatron_hetero.training.lr_schedule import build_scheduler
        from megatron_hetero.training.memory_log import ActivationMeter

        self.layout, self.job = layout, job
        self.topo = topo = Topology.build(layout, timeout_s=job.comm_timeout_s)
        try:
            plan = rank_plan(
                layout, topo.rank, job.global_batch_size, job.micro_batch_size, job.offload_encoder, checked=checked
            )
            self.plan = plan
            self.states = states = build_states(plan, job, topo)
            self.schedulers = schedulers = {
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
            self.start = 0
            if job.load:
                self.start = load_checkpoint(job.load, layout, job, topo, states, schedulers)
            runner = None
            if job.data is not None:
                from megatron_hetero.models.job_data import runner_factory  # captions or conversations

                runner = runner_factory(job.data, job.spec, job.global_batch_size, heldout=bool(job.eval_interval))(
                    plan, states
                )
            runner = runner if runner is not None else LlavaStageRunner(job.spec, plan, states)
            config = job.runtime_config(plan.rank)
            if tracer is not None:
                config = dataclasses.replace(config, tracer=tracer)
            self.schedule = schedule_for(plan, config, topo, states, runner)
            self.meter = None
            if job.log_memory:  # activation peaks of every training step (training/memory_log.py)
                self.meter = ActivationMeter()
                for n, s in states.items():
                    self.meter.attach(n, s.module)
            stats = RunStats(job, plan, states, self.meter, writers=bool(job.tensorboard_dir or job.wandb_project))
            self.front = TrainFrontEnd(
                job,
                plan,
                states,
                self.schedule,
                log,
                save=lambda it: save_checkpoint(job.save, it, layout, job, topo, states, schedulers),
                step_hook=step_hook,
                stats=stats,
            )
        except BaseException:
            topo.destroy()
            raise

    def loop_schedule(self):
        """The schedule `run_loop` steps (metered with --log-memory)."""
        from megatron_hetero.training.run_stats import MeteredSchedule

        return MeteredSchedule(self.schedule, self.meter) if self.meter is not None else self.schedule

    def loop_spec(self, start: int, end: int, final_save: bool = True):
        """The `LoopSpec` of iterations [start, end) with the job's checkpoints."""
        from megatron_hetero.training.loop import LoopSpec

        return LoopSpec(
            start=start,
            train_iters=end,
            scheduler_increment=1,  # train's schedulers count iterations (training/lr_schedule.py)
            save=self.job.save,
            save_interval=self.job.save_interval,
            rank=self.topo.rank,
            final_save=final_save,
        )

    def finish(self) -> None:
        """After the last step: --overlap-param-gather's gathered parameters, and the job's --trace
        (collective; rank 0 writes it)."""
        for s in self.states.values():
            s.gather_params()
        layout = self.layout
        gather_trace(
            self.schedule.config.tracer,
            {
                "placement": layout.placement,
                "layout": {m.name: f"{m.short()} @{m.ranks}" for m in layout.modules},
            },
        )

    def params(self) -> dict[str, Any]:
        """This rank's parameters by module and its coordinates (parity tests)."""
        return {
            "params": {
                n: {k: p.detach().cpu().clone() for k, p in s.module.named_parameters()} for n, s in self.states.items()
            },
            "coords": {n: self.topo.coord(n).as_dict() for n in self.states},
        }

    def destroy(self) -> None:
        self.topo.destroy()


def train_rank(
    layout: HeteroLayout,
    job: JobConfig,
    collect_params: bool = False,
    log_write: Optional[Callable[[str], None]] = None,
    step_hook: Optional[Callable[[int], Any]] = None,
    checked: Optional[tuple] = None,
) -> dict[str, Any]:
    """Run iterations [start, job.train_iters) on this rank (start: 0, or the iteration of the
    checkpoint under job.load); returns per-step records (loss is global, the same on every rank)
    and, if asked, this rank's parameters by module (for parity tests). Saves a checkpoint every
    job.save_interval iterations and after the last one when job.save is set. Global rank 0 writes
    iteration lines through `log_write` (job.log_interval, job.progress). `step_hook(iteration)` runs
    after every step on every rank; its return value is the record's `probe`. With
    job.exit_signal_handler, SIGTERM stops every rank after the same step (training/signals.py).
    With job.autotune (`--hetero-autotune`) the run may move to another layout on the way
    (`training/autotune_run.py`); the records and parameters are those of the layout it ends on.
    `checked`: the rank plans' arithmetic when this process validated the job (`training.job`'s
    `run_local` / `run_as_rank` pass their `Job`'s), so the rank's plan is computed once."""
    from megatron_hetero.training.iteration_log import IterationLog
    from megatron_hetero.training.loop import run_loop
    from megatron_hetero.training.writers import open_writers

    prepare_rank(job)
    stop = ExitSignal(job.exit_signal_handler).install()  # SIGTERM sets a flag (signals.py)
    writers = None
    session: Optional[Session] = None
    try:
        rank = dist.get_rank()
        writers = open_writers(job, rank, layout.world_size)  # the last rank's TensorBoard / W&B
        log = IterationLog(
            log_write if rank == 0 else None,
            job.train_iters,
            job.global_batch_size,
            job.log_interval,
            job.progress,
        )
        if job.autotune is not None:
            from megatron_hetero.training.autotune_run import train_autotuned

            session, records = train_autotuned(layout, job, log, stop, writers, Session, step_hook)
        else:
            session = Session(layout, job, log, step_hook, checked=checked)
            outcome = run_loop(
                session.loop_schedule(),
                session.schedulers,
                session.loop_spec(session.start, job.train_iters),
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
