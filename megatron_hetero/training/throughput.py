"""`--log-throughput`: FLOPs of one training iteration by Megatron-LM's formula
(`megatron/training/training.py` `num_floating_point_operations`, the standard-transformer branch:
dense or MoE MLPs, multi-head or grouped-query attention, SwiGLU, no MLA, no linear attention, no
MTP), applied to each module of the graph with that module's own sizes, and the TFLOP/s per rank
that Megatron prints as `throughput per GPU (TFLOP/s/GPU)`.

For one module with L layers, hidden h, MLP width f, heads n, query groups g, kv channels d,
sequence s and vocabulary V (0: the module has no output layer), over a batch of B samples
(T = B * s tokens), counting every GEMM 3 times (forward, weight gradient, input gradient) at
2 FLOPs per multiply-add:

    attention (token-linear)   6 * h * (d*n + 2*d*g) + 6 * d*n * h       per layer and token
    core attention             6 * d*n * s                               per layer and token (causal: halved, QK^T and PV)
    MLP                        6 * h * f * (3 if SwiGLU else 2)          per dense layer and token
                               6 * h * f_moe * k * (3 if SwiGLU else 2)  per MoE layer and token (top-k experts)
    logits                     6 * h * V                                 per token

Which sizes each module uses (`module_shapes`): an encoder its `--encoder-*` sizes, its tokens as
the sequence (a CLIP encoder's class token included) and no logits; a language module (or segment)
the language sizes with its own layer count, the logits only on the last segment; an output head
(an MLP, no transformer layer) counts 0, as do projectors and embeddings, which Megatron's formula
does not count either. Every module sees the whole global batch (each sample once per step, whatever
its DP). Megatron's causal halving of the core attention is kept for the bidirectional encoders too
(the same formula for every module).

TFLOP/s per rank (`tflops_per_rank`): a module's FLOPs / (iteration time x the module's rank count);
the whole model's: the sum over modules / (iteration time x world size), as Megatron divides by its
world size. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.plan.roles import language_modules, roles
from megatron_hetero.config.model import LlavaSpec


@dataclass(frozen=True)
class TransformerShape:
    """The sizes Megatron's FLOPs formula reads, for one module (Megatron's argument names in the
    comments). `query_groups` None: multi-head attention (`num_query_groups` = heads);
    `kv_channels` None: hidden // heads; `num_experts` None: dense MLPs."""

    layers: int  # num_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    ffn: int  # ffn_hidden_size
    seq: int  # seq_length
    vocab: int = 0  # padded_vocab_size (0: no output layer)
    query_groups: Optional[int] = None  # num_query_groups (with group_query_attention)
    kv_channels: Optional[int] = None  # kv_channels
    swiglu: bool = False  # swiglu
    num_experts: Optional[int] = None  # num_experts (every layer MoE: moe_layer_freq 1)
    topk: int = 1  # moe_router_topk
    moe_ffn: Optional[int] = None  # moe_ffn_hidden_size (default: ffn)


def training_flops(shape: TransformerShape, batch: int) -> float:
    """FLOPs of one training iteration (forward and backward) of `shape` over `batch` samples, by
    Megatron-LM's `num_floating_point_operations` (standard transformer, BSHD: no packing)."""
    if shape.layers == 0 and shape.vocab == 0:
        return 0.0
    fwd_bwd, fma = 3, 2
    kv = shape.kv_channels if shape.kv_channels is not None else shape.hidden // shape.heads
    groups = shape.query_groups if shape.query_groups is not None else shape.heads
    query, key_value = kv * shape.heads, kv * groups
    self_attn = fwd_bwd * fma * (shape.hidden * (query + 2 * key_value) + query * shape.hidden)
    core_attn = fwd_bwd * fma * query / 2 * 2  # causal mask (half the scores), QK^T and (QK^T)V
    ffn_factor = 3 if shape.swiglu else 2
    dense, moe = (shape.layers, 0) if shape.num_experts is None else (0, shape.layers)
    experts = shape.topk if shape.num_experts is not None else 0
    moe_ffn = shape.moe_ffn if shape.moe_ffn is not None else shape.ffn
    tokens = batch * shape.seq
    per_token = (
        fwd_bwd * fma * shape.hidden * (shape.ffn * ffn_factor * dense + moe_ffn * experts * ffn_factor * moe)
        + self_attn * shape.layers
        + fwd_bwd * fma * shape.hidden * shape.vocab
    )
    return float(tokens * per_token + batch * shape.seq * shape.seq * core_attn * shape.layers)


def module_shapes(spec: LlavaSpec, layout: HeteroLayout) -> dict[str, TransformerShape]:
    """Each module's `TransformerShape` (see the module docstring for which sizes)."""
    out: dict[str, TransformerShape] = {}
    langs = language_modules(layout)
    outputs = set(roles(layout).outputs)
    for m in layout.modules:
        if m.name in spec.encoders:
            enc = spec.encoders[m.name]
            out[m.name] = TransformerShape(
                layers=enc.num_layers,
                hidden=enc.hidden_size,
                heads=enc.num_attention_heads,
                ffn=enc.ffn_hidden_size or 4 * enc.hidden_size,
                seq=enc.tokens + (1 if enc.kind == "clip" else 0),
            )
        elif m.name in outputs or m.name in spec.outputs:
            out[m.name] = TransformerShape(layers=0, hidden=1, heads=1, ffn=0, seq=0)
        else:
            layers = m.layers.size if m.layers is not None else spec.num_layers
            out[m.name] = TransformerShape(
                layers=layers,
                hidden=spec.hidden_size,
                heads=spec.num_attention_heads,
                ffn=spec.ffn_hidden_size or 4 * spec.hidden_size,
                seq=spec.seq_length,
                vocab=spec.vocab_size if m.name == langs[-1].name else 0,
                query_groups=spec.num_query_groups,
                kv_channels=spec.kv_channels,
                swiglu=spec.swiglu,
                num_experts=spec.num_experts,
                topk=spec.moe_router_topk,
                moe_ffn=spec.moe_ffn_hidden_size,
            )
    return out


def module_flops(spec: LlavaSpec, layout: HeteroLayout, global_batch: int) -> dict[str, float]:
    """FLOPs of one training iteration per module (every module sees the whole global batch)."""
    return {name: training_flops(shape, global_batch) for name, shape in module_shapes(spec, layout).items()}


def tflops_per_rank(flops: dict[str, float], layout: HeteroLayout, seconds: float) -> tuple[float, dict[str, float]]:
    """(the whole model's TFLOP/s per rank: sum of `flops` / (seconds x world size), each module's:
    its FLOPs / (seconds x its rank count)); 0 for a non-positive time."""
    if seconds <= 0:
        return 0.0, {n: 0.0 for n in flops}
    per_module = {n: f / (seconds * layout.module(n).size * 1e12) for n, f in flops.items()}
    return sum(flops.values()) / (seconds * layout.world_size * 1e12), per_module
