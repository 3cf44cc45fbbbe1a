"""One optimizer step for the whole model, as one Megatron optimizer over every module would take it.

A homogeneous Megatron run has one optimizer (a `ChainedOptimizer` when it holds several): it prepares
the gradients of all of them, agrees on non-finite gradients, computes ONE gradient norm over every
parameter of the model, clips every parameter by that norm, and steps. Here every module has its own
Megatron optimizer on its own groups, and the modules may live on different ranks (disjoint islands),
so the step is spread over the world:

1. every rank prepares the gradients of the modules it serves (`prepare_grads`: the main gradients,
   unscaling and the non-finite check of mixed precision) and computes each module's gradient norm
   (`get_grad_norm`: over the module's own gradient-statistics group, so every rank of the module
   holds the module's whole norm: TP x PP for Megatron's non-distributed optimizer, whose DP replicas
   hold the same reduced gradients; the module's whole rank set, TP x CP x DP x PP, for the
   distributed one, whose DP x CP ranks each hold a disjoint shard of them: `pgs.intra_dist_opt`);
2. ONE all-reduce (sum) over the world of `[non-finite count, squared norm of each module]`, each
   module's squared norm contributed by one rank of it (TP 0, DP x CP 0, its last pipeline stage: the
   one stage sure to hold an optimizer); the global norm is the square root of the sum, the same on
   every rank, whatever the layout;
3. under --fp16 every rank updates its one loss scaler (`runtime.loss_scale`) with that agreed
   non-finite flag (the modules' optimizers unscaled their gradients by it, but their own update from
   their module's flag alone is a no-op), so every rank's scale stays the same: a skip halves it (after
   --hysteresis such steps) on every rank, --loss-scale-window clean steps double it everywhere;
4. if any rank found non-finite gradients, no module steps (the step is skipped everywhere);
   otherwise, with `--clip-grad C > 0`, every module's gradients are scaled by min(1, C / (norm +
   1e-6)) (Megatron's `clip_grad_by_total_norm_fp32` with the global norm), and every optimizer steps
   (`step_with_ready_grads`).

Over the wire: step 2's all-reduce (1 + number of modules float64 values), besides the collectives
`prepare_grads` / `get_grad_norm` run inside each module's own groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.optimizer import clip_grads

from megatron_hetero.compat.device import get_device
from megatron_hetero.runtime.loss_scale import rank_loss_scaler
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.step import optimizer_what, run_collective


@dataclass(frozen=True)
class ModelStep:
    """What the whole-model step did: `grad_norm` (the global norm before clipping; None when no
    module trains), `module_norms` (each trained module's own norm), `skipped` (non-finite gradients
    somewhere: no module stepped), `clip_coeff` (the factor every gradient was scaled by; 1.0 when
    not clipped)."""

    grad_norm: Optional[float]
    module_norms: dict[str, float]
    skipped: bool
    clip_coeff: float


def _contributes(s: ModuleState) -> bool:
    pgs = s.pgs
    return pgs.tp.rank() == 0 and pgs.dp_cp.rank() == 0 and pgs.pp.rank() == pgs.pp.size() - 1


def _parameter_lists(optimizer) -> list[list[torch.nn.Parameter]]:
    """The parameters of each Megatron optimizer inside `optimizer` (one for a plain one)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.get_parameters() for o in inner if not getattr(o, "is_stub_optimizer", False)]


def step_modules(states: dict[str, ModuleState], names: Sequence[str], rank: int) -> ModelStep:
    """The whole-model optimizer step on this rank (see the module docstring). `states`: the modules
    this rank serves, `names`: every module of the layout (the same order on every rank), `rank`:
    this rank's global rank (for failure messages). `--clip-grad` is each optimizer's `clip_grad` (one
    value for the whole job). Collective over the world."""
    trained = [s for s in states.values() if s.optimizer is not None]
    found = False
    norms: dict[str, float] = {}
    for s in trained:
        s.last_lr = s.current_lr()

        def prepare(s=s) -> None:
            nonlocal found
            found |= bool(s.optimizer.prepare_grads())
            norms[s.name] = float(s.optimizer.get_grad_norm())

        run_collective(optimizer_what(s), rank, prepare)
    vec = torch.zeros(1 + len(names), dtype=torch.float64, device=get_device())
    vec[0] = float(found)
    for s in trained:
        if _contributes(s):
            vec[1 + names.index(s.name)] = norms[s.name] ** 2
    run_collective("global gradient norm all-reduce over the world", rank, dist.all_reduce, vec)
    for s in trained:
        s.last_grad_norm = norms[s.name]
    scaler = rank_loss_scaler(states)
    if scaler is not None:
        scaler.agree(vec[0].item() > 0)
    if vec[0].item() > 0:
        return ModelStep(None, norms, skipped=True, clip_coeff=0.0)
    total = math.sqrt(float(vec[1:].sum())) if trained or vec[1:].any() else None
    coeff = 1.0
    for s in trained:
        clip_grad = float(s.optimizer.config.clip_grad)
        if clip_grad > 0.0 and total is not None:
            coeff = min(1.0, clip_grad / (total + 1.0e-6))
            for params in _parameter_lists(s.optimizer):
                if params:
                    # looked up when called: compat's CPU redirection replaces the module attribute
                    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=total)
    for s in trained:
        ok = run_collective(optimizer_what(s), rank, s.optimizer.step_with_ready_grads)
        if not ok:
            raise RuntimeError(f"module {s.name}: optimizer step failed after the gradients were checked")
    return ModelStep(total, norms, skipped=False, clip_coeff=coeff)
