"""Per-parameter optimizer state of a Megatron optimizer, plain or distributed (no model knowledge).

Megatron's plain optimizer keeps each parameter's Adam moments in its torch optimizer's `state[p]`.
Its `DistributedOptimizer` keeps, on each rank of its data-parallel group, only that rank's range of
every parameter's flattened moments, reached through Megatron's own per-parameter views
(`_get_model_param_range_map(p)["param"]`: the range; `_get_main_param_and_optimizer_states(p)`: the
shard's tensors). `adam_state` reads a parameter's whole moments from either (for the distributed
one: an all-reduce, sum, of the zero-padded ranges over the optimizer's data-parallel group, exact as
the ranges are disjoint); `set_adam_state` writes them (each rank its range; no communication).

Mixed precision (`--bf16`/`--fp16`): Megatron's optimizer then updates fp32 *main* weights kept apart
from the half-precision model parameters, and keys Adam's state by them. The plain one
(`Float16OptimizerWithFloat16Params`) holds each model parameter's whole main weight
(`fp32_from_float16_groups`, reached through the handle it sets, `param.main_param`), its torch
optimizer's `state[main]` the moments; the distributed one holds each DP rank's range of it (the
`"param"` entry of its per-parameter view). `main_weight` reads a parameter's whole fp32 main weight
(distributed: the same all-reduce as the moments), `set_main_weight` writes it; both say None/False
where the optimizer keeps no separate one (fp32 parameters: the model parameter is the main weight).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (chained or not)."""
    if optimizer is None:
        return []
    outer = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in outer if getattr(o, "optimizer", None) is not None]


MOMENTS = ("exp_avg", "exp_avg_sq")


