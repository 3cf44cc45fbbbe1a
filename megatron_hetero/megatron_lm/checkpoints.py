"""`--save` of the patched scripts with a layout, and the per-parameter Adam state both directions use.

The checkpoint is Megatron's own: `save_reference_checkpoint` puts the layout's trained weights and
Adam state into the *reference* model and optimizer (Megatron's own, built by
`weights.ReferenceSource.build` on the layout of Megatron's parallel flags and kept for `--save`) and
calls Megatron's `save_checkpoint` on them, in whatever `--ckpt-format` the run names (`torch`: one
file per reference TP rank; `torch_dist`: Megatron's distributed format, with the optimizer state
as `--ckpt-format`/`--dist-ckpt-*` flags make it). The unpatched script resumes from it, and
`--load` of a layout run reads it back through Megatron's `load_checkpoint` (`weights.py`).

Which rank holds what: a module's rank holds its stage's parameters; their names in the whole model
are their local names with the stage's first global layer added (`weights._global_name`,
`_layer_offset`, the script model's `first_layer` for GPT segments). Every rank all-gathers the list
of names it holds (`all_gather_object` over the world, once per save); each reference parameter's
source is the lowest rank holding it. Over the wire, per reference parameter (in the reference
model's order, the same on every rank): the holders all-gather their TP pieces over their module's
TP group (every DP replica does, each in its own group), then the source broadcasts the whole tensor
to the world; the same for each Adam moment (`exp_avg`, `exp_avg_sq`). With a module's (or the
reference's) `--use-distributed-optimizer` each DP rank holds only its range of a parameter's
flattened moments (Megatron's `DistributedOptimizer._get_model_param_range_map` and
`_get_main_param_and_optimizer_states`, its per-parameter views): `adam_state` joins them with a sum
over the optimizer's data-parallel group (zeros outside each rank's range: exact), and
`set_adam_state` writes each rank's range back.

With `--bf16`/`--fp16` the parameters go over the wire in their half precision (2 bytes an element),
then each parameter's fp32 main weight (`optimizer_state.main_weight`: the module optimizer's, not the
half-precision parameter cast up; joined over the DP group like the moments with the distributed
optimizer) and the moments in fp32, the same way (TP all-gather, broadcast from the source), into the
reference optimizer's main weights (`set_main_weight`). The --fp16 loss scale is not sent: every rank
holds the same one (`runtime.loss_scale`) and copies it into the reference optimizer's grad scaler,
which Megatron saves as the checkpoint's `grad_scaler`.

MoE: a module with `ep` > 1 holds on EP rank r its local experts K, the model's experts
`K + r * (E / ep)` (`weights._first_expert`); their names in `_holdings` carry the global index, so the
source of each expert is the lowest rank of the EP rank that holds it, and its pieces are gathered
over the module's expert-TP group (`pgs.expt_tp`) instead of its TP group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_hetero.megatron_lm.optimizer_state import (
    MOMENTS,
    adam_state,
    ensure_distributed_state,
    main_weight,
    set_adam_state,
    set_main_weight,
)
from megatron_hetero.megatron_lm.weights import (
    _first_expert,
    _global_name,
    _join,
    _layer_offset,
    _partition,
    _split,
    gated_names,
    grad_scalers,
    is_expert,
)
from megatron_hetero.compat.device import get_device


def _holdings(states: dict, first_layers: dict[str, int]) -> dict[str, tuple[torch.Tensor, Any, bool]]:
    """{global name: (this rank's parameter, its ModuleState, whether it is a gated linear_fc1 tensor)};
    an expert's global name carries its global expert index (this EP rank's first expert added)."""
    out = {}
    for name, st in states.items():
        offset = _layer_offset(st.module, first_layers.get(name, 0))
        first_expert = _first_expert(st.module, st.pgs)
        gated = gated_names(st.module)
        for n, p in st.module.named_parameters():
            out[_global_name(n, offset, first_expert)] = (p, st, n in gated)
    return out


def _tp_group(st, name: str):
    """The group a module's parameter `name` is tensor-parallel over: the expert-TP group for experts."""
    if is_expert(name) and getattr(st.pgs, "expt_tp", None) is not None:
        return st.pgs.expt_tp
    return st.pgs.tp


@torch.no_grad()
def save_reference_checkpoint(source, iteration: int, states: dict, first_layers: dict[str, int]) -> None:
    """Write a checkpoint of the *reference* layout (Megatron's parallel flags) with Megatron's own
    `save_checkpoint` (see the module docstring for what goes over the wire); `states`: this rank's
    ModuleStates by module name, `first_layers`: each module's first global decoder layer."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    from megatron_hetero.checkpoint.save_load import _writer_results_in_process
    from megatron_hetero.runtime.loss_scale import rank_loss_scaler

    assert source.kept is not None, "the reference model was not kept"
    chunks, optimizer, scheduler = source.kept
    ref = unwrap_model(chunks)[0]
    ref_tp, ref_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    ref_etp, ref_erank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    dev = get_device()
    held = _holdings(states, first_layers)
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(held))
    src: dict[str, int] = {}
    for r, ns in enumerate(names):
        for n in ns:
            src.setdefault(n, r)
    ref_gated = gated_names(ref)
    ensure_distributed_state(optimizer)  # before the parameters are written (it steps them)

    def whole(name: str, ref_p: torch.Tensor, local: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor of `name` in `dtype` on every rank, from the holders' `local` TP pieces."""
        dim = _partition(ref_p)
        shape = list(ref_p.shape)
        if dim is not None:
            shape[dim] *= ref_etp if is_expert(name) else ref_tp
        out = torch.empty(shape, dtype=dtype, device=dev)
        if name in held:
            p, st, gated = held[name]
            local = local.to(dev, dtype).contiguous()
            group = _tp_group(st, name)
            if dim is not None and group.size() > 1:
                parts = [torch.empty_like(local) for _ in range(group.size())]
                dist.all_gather(parts, local, group=group)
                local = _join(parts, dim, gated)
            if dist.get_rank() == src[name]:
                out.copy_(local)
        dist.broadcast(out, src=src[name])
        return out

    def mine(full: torch.Tensor, ref_p: torch.Tensor, name: str) -> torch.Tensor:
        dim = _partition(ref_p)
        size, rank = (ref_etp, ref_erank) if is_expert(name) else (ref_tp, ref_rank)
        return _split(full, dim, size, rank, name in ref_gated) if dim is not None and size > 1 else full

    for name, rp in ref.named_parameters():
        if name not in src:
            raise ValueError(f"no module of the layout holds the reference model's parameter {name}")
        local = held[name][0].detach() if name in held else None
        rp.data.copy_(mine(whole(name, rp, local, rp.dtype), rp, name))
        if not rp.requires_grad:
            continue
        p, st = (held[name][0], held[name][1]) if name in held else (None, None)
        if rp.dtype != torch.float32:  # --bf16/--fp16: the fp32 main weights, as the modules' optimizers hold them
            main = None
            if p is not None:
                main = main_weight(st.optimizer, p) if st.optimizer is not None else None
                main = main if main is not None else p.detach().float()  # a frozen holder: its weights
            set_main_weight(optimizer, rp, mine(whole(name, rp, main, torch.float32), rp, name))
        moments: dict[str, torch.Tensor] = {}
        if p is not None:
            have = adam_state(st.optimizer, p) if st.optimizer is not None else {}
            moments = {k: have.get(k, torch.zeros_like(p, dtype=torch.float32)) for k in MOMENTS}
        full = {k: mine(whole(name, rp, moments.get(k), torch.float32), rp, name) for k in MOMENTS}
        set_adam_state(optimizer, rp, full, iteration)
    scaler = rank_loss_scaler(states)  # --fp16: the rank's one loss scale is the checkpoint's grad_scaler
    if scaler is not None:
        for gs in grad_scalers(optimizer):
            gs.load_state_dict(
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scaler.state_dict().items()}
            )
    args = get_args()
    args.consumed_train_samples = iteration * args.global_batch_size
    args.consumed_valid_samples = consumed_valid_samples(args, iteration)
    _writer_results_in_process()  # torch_dist: the writer's results stay in this process
    save_checkpoint(iteration, chunks, optimizer, scheduler, 0)


def consumed_valid_samples(args, iteration: int) -> int:
    """What Megatron's checkpoint records at `iteration` as read from the validation set: one
    evaluation of `--eval-iters` global batches every `--eval-interval` iterations, each before that
    iteration's save (the layout's `log.Evaluator` resumes the validation reader at the same place)."""
    if not args.eval_interval or not args.eval_iters or args.eval_iters <= 0:
        return 0
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return (iteration // args.eval_interval) * args.eval_iters * batch
