"""What both schedules share at the end of a step: the result type, the global loss, and the
labelling of a failed collective."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.compat.device import get_device


@dataclass
class StepResult:
    loss: float
    memory: dict[str, dict[str, int]]  # phase -> module -> resident state bytes on this rank
    loss_parts: dict[str, float] | None = None  # loss per loss module, when there are several
    aux_loss: float | None = None  # auxiliary terms in the gradient but not in `loss` (MoE load balancing)
    # the whole model's optimizer step (`runtime.optimizer_step`): the global gradient norm before
    # clipping (None: evaluation, or no module trains) and whether non-finite gradients skipped it
    grad_norm: float | None = None
    skipped: bool = False
    # the step's global batch held no loss token (every loss mask 0): `loss` is NaN, the gradients of
    # its loss are 0 (`loss_normaliser`), the optimizer steps as on any other step
    no_loss_tokens: bool = False


class CollectiveError(RuntimeError):
    """A collective of the step failed (a peer died or timed out); names the group and this rank."""


def run_collective(what: str, rank: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)`; a failure is re-raised as CollectiveError naming `what` (the group and its ranks)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a peer died or timed out: say where
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        raise CollectiveError(f"{what}: rank {rank} failed: {type(exc).__name__}: {first}") from exc


def optimizer_what(state) -> str:
    """How a failed optimizer step of `state` (a ModuleState) is named: its gradient-norm all-reduce
    runs over the module's model-parallel group, the distributed optimizer's gathers over DP x CP."""
    pgs = state.pgs
    return (
        f"module {state.name}: optimizer step (collectives over its DP x CP group, ranks "
        f"{dist.get_process_group_ranks(pgs.dp_cp)}, and its model-parallel group, ranks "
        f"{dist.get_process_group_ranks(pgs.mp)})"
    )


def loss_normaliser(loss_tokens: int) -> int:
    """What a step's loss sums are divided by: its loss tokens, or 1 for a step that has none (its
    loss sums are 0, so its gradients are 0). Megatron-core's `finalize_model_grads` clamps its
    per-token divisor the same way (`torch.clamp(num_tokens, min=1)`)."""
    return max(int(loss_tokens), 1)


def global_loss(loss_sums: Iterable[torch.Tensor], counts: bool, loss_tokens: int, rank: int) -> float:
    """The step's per-token loss: the sum over ranks of this rank's `loss_sums` (only if `counts`:
    last-stage ranks with TP rank 0, since TP replicas hold the same per-token losses while DP and
    CP ranks hold different tokens), over the world, divided by `loss_tokens` (NaN when 0: no token
    to average over)."""
    total = torch.zeros(1, dtype=torch.float64, device=get_device())
    if counts:
        for s in loss_sums:
            total += s.detach().to(total)
    run_collective("loss all-reduce over the world", rank, dist.all_reduce, total)
    return float(total.item()) / (loss_tokens if loss_tokens else math.nan)


def global_loss_parts(
    loss_modules: tuple[str, ...],
    sums: dict[str, list[torch.Tensor]],
    counted: set[str],
    extras: dict[str, torch.Tensor],
    loss_tokens: int,
    rank: int,
) -> tuple[float, Optional[dict[str, float]], Optional[float]]:
    """`global_loss` for several loss modules at once, plus the runner's auxiliary terms, in one
    all-reduce over the world: returns (total loss, loss per module when there are several, the sum of
    the `extras` or None). `counted`: the modules whose loss sums this rank contributes (their last
    stage, TP rank 0); `extras` are already normalised shares of this rank (every rank lists the same
    names). A step without loss tokens (`loss_tokens` 0) has NaN losses (no token to average over)."""
    names = sorted(extras)
    vec = torch.zeros(len(loss_modules) + len(names), dtype=torch.float64, device=get_device())
    for i, m in enumerate(loss_modules):
        if m in counted:
            for s in sums.get(m, []):
                vec[i] += s.detach().to(vec)
    for j, n in enumerate(names):
        vec[len(loss_modules) + j] += extras[n].detach().to(vec)
    run_collective("loss all-reduce over the world", rank, dist.all_reduce, vec)
    vals = vec.tolist()
    n = loss_tokens if loss_tokens else math.nan  # no loss token: NaN, not a division by 0
    parts = {m: vals[i] / n for i, m in enumerate(loss_modules)}
    total = sum(vals[: len(loss_modules)]) / n
    aux = sum(vals[len(loss_modules) :]) if names else None
    return total, (parts if len(loss_modules) > 1 else None), aux


def resident_memory(states: dict) -> dict[str, int]:
    return {n: s.resident_bytes() for n, s in states.items()}
