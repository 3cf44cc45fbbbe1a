"""The patched Megatron-LM scripts' part of the one training loop (`training/loop.py`): Megatron-LM's
log line (`log.IntervalLog`), its evaluation schedule (`log.Evaluator`) and its checkpoint (Megatron's
own `save_checkpoint` through the reference model: `weights.save_reference_checkpoint`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.megatron_lm.log import Evaluator, IntervalLog
from megatron_hetero.runtime.loss_scale import loss_scale_of
from megatron_hetero.compat.device import get_device


class ScriptFrontEnd:
    """Records carry the loss, the step time (ms), the learning rate after the step's scheduler step
    (what Megatron-LM's `training_log` prints) and the whole model's grad norm."""

    def __init__(
        self,
        args: Any,
        states: dict,
        evaluator: Evaluator,
        save: Optional[Callable[[int], None]] = None,
        train_iters: Optional[int] = None,
    ) -> None:
        self.args, self.states, self.evaluator, self.save_fn = args, states, evaluator, save
        #: the run's last iteration: Megatron's after-training evaluation runs there only (a loop that
        #: ends before it, e.g. --hetero-autotune's measuring window, does not evaluate)
        self.train_iters = train_iters
        self.interval_log = IntervalLog(args)

    def record(self, iteration: int, res, seconds: float) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "loss": res.loss,
            "step_time_s": seconds,
            "lr": current_lr(self.states),
            "grad_norm": res.grad_norm,
            "skipped": res.skipped,
        }

    def log(self, rec: dict[str, Any]) -> None:
        self.interval_log.add(
            rec["iteration"],
            rec["loss"],
            rec["step_time_s"] * 1000.0,
            rec["lr"],
            rec["grad_norm"],
            rec["skipped"],
            loss_scale_of(self.states),  # --fp16: the whole model's scale after the step (1.0 otherwise)
        )

    def evaluate(self, iteration: int, rec: dict[str, Any]) -> None:
        self.evaluator.after_iteration(iteration)

    def save(self, iteration: int) -> None:
        if self.save_fn is None:
            raise ValueError("--save is set but the run has no checkpoint writer")
        for s in self.states.values():  # --overlap-param-gather: the checkpoint reads the gathered parameters
            s.gather_params()
        self.save_fn(iteration)

    def finish(self, iteration: int) -> None:
        if self.train_iters is None or iteration >= self.train_iters:
            self.evaluator.after_training(iteration)


def current_lr(states: dict) -> float:
    """The learning rate of the first trained module on this rank after the step's scheduler step;
    the same on every rank after an all-reduce of max (ranks without a trained module report 0)."""

    lr = 0.0
    for s in states.values():
        if s.optimizer is not None:
            lr = float(s.optimizer.param_groups[0]["lr"])
            break
    t = torch.tensor([lr], dtype=torch.float64).to(get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