def _distributed(optimizer) -> list:
    """The Megatron DistributedOptimizers inside `optimizer` (chained or not)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if optimizer is None:
        return []
    outer = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in outer if isinstance(o, DistributedOptimizer)]


def _owning_distopt(optimizer, p: torch.Tensor):
    """The DistributedOptimizer whose buffers hold `p` (on every rank of its DP group, whether or not
    this rank's range covers any of `p`: its `model_param_gbuf_map` holds only the latter)."""
    for o in _distributed(optimizer):
        if any(p in b.param_index_map for b in o.buffers):
            return o
    return None


def _local_range(opt, p: torch.Tensor) -> Optional[tuple[int, int]]:
    """The range of `p.view(-1)` this DP rank's shard of `opt` holds (None: none of it)."""
    try:
        r = opt._get_model_param_range_map(p)["param"]
    except KeyError:
        return None
    return (int(r.start), int(r.end)) if r.end > r.start else None


def _mixed_precision_main(optimizer, p: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 main weight that Megatron's plain mixed-precision optimizer keeps for half-precision
    model parameter `p` (the handle `Float16OptimizerWithFloat16Params` sets, `p.main_param`), or None
    (fp32 `p`, no such optimizer, `p` not trained)."""
    if optimizer is None or p.dtype == torch.float32:
        return None
    outer = getattr(optimizer, "chained_optimizers", [optimizer])
    if not any(hasattr(o, "fp32_from_float16_groups") for o in outer):
        return None
    main = getattr(p, "main_param", None)
    if not isinstance(main, torch.Tensor) or main.dtype != torch.float32 or main.shape != p.shape:
        return None
    return main


def state_key(optimizer, p: torch.Tensor) -> torch.Tensor:
    """The tensor the torch optimizer's state of model parameter `p` is keyed by: its fp32 main weight
    under Megatron's plain mixed-precision optimizer, `p` itself otherwise."""
    main = _mixed_precision_main(optimizer, p)
    return main if main is not None else p


def main_weight(optimizer, p: torch.Tensor) -> Optional[torch.Tensor]:
    """This rank's whole (TP-local) fp32 main weight of half-precision model parameter `p` (see the
    module docstring): the plain optimizer's copy, or with a DistributedOptimizer each DP rank's range
    joined by an all-reduce (sum) over its data-parallel group (a collective there, as `adam_state`).
    None where the optimizer keeps no separate main weight (fp32 `p`; no optimizer)."""
    opt = _owning_distopt(optimizer, p)
    if opt is None:
        main = _mixed_precision_main(optimizer, p)
        return main.detach() if main is not None else None
    if p.dtype == torch.float32:
        return None  # the distributed optimizer's main shard is a view of the fp32 parameter
    rng = _local_range(opt, p)
    flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
    if rng is not None:
        flat[rng[0] : rng[1]] = opt._get_main_param_and_optimizer_states(p)["param"].detach().view(-1)
    dist.all_reduce(flat, group=opt.data_parallel_group)
    return flat.view(p.shape)


def set_main_weight(optimizer, p: torch.Tensor, full: torch.Tensor) -> bool:
    """Write the whole (TP-local) fp32 main weight `full` of model parameter `p` into `optimizer` (the
    plain optimizer's copy, or this DP rank's range of the distributed one's; no communication).
    Returns whether anything was written (False: fp32 `p`, or none of `p` on this DP rank)."""
    opt = _owning_distopt(optimizer, p)
    if opt is None:
        main = _mixed_precision_main(optimizer, p)
        if main is None:
            return False
        main.data.copy_(full.reshape(main.shape))
        return True
    if p.dtype == torch.float32:
        return False
    rng = _local_range(opt, p)
    if rng is None:
        return False
    opt._get_main_param_and_optimizer_states(p)["param"].data.copy_(full.reshape(-1)[rng[0] : rng[1]])
    return True


def adam_state(optimizer, p: torch.Tensor) -> dict[str, Any]:
    """This rank's whole (TP-local) optimizer state of model parameter `p`: the torch optimizer's state
    of `p` (Megatron's plain optimizer), or, with a DistributedOptimizer, each DP rank's range of every
    moment joined by an all-reduce (sum) over the optimizer's data-parallel group: a collective there,
    every rank of that group calls it for the same `p` in the same order. {} when `p` has no state yet."""
    opt = _owning_distopt(optimizer, p)
    if opt is None:
        key = state_key(optimizer, p)
        for inner in _inner_optimizers(optimizer):
            if key in inner.state:
                return dict(inner.state[key])
        return {}
    rng = _local_range(opt, p)
    local = opt._get_main_param_and_optimizer_states(p) if rng is not None else {}
    out: dict[str, Any] = {}
    for key in MOMENTS:
        flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if key in local:
            flat[rng[0] : rng[1]] = local[key].detach().view(-1)
        dist.all_reduce(flat, group=opt.data_parallel_group)
        out[key] = flat.view(p.shape)
    step = next((st["step"] for st in opt.optimizer.state.values() if "step" in st), None)
    if step is not None:
        out["step"] = step.detach().cpu().clone() if isinstance(step, torch.Tensor) else step
    return out if step is not None else {}


def ensure_distributed_state(optimizer) -> bool:
    """Give every DistributedOptimizer inside `optimizer` its Adam state (Megatron's
    `_init_optimizer_states_with_dummy_values`: one step with zero gradients) where it has none yet;
    that step moves the parameters (weight decay), so callers write the parameters after it. Returns
    whether it stepped."""
    stepped = False
    for o in _distributed(optimizer):
        if not any(o.optimizer.state.values()):
            o._init_optimizer_states_with_dummy_values()
            stepped = True
    return stepped


def is_distributed(optimizer) -> bool:
    return bool(_distributed(optimizer))


def set_adam_state(optimizer, p: torch.Tensor, full: dict[str, torch.Tensor], step: float) -> bool:
    """Write the whole (TP-local) moments `full` of model parameter `p` into `optimizer`: its torch
    state (plain Megatron optimizer, keyed by `p`'s fp32 main weight under mixed precision; created
    where missing, in the dtype of that key) or, with a DistributedOptimizer, this DP
    rank's range of each flattened moment (no communication; `ensure_distributed_state` first).
    Returns whether anything was written (False: SGD, or none of `p` on this DP rank)."""
    opt = _owning_distopt(optimizer, p)
    if opt is None:
        key_p = state_key(optimizer, p)
        for inner in _inner_optimizers(optimizer):
            if not any(key_p is q for g in inner.param_groups for q in g["params"]):
                continue
            if inner.defaults.get("betas") is None:
                return False  # not Adam (SGD keeps no such state)
            st = inner.state.setdefault(key_p, {})
            for key in MOMENTS:
                st[key] = full[key].to(key_p.device, key_p.dtype).clone()
            st["step"] = torch.tensor(float(step))
            return True
        return False
    rng = _local_range(opt, p)
    if rng is None:
        return False
    tensors = opt._get_main_param_and_optimizer_states(p)
    for key in MOMENTS:
        tensors[key].copy_(full[key].reshape(-1)[rng[0] : rng[1]].to(tensors[key].dtype))
    group_index, group_order = opt.model_param_group_index_map[p]
    main = opt.optimizer.param_groups[group_index]["params"][group_order]
    if "step" in opt.optimizer.state[main]:
        old = opt.optimizer.state[main]["step"]
        opt.optimizer.state[main]["step"] = (
            torch.full_like(old, float(step)) if isinstance(old, torch.Tensor) else type(old)(step)
        )
    return True
