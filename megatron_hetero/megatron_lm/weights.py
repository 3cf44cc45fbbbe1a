"""Whole-model weights (and Adam state) by parameter name, and this rank's shard of them for one module.

`ReferenceSource.build` runs Megatron's own `setup_model_and_optimizer` with the script's model
provider on Megatron's global parallel state (the *reference* layout, Megatron's own
`--tensor-model-parallel-size`): the model the unpatched script would train, with its own
initialisation and, with `--load DIR`, Megatron's own `load_checkpoint` (weights, optimizer state,
learning-rate scheduler, RNG, iteration) of a checkpoint saved by a run with that layout. Each
tensor-parallel parameter and its optimizer state are all-gathered over the reference TP group and
concatenated along the parameter's `partition_dim`, keyed by the parameter's name in the whole model
(`language_model.decoder.layers.3.mlp.linear_fc1.weight`, ...). With Megatron's
DistributedOptimizer (`--use-distributed-optimizer`) each parameter's moments are first joined over
the reference DP group (`optimizer_state.adam_state`: an all-reduce, sum, of each rank's range).
The way back, `--save`, is `checkpoints.save_reference_checkpoint`.

With `--bf16`/`--fp16` the reference optimizer's fp32 main weights are gathered the same way
(`ReferenceSource.main`; `optimizer_state.main_weight`), and with `--fp16` its grad scaler's state is
kept (`ReferenceSource.grad_scaler`, for the rank's loss scaler: `precision.restore_loss_scale`).

`copy_into` keeps this rank's shard of each tensor (`chunk(tp)[tp_rank]` along `partition_dim`;
layer numbers shifted by the stage's offset when the module is pipelined); `copy_optimizer_state`
does the same for the module's optimizer (moments, step and fp32 main weights; experts by their global
index, over the module's expert-TP group). Megatron's QKV and non-gated MLP layouts are plain chunks
along the partition dimension, which is what Megatron's own TP resharding assumes.

Gated MLPs (`--swiglu`, `gated_linear_unit`) are not: each TP rank's `linear_fc1` weight (and bias)
is its shard of the gate projection followed by its shard of the up projection, `[gate_r; up_r]`
along dim 0 (`MLP.forward` chunks the fc1 output in two: silu of the first half times the second).
Megatron's own `sharded_state_dict` of the MLP (`apply_swiglu_sharded_factory`) therefore stores the
two halves as separate fragments of the global tensor: gate shards at fragments 0..tp-1, up shards at
tp..2tp-1. The full tensors here follow that global layout, `[gate; up]`, whatever the TP: gathering
splits every rank's piece in its two halves (`_join`) and sharding cuts gate and up separately
(`_split`), so TP a -> TP b keeps each rank's gate and up rows matched.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.megatron_lm.optimizer_state import (
    MOMENTS,
    adam_state,
    ensure_distributed_state,
    is_distributed,
    main_weight,
    set_adam_state,
    set_main_weight,
    state_key,
)

_LAYER = re.compile(r"^((?:language_model\.)?decoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"(^|\.)(experts\.local_experts\.)(\d+)\.")


def _partition(p: torch.Tensor) -> Optional[int]:
    return int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None


def gated_names(model: torch.nn.Module) -> frozenset[str]:
    """Names (as `model.named_parameters()` gives them) of the `linear_fc1` weights and biases of the
    gated MLPs in `model` (Megatron's `MLP` with `config.gated_linear_unit`: `--swiglu`)."""
    from megatron.core.transformer.mlp import MLP

    out = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, MLP) and getattr(mod.config, "gated_linear_unit", False):
            for p_name, _ in mod.linear_fc1.named_parameters(recurse=False):
                out.add(".".join(x for x in (mod_name, "linear_fc1", p_name) if x))
    return frozenset(out)


def _join(parts: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    """The full tensor from the TP ranks' pieces `parts` (in TP-rank order) along `dim`; `gated`:
    each piece is `[gate_r; up_r]` and the full tensor is `[gate_0..gate_n-1; up_0..up_n-1]`."""
    if not gated:
        return torch.cat(parts, dim=dim)
    halves = [_halves(t, dim) for t in parts]
    return torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=dim)


