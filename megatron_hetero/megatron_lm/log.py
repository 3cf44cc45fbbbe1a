"""Megatron-LM's log lines for a layout run: the training line of `training_log` and the validation
block of `evaluate_and_print_results`, with the numbers the project's schedules produce.

Evaluation reads what Megatron's own loop reads: at iteration N (every `--eval-interval`) the next
`--eval-iters` global batches of the validation dataset (sequentially, continuing where the last
evaluation stopped), after training once more the next ones ("on validation set") and the first
`--eval-iters` batches of the test dataset ("on test set"). The loss is Megatron's: the sum of the
per-token losses over all those batches divided by their loss-token count; each batch runs through
the schedule with `train=False` (no gradient reduction, no optimizer step) with the models in eval
mode (no dropout) and, under --overlap-param-gather, with each module's parameters all-gathered first
and its forward pre-hooks off (`ModuleState.params_gathered`, as Megatron-LM's evaluation).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Optional

import torch.distributed as dist


class IntervalLog:
    """Megatron's `training_log` accumulation: losses are averaged over the iterations since the last
    printed line that updated the model (a skipped iteration's loss is left out, and the line has no
    `lm loss` field until some iteration of the run updated it); the first iteration of a run is
    printed without resetting the accumulators (so the next line averages from it too, as upstream
    does). Skipped iterations (non-finite gradients under --fp16: no module stepped) are counted, and
    so are the skipped ones whose loss was not finite ("nan iterations")."""

    def __init__(self, args) -> None:
        self.args, self.first = args, True
        self.loss_sum: Optional[float] = None  # None: no iteration of the run has updated the model yet
        self.advanced, self.skipped, self.nan, self.ms = 0, 0, 0, 0.0

    def add(
        self,
        iteration: int,
        loss: float,
        ms: float,
        lr: float,
        grad_norm: Optional[float] = None,
        skipped: bool = False,
        loss_scale: float = 1.0,
    ) -> None:
        """One iteration: its loss, time, the learning rate and grad norm it logs, whether non-finite
        gradients skipped its update, and the loss scale after it (1.0 without --fp16)."""
        if skipped:
            self.skipped += 1
            self.nan += int(not math.isfinite(loss))
        else:
            self.advanced += 1
            self.loss_sum = (self.loss_sum or 0.0) + loss
        self.ms += ms
        if iteration % self.args.log_interval == 0 or self.first:
            total = max(1, self.advanced + self.skipped)
            avg = None if self.loss_sum is None else self.loss_sum / max(1, self.advanced)
            line = log_line(
                iteration, self.args, self.ms / total, lr, avg, grad_norm, loss_scale, self.skipped, self.nan
            )
            print_last(line)
            if not self.first:
                self.loss_sum = None if self.loss_sum is None else 0.0
                self.advanced, self.skipped, self.nan, self.ms = 0, 0, 0, 0.0
        self.first = False


def log_line(
    iteration: int,
    args,
    ms: float,
    lr: float,
    loss: Optional[float],
    grad_norm: Optional[float] = None,
    loss_scale: float = 1.0,
    skipped: int = 0,
    nan: int = 0,
) -> str:
    """Megatron's `training_log` line (the fields this loop has; `loss`: None leaves the field out, as
    before any update; `grad_norm`: the whole model's norm of the iteration, before clipping, as
    Megatron prints it, None on a skipped iteration; `loss_scale`: after the step)."""
    ts = time.strftime("%Y-%m-%d %H:%M:%S")
    s = f" [{ts}] iteration {iteration:8d}/{args.train_iters:8d} |"
    s += f" consumed samples: {iteration * args.global_batch_size:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" learning rate: {lr:.6E} |"
    s += f" global batch size: {args.global_batch_size:5d} |"
    if loss is not None and loss >= 0.0:  # as Megatron: not before any update, nor a NaN average
        s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan:3d} |"
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
            with contextlib.ExitStack() as synced:
                for s in self.states.values():  # --overlap-param-gather: the last step's parameters, hooks off
                    synced.enter_context(s.params_gathered())
                for b in range(first_batch, first_batch + self.args.eval_iters):
                    res = self.schedule.step(b, train=False)
                    n = self.runner.loss_tokens(b)
                    if n:  # a batch without loss tokens has a NaN loss and weighs nothing
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
