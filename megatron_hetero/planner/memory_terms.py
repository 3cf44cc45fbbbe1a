"""The per-parameter and per-layer memory terms (pure, scalar or numpy arrays alike): what one
parameter costs in state under the run's precision and optimizer (`StateFeatures`), and what one
transformer layer keeps for backward (`layer_activation_bytes`). `planner/memory.py` applies them to a
layout rank by rank (`plan --memory`, `train --log-memory`); the search's cost model
(`planner/cost_terms.py`) applies the same ones to its candidate arrays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class StateFeatures:
    """What decides the bytes per parameter: the run's precision, optimizer and distributed optimizer."""

    precision: str = "fp32"  # fp32, bf16 or fp16 (Megatron's --bf16 / --fp16)
    optimizer: str = "adam"  # adam or sgd
    distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be adam or sgd, got {self.optimizer!r}")

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if self.grad_reduce_in_fp32 or self.precision == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        moments = 8 if self.optimizer == "adam" else 4
        return moments + (0 if self.precision == "fp32" else 4)


@dataclass(frozen=True)
class ActivationFeatures:
    """What decides the activation bytes of a layer: dtype bytes of the activations, sequence
    parallelism (on a tp > 1 language module), and recompute ('full' keeps each recompute unit's
    input only, 'selective' drops the attention scores; None keeps everything)."""

    dtype_bytes: int = 4
    sequence_parallel: bool = False
    recompute: Optional[str] = None
    recompute_num_layers: int = 1
    recompute_method: str = "uniform"
    #: whether the attention keeps its softmax output (Megatron-core's local attention does; a fused
    #: flash attention such as Transformer Engine's keeps only its inputs and output)
    keeps_scores: bool = True

    def __post_init__(self) -> None:
        if self.recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute must be None, 'full' or 'selective', got {self.recompute!r}")


def layer_activation_bytes(
    tokens: Any,
    rows: Any,
    hidden: int,
    ffn: int,
    heads: int,
    tp: Any,
    features: ActivationFeatures,
    gated: bool = False,
    kv_channels: Optional[int] = None,
    normalization: str = "LayerNorm",
    query_groups: Optional[int] = None,
) -> Any:
    """Bytes autograd saves for backward in one transformer layer's forward of `rows` samples of
    `tokens` tokens (Megatron-core's local layer spec, dropout 0), on one rank of TP `tp`, as
    measured on the layers the runtime builds (tests/ranks/test_memory_model.py):

    * the two norms, replicated over TP (split over it under sequence parallelism): LayerNorm keeps
      its input and output (4 s*b*h) and 2 fp32 statistics of s*b each; RMSNorm its input, the
      normalised input and output (6 s*b*h) and 1 statistic each;
    * attention 4 q*s*b / tp (q = heads * kv_channels): the QKV output (q + 2 kv) or, with grouped
      queries (kv = query_groups * kv_channels), the query and the keys and values repeated to every
      head (3 q), and the context q; with selective recompute (2 q + 2 kv) s*b / tp: the QKV output
      and the context (the core attention keeps nothing of its own);
    * the softmax output heads * s^2 * b / tp (not with selective recompute);
    * the MLP's inputs of its activation and of its second linear: 2 s*b*f / tp, SwiGLU 5 s*b*f / tp.

    `tokens`, `rows` and `tp` may be numpy arrays (the search's candidates). Full recompute is the caller's (`stage_activation_bytes`); `norm_activation_bytes` is the final norm."""
    s, b, h = tokens, rows, hidden
    sp = tp if features.sequence_parallel else 1
    kvc = kv_channels or h // heads
    q, kv = heads * kvc, (query_groups or heads) * kvc
    per_norm, stats = (2, 2) if normalization == "LayerNorm" else (3, 1)
    elems = 2 * per_norm * s * b * h // sp + (5 if gated else 2) * s * b * ffn // tp
    if features.recompute == "selective":
        elems += (2 * q + 2 * kv) * s * b // tp
    else:
        elems += 4 * q * s * b // tp + (heads * s * s * b // tp if features.keeps_scores else 0)
    return elems * features.dtype_bytes + 2 * stats * s * b // sp * 4


def layer_norm_activation_bytes(
    tokens: int, rows: int, hidden: int, tp: int, features: ActivationFeatures, normalization: str = "LayerNorm"
) -> int:
    """Bytes one of a layer's norms saves (`layer_activation_bytes` counts two): LayerNorm its input
    and output and 2 fp32 statistics, RMSNorm its input, normalised input and output and 1."""
    sp = tp if features.sequence_parallel else 1
    per_norm, stats = (2, 2) if normalization == "LayerNorm" else (3, 1)
    return per_norm * tokens * rows * hidden // sp * features.dtype_bytes + stats * tokens * rows // sp * 4


def norm_activation_bytes(
    tokens: int, rows: int, hidden: int, tp: int, features: ActivationFeatures, normalization: str = "LayerNorm"
) -> int:
    """Bytes the final norm of a stack of layers saves: LayerNorm its input and 2 statistics, RMSNorm
    its input, the normalised input and 1 statistic (its output is the next module's to save)."""
    sp = tp if features.sequence_parallel else 1
    n = tokens * rows // sp
    kept, stats = (1, 2) if normalization == "LayerNorm" else (2, 1)
    return kept * n * hidden * features.dtype_bytes + stats * n * 4