def _split(full: torch.Tensor, dim: int, tp: int, tp_rank: int, gated: bool) -> torch.Tensor:
    """TP rank `tp_rank`'s piece of `full` at `tp` (the inverse of `_join`)."""
    if not gated:
        return full.chunk(tp, dim=dim)[tp_rank]
    gate, up = _halves(full, dim)
    return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)


def _halves(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if t.shape[dim] % 2:
        raise ValueError(
            f"a gated linear_fc1 tensor of shape {tuple(t.shape)} has an odd size {t.shape[dim]} along dim {dim}"
        )
    gate, up = t.chunk(2, dim=dim)
    return gate, up


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (chained or not)."""
    if optimizer is None:
        return []
    outer = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in outer if getattr(o, "optimizer", None) is not None]


class ReferenceSource:
    """Full tensors of Megatron's own model (and optimizer state) on the reference layout."""

    def __init__(
        self,
        full: dict[str, torch.Tensor],
        state: dict[str, dict[str, Any]],
        iteration: int,
        main: Optional[dict[str, torch.Tensor]] = None,
        grad_scaler: Optional[dict] = None,
    ) -> None:
        self.full, self.state, self.iteration = full, state, iteration
        #: --bf16/--fp16: each parameter's fp32 main weight, as the reference optimizer holds it
        self.main: dict[str, torch.Tensor] = main or {}
        #: --fp16: the reference optimizer's grad scaler state (Megatron's checkpoint's `grad_scaler`)
        self.grad_scaler = grad_scaler
        self.kept: Optional[tuple] = None  # (model chunks, optimizer, scheduler) when kept for --save

    @classmethod
    def build(cls, model_provider: Callable, keep: bool = False) -> "ReferenceSource":
        from megatron.core import parallel_state as ps
        from megatron.core.enums import ModelType
        from megatron.training import get_args
        from megatron.training.training import setup_model_and_optimizer
        from megatron.core.utils import unwrap_model

        chunks, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder, model_provider)
        if len(chunks) != 1:
            raise ValueError("the reference model must have one chunk (no virtual pipeline)")
        model = unwrap_model(chunks)[0]
        tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        if any(is_expert(n) for n, _ in model.named_parameters()):
            if ps.get_expert_model_parallel_world_size() != 1:
                raise ValueError(
                    "the reference layout must have --expert-model-parallel-size 1 (each module's own "
                    "ep comes from the layout)"
                )
            # expert weights are sharded over the expert-TP group (Megatron's default: the TP size)
            etp_group, etp = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()

        def gather(t: torch.Tensor, dim: Optional[int], gated: bool, expert: bool) -> torch.Tensor:
            t = t.detach()
            size, group = (etp, etp_group) if expert else (tp, tp_group)
            if dim is not None and size > 1:
                parts = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(parts, t.contiguous(), group=group)
                t = _join(parts, dim, gated)
            return t.cpu().clone()

        full, state, main = {}, {}, {}
        gated = gated_names(model)
        for name, p in model.named_parameters():
            dim, expert = _partition(p), is_expert(name)
            full[name] = gather(p, dim, name in gated, expert)
            mw = main_weight(optimizer, p)  # --bf16/--fp16; distributed: over the reference DP group
            if mw is not None:
                main[name] = gather(mw, dim, name in gated, expert)
            st = adam_state(optimizer, p)  # distributed: over the reference DP group
            if st:
                state[name] = {
                    k: gather(v, dim, name in gated, expert)
                    if isinstance(v, torch.Tensor) and v.shape == p.shape
                    else (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in sorted(st.items())
                }
        iteration = int(get_args().iteration or 0)
        src = cls(full, state, iteration, main, grad_scaler_state(optimizer))
        if keep:
            src.kept = (chunks, optimizer, scheduler)
        return src

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.full:
            raise KeyError(f"the reference model has no parameter {name}")
        return self.full[name]

    def release(self) -> None:
        self.full, self.state, self.main = {}, {}, {}


def grad_scalers(optimizer) -> list:
    """The grad scalers of the Megatron optimizers inside `optimizer` (chained or not; --fp16)."""
    if optimizer is None:
        return []
    outer = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.grad_scaler for o in outer if getattr(o, "grad_scaler", None) is not None]


