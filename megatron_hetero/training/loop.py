"""The training loop both front ends run: `megatron-hetero train` (`training/trainer.py`) and the
patched Megatron-LM scripts (`megatron_lm/driver.py`).

Both build their modules (`ModuleState`: Megatron DDP and a Megatron optimizer per module), one
Megatron `OptimizerParamScheduler` per module optimizer and the schedule of the layout's placement
(`runtime.schedules.schedule_for`: the colocated three-phase or the disjoint graph-1F1B schedule,
whose step ends in the whole-model optimizer step of `runtime.optimizer_step`: one gradient norm over
every module, one clip coefficient, non-finite gradients skipping the step on every module). Then
`run_loop` runs iterations [start, train_iters) in Megatron-LM's order:

  1. a barrier over the world (every rank starts the iteration together: step times are comparable);
  2. the schedule's step (forward, backward, gradient reduction, optimizer step);
  3. every learning-rate scheduler steps by `scheduler_increment`, unless the step was skipped
     (Megatron-LM's `train_step` steps it only after a successful update);
  4. the front end's record of the iteration (its statistics: loss, grad norm, learning rate, ...),
     then its log line;
  5. the front end's evaluation (at its `--eval-interval`; it may add to the record), then the
     record to the writers (`training/writers.py`: TensorBoard, W&B; None: none, the scripts' case);
  6. a checkpoint every `save_interval` iterations (with `save`);
  7. with `--exit-signal-handler`: the world agrees whether some rank got SIGTERM
     (`training/signals.py`); if so, a checkpoint of this iteration (with `save`, unless just
     saved), the stop line, and the loop ends before `train_iters`.
After the last iteration: a checkpoint of it (with `save`, unless just saved) and the front end's
`finish` (the scripts' final evaluation on the validation and test sets).

What the front ends differ in is only their `FrontEnd`: how a record is made and printed (train's
line vs Megatron-LM's `training_log` line), how evaluation reads held-out data, and how a
checkpoint is written (train: `checkpoint/save_load.py`, the layout-independent torch_dist
checkpoint; the scripts: Megatron's own `save_checkpoint` through the reference model).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch.distributed as dist

from megatron_hetero.runtime.schedules import Schedule
from megatron_hetero.runtime.step import StepResult, run_collective
from megatron_hetero.training.signals import ExitSignal, finish_on_signal


class FrontEnd(Protocol):
    """What a front end supplies to `run_loop` (all called on every rank, in the loop's order)."""

    def record(self, iteration: int, res: StepResult, seconds: float) -> dict[str, Any]:
        """The record of iteration `iteration` (1-based) that took `seconds`; may run collectives."""
        ...

    def log(self, rec: dict[str, Any]) -> None:
        """Print the iteration's line (on the front end's printing rank)."""
        ...

    def evaluate(self, iteration: int, rec: dict[str, Any]) -> None:
        """Held-out evaluation after `iteration` if due (collective); may add to `rec`."""
        ...

    def save(self, iteration: int) -> None:
        """Write the checkpoint of `iteration` (collective; only called with `LoopSpec.save`)."""
        ...

    def finish(self, iteration: int) -> None:
        """After the last iteration (not after a stop on the exit signal)."""
        ...


class RecordWriter(Protocol):
    """Where the records go besides the lines (`training.writers.LogWriters`)."""

    def write(self, rec: dict[str, Any]) -> None:
        """Write iteration `rec["iteration"]`'s figures."""
        ...


@dataclass(frozen=True)
class LoopSpec:
    """The loop's numbers: iterations [start, train_iters); `scheduler_increment` per iteration
    (train's schedulers count iterations: 1; Megatron-LM's count samples: the global batch size);
    `save`: the checkpoint directory (None: nothing is saved), every `save_interval` iterations
    (None or 0: only at the end); `rank`: this rank's global rank (failure messages, the stop line);
    `final_save`: the checkpoint after the last iteration (False: a part of a run that goes on:
    `--hetero-autotune`'s measuring windows)."""

    start: int
    train_iters: int
    scheduler_increment: int
    save: Optional[str]
    save_interval: Optional[int]
    rank: int
    final_save: bool = True


@dataclass
class LoopOutcome:
    """`records`: one per iteration run; `stopped`: the iteration the run stopped after on the exit
    signal (None: it ran to `train_iters`)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    stopped: Optional[int] = None


def run_loop(
    schedule: Schedule,
    schedulers: dict,
    spec: LoopSpec,
    front: FrontEnd,
    stop: ExitSignal,
    write: Optional[Callable[[str], None]] = None,
    writers: Optional[RecordWriter] = None,
) -> LoopOutcome:
    """Iterations [spec.start, spec.train_iters) (see the module docstring); `write`: where rank 0's
    stop line goes (None: stdout); `writers`: what each iteration's record goes to after its
    evaluation (on the ranks that write: the caller opens and closes it). Collective over the world."""
    out = LoopOutcome()
    last_saved: Optional[int] = spec.start if spec.start else None
    for it in range(spec.start, spec.train_iters):
        run_collective("start-of-iteration barrier over the world", spec.rank, dist.barrier)
        t0 = time.perf_counter()
        res = schedule.step(it)
        if not res.skipped:  # as Megatron-LM: a skipped step keeps the rate
            for sched in schedulers.values():
                sched.step(increment=spec.scheduler_increment)
        rec = front.record(it + 1, res, time.perf_counter() - t0)
        out.records.append(rec)
        front.log(rec)
        front.evaluate(it + 1, rec)
        if writers is not None:
            writers.write(rec)
        if spec.save and spec.save_interval and (it + 1) % spec.save_interval == 0:
            front.save(it + 1)
            last_saved = it + 1
        # --exit-signal-handler: some rank got SIGTERM, every rank stops here (after the last step: just ends)
        if it + 1 < spec.train_iters and stop.agreed(spec.rank):
            out.stopped = it + 1
            if spec.save and last_saved != out.stopped:
                front.save(out.stopped)
            finish_on_signal(stop, out.stopped, spec.save, spec.rank, write)
            return out
    if spec.save and spec.final_save and spec.train_iters > spec.start and last_saved != spec.train_iters:
        front.save(spec.train_iters)
    front.finish(spec.train_iters)
    return out
