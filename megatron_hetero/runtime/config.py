"""The runtime's own settings (not the model's, not the plan's): the waits' timeout, the tracer and the
disjoint schedule's tables (`RuntimeConfig`), and a rank's settings of a job (`runtime_config`). Pure: no
torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_hetero.layout.degrees import DEFAULT_COMM_TIMEOUT_S
from megatron_hetero.config.job import JobConfig
from megatron_hetero.runtime.trace import NULL_TRACER, AnyTracer, recording_tracer


@dataclass(frozen=True)
class RuntimeConfig:
    """`comm_timeout_s`: the longest any collective or point-to-point wait may take before it raises
    an error naming the edge or group and the ranks (`--hetero-comm-timeout`).
    `tracer`: where the schedules record their spans (`runtime.trace`); NULL_TRACER (off) by default.
    `schedule`: the disjoint schedule's tables (`--hetero-schedule`): "1f1b", or "zb" (each backward
    split into its input-gradient and weight-gradient passes, `plan.schedule.zero_bubble_order`)."""

    comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S
    tracer: AnyTracer = field(default=NULL_TRACER, compare=False)
    schedule: str = "1f1b"


def runtime_config(job: JobConfig, rank: int = 0) -> RuntimeConfig:
    """The runtime settings of rank `rank` of `job`: the wait timeout (--hetero-comm-timeout), the disjoint
    schedule's tables (--hetero-schedule) and, with --trace, the rank's recording tracer."""

    return RuntimeConfig(
        comm_timeout_s=job.comm_timeout_s,
        tracer=recording_tracer(rank, job.trace) if job.trace else NULL_TRACER,
        schedule=job.hetero_schedule,
    )
