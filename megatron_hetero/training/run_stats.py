"""The per-iteration figures behind --log-throughput, --log-memory and the writers
(`training/writers.py`), added to `train`'s records (`TrainFrontEnd.record`).

Once per iteration, only when one of them is on, one all-gather over the world brings every rank's
step time, resident state per module (`memory_log.state_bytes`) and, with --log-memory, activation
peaks (`memory_log.ActivationMeter`) to every rank, so that rank 0's line, the last rank's writers and
the merged --log-jsonl records show the same numbers. The fields:

    iteration_time_s             the slowest rank's step time (the merged records' step_time_s)
    tflops_per_rank              --log-throughput: the whole model's TFLOP/s per rank
    tflops_per_rank_per_module   each module's (`training/throughput.py`)
    state_bytes                  {rank: {module: {params, grads, optimizer}}} (--log-memory, or a writer)
    activation_peak_bytes        --log-memory: {rank: {module: peak bytes of the step}}
    activation_peak_bytes_total  --log-memory: {rank: the rank's peak over its modules at one moment}
    memory_bytes                 --log-memory: {rank: {predicted, measured, predicted_state,
                                 predicted_activation}}: the memory model's state + activation peak
                                 (`planner/memory.py`) beside the measured state + activation peak
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from megatron_hetero.runtime.schedules import Schedule
from megatron_hetero.runtime.step import StepResult, run_collective
from megatron_hetero.training.memory_log import ActivationMeter, state_bytes
from megatron_hetero.training.throughput import module_flops, tflops_per_rank
from megatron_hetero.planner.memory import StateFeatures, predicted_rank_bytes
from megatron_hetero.config.job import job_recompute


class MeteredSchedule:
    """A schedule (`runtime.schedules.Schedule`) whose training steps run inside the meter's
    `measure()` (evaluation steps do not); everything else is the schedule's own."""

    def __init__(self, schedule: Schedule, meter: ActivationMeter) -> None:
        self.schedule, self.meter = schedule, meter

    def step(self, it: int, train: bool = True) -> StepResult:
        if not train:
            return self.schedule.step(it, train=False)
        with self.meter.measure():
            return self.schedule.step(it)

    def close(self) -> None:
        self.schedule.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.schedule, name)


class RunStats:
    """This rank's part of the figures (see the module docstring) of the validated job `validated`
    (`config.job.Job`) on this rank's `plan`; `fields(seconds)` is collective (every rank calls
    it once per iteration) when `active`, and returns {} otherwise."""

    def __init__(
        self, validated: Any, plan: Any, states: dict, meter: Optional[ActivationMeter], writers: bool
    ) -> None:
        job = validated.config
        self.job, self.plan, self.states, self.meter = job, plan, states, meter
        self.layout = plan.layout
        self.flops = module_flops(job.spec, self.layout, job.global_batch_size) if job.log_throughput else None
        self.memory = bool(job.log_memory or writers)
        self.active = bool(job.log_throughput or self.memory)
        self.predicted = predicted_memory(validated) if meter is not None else None

    def _local(self, seconds: float) -> dict[str, Any]:
        mine: dict[str, Any] = {"t": seconds}
        if self.memory:
            mine["state"] = {n: state_bytes(s) for n, s in self.states.items()}
        if self.meter is not None:
            mine["act"] = self.meter.peaks()
            mine["act_total"] = self.meter.total_peak
        return mine

    def fields(self, seconds: float) -> dict[str, Any]:
        if not self.active:
            return {}
        world: list = [None] * self.layout.world_size
        run_collective(
            "logging figures all-gather over the world",
            self.plan.rank,
            dist.all_gather_object,
            world,
            self._local(seconds),
        )
        t = max(w["t"] for w in world)
        out: dict[str, Any] = {"iteration_time_s": t}
        if self.flops is not None:
            out["tflops_per_rank"], out["tflops_per_rank_per_module"] = tflops_per_rank(self.flops, self.layout, t)
        if self.memory:
            out["state_bytes"] = {str(r): w["state"] for r, w in enumerate(world)}
        if self.meter is not None:
            out["activation_peak_bytes"] = {str(r): w["act"] for r, w in enumerate(world)}
            out["activation_peak_bytes_total"] = {str(r): w["act_total"] for r, w in enumerate(world)}
        if self.predicted is not None and self.meter is not None:
            out["memory_bytes"] = {
                str(r): {
                    "predicted": p["state"] + p["activation"],
                    "measured": sum(sum(v.values()) for v in w["state"].values()) + w["act_total"],
                    "predicted_state": p["state"],
                    "predicted_activation": p["activation"],
                }
                for r, (p, w) in enumerate(zip(self.predicted, world))
            }
        return out


def predicted_memory(job: Any) -> list[dict[str, int]]:
    """Per rank, the memory model's (`planner/memory.py`) state and activation-peak bytes of `job`:
    a `config.job.Job` or `JobDraft` (its config on its layout; the memory model needs no
    validation)."""

    layout, config = job.layout, job.config
    o = config.optim
    features = StateFeatures(
        precision="bf16" if o.bf16 else "fp16" if o.fp16 else "fp32",
        optimizer=o.optimizer,
        distributed_optimizer=o.use_distributed_optimizer,
        grad_reduce_in_fp32=o.grad_reduce_in_fp32,
    )
    return [
        predicted_rank_bytes(
            layout,
            config.spec,
            r,
            features,
            config.global_batch_size,
            config.micro_batch_size,
            config.sequence_parallel,
            job_recompute(config),
        )
        for r in range(layout.world_size)
    ]
