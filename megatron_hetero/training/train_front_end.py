"""`megatron-hetero train`'s front end of the one training loop (`training/loop.py`): each step's
record (whole-model and per-module grad norms over the world, learning rate, memory, throughput),
its iteration lines, its held-out evaluation and its checkpoint (`TrainFrontEnd`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.loss_scale import loss_scale_of
from megatron_hetero.config.job import JobConfig
from megatron_hetero.training.run_stats import RunStats
from megatron_hetero.compat.device import get_device
from megatron_hetero.runtime.step import run_collective


def module_stats(plan: RankPlan, states: dict) -> tuple[Optional[float], dict[str, float], Optional[float]]:
    """(whole-model grad norm, per-module grad norms, learning rate) of the last step, the same on
    every rank: one all-reduce of each module's squared norm and rate, contributed by one rank of
    the module (TP 0, DP·CP 0, last pipeline stage: the one stage sure to hold an optimizer)."""
    import torch

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