def grad_scaler_state(optimizer) -> Optional[dict]:
    """A copy of the state of the (first) grad scaler in `optimizer` (Megatron's chained optimizers
    share one scale), or None without one."""
    scalers = grad_scalers(optimizer)
    if not scalers:
        return None
    return {
        k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in scalers[0].state_dict().items()
    }


def _global_name(name: str, layer_offset: int, first_expert: int = 0) -> str:
    """The whole model's name of this stage's parameter `name`: the layer index shifted by the stage's
    `layer_offset`, and (MoE) the local expert index by this EP rank's `first_expert`."""
    if first_expert and is_expert(name):
        name = _EXPERT.sub(lambda mt: f"{mt.group(1)}{mt.group(2)}{int(mt.group(3)) + first_expert}.", name, count=1)
    m = _LAYER.match(name)
    if m is None or not layer_offset:
        return name
    return f"{m.group(1)}{int(m.group(2)) + layer_offset}{m.group(3)}"


def is_expert(name: str) -> bool:
    """Whether `name` is a parameter of one MoE expert (`...mlp.experts.local_experts.K...`)."""
    return _EXPERT.search(name) is not None


def _first_expert(model: torch.nn.Module, pgs) -> int:
    """The global index of this EP rank's first expert: Megatron gives EP rank r experts
    [r * E/ep, (r + 1) * E/ep) of each MoE layer (E: `config.num_moe_experts`)."""
    ep = pgs.ep.size() if getattr(pgs, "ep", None) is not None else 1
    if ep == 1:
        return 0
    cfg = next(m.config for m in model.modules() if getattr(m, "config", None) is not None)
    return pgs.ep.rank() * (cfg.num_moe_experts // ep)


def _tp_of(name: str, pgs) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group parameter `name` is sharded over: the module's
    expert-TP group for expert weights, its TP group otherwise."""
    group = pgs.expt_tp if is_expert(name) and getattr(pgs, "expt_tp", None) is not None else pgs.tp
    return group.size(), group.rank()


def _layer_offset(model: torch.nn.Module, first_layer: int = 0) -> int:
    """The whole model's index of this stage's first decoder layer: `first_layer` (where the module's
    segment starts) plus the stage's offset inside the module (Megatron's `layer_number` - 1)."""
    lm = getattr(model, "language_model", model)
    decoder = getattr(lm, "decoder", None)
    if decoder is None or not len(decoder.layers):
        return first_layer
    return first_layer + decoder.layers[0].layer_number - 1


def stage_layers(model: torch.nn.Module, first_layer: int = 0) -> range:
    """The whole model's decoder layers this stage of `model` holds (as Megatron built them: its
    layers' `layer_number`, which follows `get_transformer_layer_offset`, uneven splits included)."""
    lm = getattr(model, "language_model", model)
    decoder = getattr(lm, "decoder", None)
    start = _layer_offset(model, first_layer)
    return range(start, start + (len(decoder.layers) if decoder is not None else 0))


def _shard(full: torch.Tensor, p: torch.Tensor, tp: int, tp_rank: int, what: str, gated: bool = False) -> torch.Tensor:
    """This TP rank's piece of the full tensor `full` of parameter `p` (shape-checked); `gated`: a
    gated `linear_fc1` tensor (`[gate; up]`, see the module docstring)."""
    dim = _partition(p)
    if gated and dim is not None and dim != 0:
        raise ValueError(f"{what}: a gated linear_fc1 tensor partitioned along dim {dim}, expected 0")
    t = _split(full, dim, tp, tp_rank, gated) if dim is not None and tp > 1 else full
    if tuple(t.shape) != tuple(p.shape):
        raise ValueError(
            f"{what}: reference shape {tuple(full.shape)} gives shard {tuple(t.shape)} at tp={tp}, "
            f"the module holds {tuple(p.shape)} (different model sizes or padded vocabulary?)"
        )
    return t


