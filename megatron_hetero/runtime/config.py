"""The runtime's own settings (not the model's, not the plan's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_hetero.layout.degrees import DEFAULT_COMM_TIMEOUT_S
from megatron_hetero.runtime.trace import NULL_TRACER, AnyTracer


@dataclass(frozen=True)
class RuntimeConfig:
    """`comm_timeout_s`: the longest any collective or point-to-point wait may take before it raises
    an error naming the edge or group and the ranks (`--hetero-comm-timeout`).
    `tracer`: where the schedules record their spans (`runtime.trace`); NULL_TRACER (off) by default."""

    comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S
    tracer: AnyTracer = field(default=NULL_TRACER, compare=False)
