"""Whole-model weights by parameter name, and this rank's shard of them for one module.

Two sources give the full (un-sharded) tensor of a parameter of Megatron's LLaVA model, by its name
in the whole model (`language_model.decoder.layers.3.mlp.linear_fc1.weight`, ...):
  * `ReferenceSource`: Megatron's own model built by the script's model provider on Megatron's
    global parallel state (the reference layout), each tensor-parallel parameter all-gathered over the
    reference TP group and concatenated along its `partition_dim`;
  * `CheckpointSource`: a `--ckpt-format torch` checkpoint (`iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt`,
    one file per TP rank of the saving run, pipeline size 1), the TP shards concatenated the same way.
`copy_into` keeps this rank's shard (`chunk(tp)[tp_rank]` along `partition_dim`; layer numbers shifted
by the stage's offset when the module is pipelined). Megatron's QKV and (non-GLU) MLP layouts are
plain chunks along the partition dimension, which is what Megatron's own TP resharding assumes.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^(language_model\.decoder\.layers\.)(\d+)(\..*)$")


def _partition(p: torch.Tensor) -> Optional[int]:
    return int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else None


class ReferenceSource:
    """Full tensors of Megatron's own model on the reference layout (see module docstring)."""

    def __init__(self, full: dict[str, torch.Tensor]) -> None:
        self.full = full

    @classmethod
    def build(cls, model_provider: Callable) -> "ReferenceSource":
        from megatron.core import parallel_state as ps
        from megatron.core.enums import ModelType
        from megatron.training.training import get_model

        chunks = get_model(model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
        if len(chunks) != 1:
            raise ValueError("the reference model must have one chunk (no virtual pipeline)")
        model = chunks[0]
        tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        full = {}
        for name, p in model.named_parameters():
            t = p.detach()
            dim = _partition(p)
            if dim is not None and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=dim)
            full[name] = t.cpu().clone()
        del chunks, model
        return cls(full)

    def tensor(self, name: str, partition_dim: Optional[int]) -> torch.Tensor:
        if name not in self.full:
            raise KeyError(f"the reference model has no parameter {name}")
        return self.full[name]

    def release(self) -> None:
        self.full = {}


class CheckpointSource:
    """Full tensors of a `--ckpt-format torch` checkpoint directory (`--load DIR`)."""

    def __init__(self, load_dir: str) -> None:
        tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
        if not os.path.isfile(tracker):
            raise ValueError(f"--load {load_dir}: no latest_checkpointed_iteration.txt (not a torch-format "
                             f"Megatron checkpoint)")
        text = open(tracker).read().strip()
        self.iteration = 0 if text == "release" else int(text)
        it_dir = os.path.join(load_dir, "release" if text == "release" else f"iter_{self.iteration:07d}")
        files = sorted(glob.glob(os.path.join(it_dir, "mp_rank_*", "model_optim_rng.pt")))
        if not files:
            raise ValueError(f"--load {load_dir}: no mp_rank_*/model_optim_rng.pt under {it_dir}")
        if any(re.search(r"mp_rank_\d+_\d+", f) for f in files):
            raise ValueError(f"--load {load_dir}: the checkpoint is pipeline-parallel; loading it into a layout "
                             f"needs pipeline size 1 in the saving run")
        self.dir = it_dir
        self.shards = [torch.load(f, map_location="cpu", weights_only=False)["model"] for f in files]

    def tensor(self, name: str, partition_dim: Optional[int]) -> torch.Tensor:
        if name not in self.shards[0]:
            raise KeyError(f"checkpoint {self.dir} has no parameter {name}")
        parts = [sd[name] for sd in self.shards]
        if partition_dim is None or len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=partition_dim)

    def release(self) -> None:
        self.shards = []


def _global_name(name: str, layer_offset: int) -> str:
    m = _LAYER.match(name)
    if m is None or not layer_offset:
        return name
    return f"{m.group(1)}{int(m.group(2)) + layer_offset}{m.group(3)}"


def _layer_offset(model: torch.nn.Module) -> int:
    lm = getattr(model, "language_model", None)
    if lm is None or not len(lm.decoder.layers):
        return 0
    return lm.decoder.layers[0].layer_number - 1


@torch.no_grad()
def copy_into(model: torch.nn.Module, source: Any, pgs) -> None:
    """Overwrite every parameter of `model` (one module on this rank) with its shard from `source`."""
    tp, tp_rank = pgs.tp.size(), pgs.tp.rank()
    offset = _layer_offset(model)
    for name, p in model.named_parameters():
        dim = _partition(p)
        full = source.tensor(_global_name(name, offset), dim)
        t = full.chunk(tp, dim=dim)[tp_rank] if dim is not None and tp > 1 else full
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"parameter {name}: source shape {tuple(full.shape)} gives shard {tuple(t.shape)} "
                             f"at tp={tp}, the module holds {tuple(p.shape)} (different model sizes or padded "
                             f"vocabulary?)")
        p.copy_(t.to(p.dtype))
