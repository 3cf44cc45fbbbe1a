"""Layout-independent parameter initialisation.

Megatron initialises a TP shard from a full master weight (with `use_cpu_initialization=True`), but
the RNG stream depends on which layers a pipeline stage builds, so the same model under PP1 and PP2
starts from different weights. Here every parameter's *full* tensor is drawn from a generator seeded
by (seed, module name, the parameter's global name) and this rank keeps its TP shard: every layout
(TP, CP, PP, DP) starts from identical weights.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable

import torch

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def _seed_of(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256("/".join(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def global_name(name: str, layer_offset: int) -> str:
    """`decoder.layers.3.x` with this stage's first global layer index added (`layers.{3+offset}`)."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + layer_offset}.", name, count=1)


@torch.no_grad()
def deterministic_init(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    *,
    seed: int,
    module: str,
    tp_rank: int,
    tp_size: int,
    layer_offset: int = 0,
    std: float = 0.02,
) -> None:
    """Initialise parameters in place, independent of the layout.

    Norm weights -> 1, biases and norm biases -> 0, everything else ~ N(0, std) drawn for the full
    (unsharded) shape and then cut to this rank's TP shard along `partition_dim` (Megatron's
    `tensor_model_parallel` / `partition_dim` attributes). With `partition_stride` s (the fused
    [gate; up] of a gated MLP: s = 2) the full tensor is s blocks and each rank holds its TP shard
    of every block, in order (Megatron's strided split), so every TP size starts from the same
    full tensor.
    """
    for name, p in named_params:
        gname = global_name(name, layer_offset)
        leaf = name.rsplit(".", 1)[-1]
        # Transformer Engine fuses the pre-norm into the next linear: `linear_qkv.layer_norm_weight`
        if ("norm" in name.lower() and leaf == "weight") or leaf == "layer_norm_weight":
            p.fill_(1.0)
            continue
        if leaf in ("bias", "layer_norm_bias"):
            p.zero_()
            continue
        split = bool(getattr(p, "tensor_model_parallel", False)) and tp_size > 1
        shape = list(p.shape)
        if split:
            dim = p.partition_dim
            shape[dim] *= tp_size
        g = torch.Generator().manual_seed(_seed_of(str(seed), module, gname))
        full = torch.randn(shape, generator=g, dtype=torch.float32) * std
        if split:
            stride = getattr(p, "partition_stride", 1)
            full = torch.cat(
                [
                    block.chunk(tp_size, dim=p.partition_dim)[tp_rank]
                    for block in full.chunk(stride, dim=p.partition_dim)
                ],
                dim=p.partition_dim,
            )
        p.copy_(full.to(dtype=p.dtype, device=p.device))
