"""What both schedules share at the end of a step: the result type, the global loss, and the
labelling of a failed collective."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from megatron_hetero.compat.device import get_device


@dataclass
class StepResult:
    loss: float
    memory: dict[str, dict[str, int]]  # phase -> module -> resident state bytes on this rank
    loss_parts: dict[str, float] | None = None  # loss per loss module, when there are several


class CollectiveError(RuntimeError):
    """A collective of the step failed (a peer died or timed out); names the group and this rank."""


def run_collective(what: str, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)`; a failure is re-raised as CollectiveError naming `what` (the group and its ranks)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a peer died or timed out: say where
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise CollectiveError(f"{what}: rank {rank} failed: {type(exc).__name__}: {first}") from exc


def global_loss(loss_sums: Iterable[torch.Tensor], counts: bool, loss_tokens: int, rank: int) -> float:
    """The step's per-token loss: the sum over ranks of this rank's `loss_sums` (only if `counts`:
    last-stage ranks with TP rank 0, since TP replicas hold the same per-token losses while DP and
    CP ranks hold different tokens), over the world, divided by `loss_tokens`."""
    total = torch.zeros(1, dtype=torch.float64, device=get_device())
    if counts:
        for s in loss_sums:
            total += s.detach().to(total)
    run_collective("loss all-reduce over the world", rank, dist.all_reduce, total)
    return float(total.item()) / loss_tokens


def resident_memory(states: dict) -> dict[str, int]:
    return {n: s.resident_bytes() for n, s in states.items()}
