"""Megatron-LM's log lines for a layout run: the training line of `training_log` and the validation
block of `evaluate_and_print_results`, with the numbers the project's schedules produce.

Evaluation reads what Megatron's own loop reads: at iteration N (every `--eval-interval`) the next
`--eval-iters` global batches of the validation dataset (sequentially, continuing where the last
evaluation stopped), after training once more the next ones ("on validation set") and the first
`--eval-iters` batches of the test dataset ("on test set"). The loss is Megatron's: the sum of the
per-token losses over all those batches divided by their loss-token count; each batch runs through
the schedule with `train=False` (no gradient reduction, no optimizer step) with the models in eval
mode (no dropout).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import torch.distributed as dist


class IntervalLog:
    """Megatron's `training_log` accumulation: losses are averaged over the iterations since the last
    printed line; the first iteration of a run is printed without resetting the accumulators (so the
    next line averages from it too, as upstream does)."""

    def __init__(self, args) -> None:
        self.args, self.first = args, True
        self.loss_sum, self.iters, self.ms = 0.0, 0, 0.0

    def add(self, iteration: int, loss: float, ms: float, lr: float, grad_norm: Optional[float] = None) -> None:
        self.loss_sum += loss
        self.iters += 1
        self.ms += ms
        if iteration % self.args.log_interval == 0 or self.first:
            avg = self.loss_sum / max(1, self.iters)
            print_last(log_line(iteration, self.args, self.ms / max(1, self.iters), lr, avg, grad_norm))
            if not self.first:
                self.loss_sum, self.iters, self.ms = 0.0, 0, 0.0
        self.first = False


def log_line(iteration: int, args, ms: float, lr: float, loss: float, grad_norm: Optional[float] = None) -> str:
    """Megatron's `training_log` line (the fields this loop has; `grad_norm`: the whole model's norm of
    the iteration, before clipping, as Megatron prints it)."""
    ts = time.strftime("%Y-%m-%d %H:%M:%S")
    s = f" [{ts}] iteration {iteration:8d}/{args.train_iters:8d} |"
    s += f" consumed samples: {iteration * args.global_batch_size:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" learning rate: {lr:.6E} |"
    s += f" global batch size: {args.global_batch_size:5d} |"
    s += f" lm loss: {loss:.6E} |"
    s += " loss scale: 1.0 |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    s += " number of skipped iterations:   0 |"
    s += f" number of nan iterations: {0 if math.isfinite(loss) else 1:3d} |"
    return s


def print_last(msg: str) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)


class Evaluator:
    """Megatron's evaluation schedule (see the module docstring) over a runner with `set_split`."""

    def __init__(self, schedule: Any, runner: Any, states: dict, args: Any, start_iteration: int) -> None:
        self.schedule, self.runner, self.states, self.args = schedule, runner, states, args
        self.enabled = bool(args.eval_iters) and args.eval_iters > 0
        interval = args.eval_interval or 0
        # where the validation reader stands when resuming (Megatron's consumed_valid_samples)
        self.next_valid = (start_iteration // interval) * args.eval_iters if interval else 0

    def after_iteration(self, iteration: int) -> None:
        a = self.args
        if self.enabled and a.eval_interval and iteration % a.eval_interval == 0 and self.runner.has_split("valid"):
            self._print(f"iteration {iteration}", self._loss("valid", self.next_valid))
            self.next_valid += a.eval_iters

    def after_training(self, iteration: int) -> None:
        if not self.enabled:
            return
        if self.runner.has_split("valid"):
            self._print(f"iteration {iteration} on validation set", self._loss("valid", self.next_valid))
            self.next_valid += self.args.eval_iters
        if self.runner.has_split("test"):
            self._print(f"iteration {iteration} on test set", self._loss("test", 0))

    def _loss(self, split: str, first_batch: int) -> float:
        modules = [s.module for s in self.states.values()]
        for m in modules:
            m.eval()
        self.runner.set_split(split)
        try:
            total, tokens = 0.0, 0
            for b in range(first_batch, first_batch + self.args.eval_iters):
                res = self.schedule.step(b, train=False)
                n = self.runner.loss_tokens(b)
                total += res.loss * n
                tokens += n
        finally:
            self.runner.set_split("train")
            for m in modules:
                m.train()
        return total / max(1, tokens)

    @staticmethod
    def _print(prefix: str, loss: float) -> None:
        s = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {math.exp(min(20, loss)):.6E} | "
        print_last("-" * (len(s) + 1))
        print_last(s)
        print_last("-" * (len(s) + 1))