@torch.no_grad()
def copy_into(model: torch.nn.Module, source: ReferenceSource, pgs, first_layer: int = 0) -> None:
    """Overwrite every parameter of `model` (one module on this rank) with its shard from `source`;
    `first_layer`: the whole model's index of the module's first decoder layer (a segment's start)."""
    offset = _layer_offset(model, first_layer)
    gated = gated_names(model)
    first_expert = _first_expert(model, pgs)
    for name, p in model.named_parameters():
        full = source.tensor(_global_name(name, offset, first_expert))
        tp, tp_rank = _tp_of(name, pgs)
        p.copy_(_shard(full, p, tp, tp_rank, f"parameter {name}", name in gated).to(p.dtype))


@torch.no_grad()
def copy_optimizer_state(model: torch.nn.Module, optimizer, source: ReferenceSource, pgs, first_layer: int = 0) -> int:
    """Give `optimizer` (the module's Megatron optimizer) the reference optimizer's state of each
    parameter, sharded as the parameter is: its Adam moments and step, and with --bf16/--fp16 its fp32
    main weight (`source.main`; the module's own optimizer started its main weights from the
    half-precision parameters). Expert weights are found by their global expert index and sharded
    over the module's expert-TP group (as `copy_into`). Returns how many parameters got moments."""
    if not source.state and not source.main:
        return 0
    if is_distributed(optimizer):
        return _copy_distributed_state(model, optimizer, source, pgs, first_layer)
    offset = _layer_offset(model, first_layer)
    first_expert = _first_expert(model, pgs)
    gated = gated_names(model)
    inner_of = {id(q): o for o in _inner_optimizers(optimizer) for g in o.param_groups for q in g["params"]}
    done = 0
    for name, p in model.named_parameters():
        gname = _global_name(name, offset, first_expert)
        tp, tp_rank = _tp_of(name, pgs)
        if gname in source.main:
            set_main_weight(
                optimizer, p, _shard(source.main[gname], p, tp, tp_rank, f"main weight of {name}", name in gated)
            )
        st = source.state.get(gname)
        key = state_key(optimizer, p)
        inner = inner_of.get(id(key))
        if st is None or inner is None:
            continue
        inner.state[key] = {
            k: (
                _shard(v, p, tp, tp_rank, f"optimizer state {k} of {name}", name in gated).to(key.device).clone()
                if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.dim() > 0
                else (v.to(key.device).clone() if isinstance(v, torch.Tensor) else v)
            )
            for k, v in st.items()
        }
        done += 1
    return done


def _copy_distributed_state(model: torch.nn.Module, optimizer, source: ReferenceSource, pgs, first_layer: int) -> int:
    """`copy_optimizer_state` for a module with Megatron's DistributedOptimizer: each DP rank writes its
    range of every parameter's moments and fp32 main weight (`optimizer_state.set_adam_state`,
    `set_main_weight`); the parameters are written again after the optimizer's state is created (that
    step moves them)."""
    if ensure_distributed_state(optimizer):
        copy_into(model, source, pgs, first_layer)
    offset = _layer_offset(model, first_layer)
    first_expert = _first_expert(model, pgs)
    gated = gated_names(model)
    done = 0
    for name, p in model.named_parameters():
        gname = _global_name(name, offset, first_expert)
        tp, tp_rank = _tp_of(name, pgs)
        if gname in source.main:
            set_main_weight(
                optimizer, p, _shard(source.main[gname], p, tp, tp_rank, f"main weight of {name}", name in gated)
            )
        st = source.state.get(gname)
        if not st or not all(k in st for k in MOMENTS):
            continue
        full = {k: _shard(st[k], p, tp, tp_rank, f"optimizer state {k} of {name}", name in gated) for k in MOMENTS}
        step = st.get("step", source.iteration)
        done += set_adam_state(optimizer, p, full, float(step.item() if isinstance(step, torch.Tensor) else step))
    return done
