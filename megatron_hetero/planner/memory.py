"""The memory model of what `megatron-hetero train` holds per rank (pure): parameters, gradients and
optimizer state of every module stage a rank serves, with the runtime's features (precision,
optimizer, distributed optimizer). `plan --json` prints it per rank; `train --log-memory` logs it
beside what the rank measures (`training/memory_log.py`).

Parameters per rank, counted as the runtime builds its modules (Megatron-core's local layer spec):

* a transformer layer on TP degree t: two norms (LayerNorm: weight and bias, h each; RMSNorm: weight
  only), QKV `(q + 2 kv) / t x h` with q = heads * kv_channels, kv = query_groups * kv_channels (bias
  `(q + 2 kv) / t` with linear biases or the QKV bias), output projection `h x q / t` (bias h, not
  split), MLP `f' / t x h` and `h x f / t` with f' = 2f gated (SwiGLU), f otherwise (biases f'/t and
  h); with experts the MLP is a router `E x h` and E/ep local experts of the same MLP on expert-TP;
* the language model: the word embeddings `vocab / t x h` (+ learned positions `seq x h`) on the
  first stage of the first segment; the final norm and the output layer `vocab / t x h` on the last
  stage of the last segment (the output layer exists there unless the embeddings are tied and that
  stage also holds them);
* an encoder (`kind: linear`): its patch embedding `feature x h + h` and positions `tokens x h` on
  the first stage, GPT-style layers (LayerNorm, biases, MLP 4h unless given), the final LayerNorm and
  the projector (Megatron's MLP projector `h -> H -> H`, column- then row-parallel) on the last;
  `kind: clip`: Megatron's CLIPViTModel (patch convolution `3 p^2 h` without bias, class token,
  `1 + tokens` positions, ln_pre), its layers, ln_post, and the projector;
* an output head: the MLP projector `H -> hidden -> out_dim`.

State bytes of P parameters (N trainable, E of them expert parameters), Megatron's optimizer:

* params: P x param bytes (4 fp32, 2 bf16/fp16);
* grads: N x grad bytes (DDP's buffer: 4 with grad_reduce_in_fp32 or in fp32, else 2);
* optimizer: N x (moments + main) bytes, moments 8 for Adam, 4 for SGD (momentum), main 4 when the
  parameters are bf16/fp16 (the fp32 copy) and 0 in fp32; with the distributed optimizer each of
  them is split over the module's DP x CP group (expert parameters: expert-DP = tp*cp*dp/ep/expt_tp);
  DDP's bucket padding is not modelled (at most 128 x DP elements per bucket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.planner.model import EncoderSpec, LlavaSpec, OutputSpec
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.plan.roles import language_modules, roles


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
class StageParams:
    """Parameters of one module stage on one rank: `total` (dense + expert), `expert`, and
    `trainable` (0 for a frozen module; a frozen encoder's projector still trains)."""

    total: int
    expert: int
    trainable: int
    trainable_expert: int


# -- parameter counts ----------------------------------------------------------------------------
def _norm(h: int, normalization: str) -> int:
    return 2 * h if normalization == "LayerNorm" else h


def _mlp(h: int, f: int, t: int, gated: bool, bias: bool) -> int:
    f_in = (2 * f if gated else f) // t
    return f_in * h + h * (f // t) + ((f_in + h) if bias else 0)


def _attention(h: int, heads: int, groups: int, kv_channels: int, t: int, bias: bool, qkv_bias: bool) -> int:
    q, kv = heads * kv_channels, groups * kv_channels
    qkv = (q + 2 * kv) // t
    return qkv * h + (qkv if bias or qkv_bias else 0) + h * (q // t) + (h if bias else 0)


def language_layer_params(spec: LlavaSpec, tp: int, ep: int = 1, expt_tp: int = 1) -> tuple[int, int]:
    """(all, expert) parameters of one language-model layer on one rank of TP `tp` (experts: E/ep
    local experts on expert-TP `expt_tp`)."""
    h = spec.hidden_size
    f = spec.ffn_hidden_size or 4 * h
    groups = spec.num_query_groups or spec.num_attention_heads
    kvc = spec.kv_channels or h // spec.num_attention_heads
    attn = _attention(h, spec.num_attention_heads, groups, kvc, tp, spec.add_bias_linear, spec.add_qkv_bias)
    norms = 2 * _norm(h, spec.normalization)
    if not spec.num_experts:
        return attn + norms + _mlp(h, f, tp, spec.swiglu, spec.add_bias_linear), 0
    fe = spec.moe_ffn_hidden_size or f
    experts = (spec.num_experts // ep) * _mlp(h, fe, expt_tp, spec.swiglu, False)  # MoE: no linear biases
    return attn + norms + spec.num_experts * h + experts, experts


def _encoder_layer_params(enc: EncoderSpec, tp: int) -> int:
    h = enc.hidden_size
    f = enc.ffn_hidden_size or 4 * h
    return _attention(
        h, enc.num_attention_heads, enc.num_attention_heads, h // enc.num_attention_heads, tp, True, False
    ) + (2 * _norm(h, "LayerNorm") + _mlp(h, f, tp, False, True))


def _projector_params(h_in: int, h_out: int, tp: int) -> int:
    """Megatron's MLP projector h_in -> h_out -> h_out (column- then row-parallel, with biases)."""
    return (h_out // tp) * h_in + h_out // tp + h_out * (h_out // tp) + h_out


def _stage_layers(layers: int, pp: int) -> int:
    if layers % pp:
        raise ValueError(f"{layers} layers do not split over pp({pp})")
    return layers // pp


def stage_params(layout: HeteroLayout, spec: LlavaSpec, module: str, pp_rank: int) -> StageParams:
    """The parameters one rank of `module`'s pipeline stage `pp_rank` holds (module docstring)."""
    m = layout.module(module)
    if module in roles(layout).language:
        return _language_stage(layout, spec, m, pp_rank)
    if module in spec.encoders:
        total = _encoder_stage(spec.encoders[module], spec.hidden_size, m, pp_rank)
        enc = spec.encoders[module]
        last = pp_rank == m.pp - 1
        projector = _projector_params(enc.hidden_size, spec.hidden_size, m.tp) if last else 0
        fixed = _norm(enc.hidden_size, "LayerNorm") if enc.kind == "clip" else 0  # ln_post never trains
        return StageParams(total, 0, projector if m.frozen else total - fixed, 0)
    if module in spec.outputs:
        out: OutputSpec = spec.outputs[module]
        t = m.tp
        total = (out.hidden_size // t) * spec.hidden_size + out.hidden_size // t + out.out_dim * (out.hidden_size // t)
        total += out.out_dim
        return StageParams(total, 0, 0 if m.frozen else total, 0)
    raise ValueError(f"module {module}: not an encoder, language module or output head of the model")


def _language_stage(layout: HeteroLayout, spec: LlavaSpec, m: ModuleLayout, pp_rank: int) -> StageParams:
    segs = [s.name for s in language_modules(layout)]
    n_layers = m.layers.size if m.layers is not None else spec.num_layers
    per, experts = language_layer_params(spec, m.tp, m.ep, m.expt_tp)
    layers = _stage_layers(n_layers, m.pp)
    total, expert = layers * per, layers * experts
    h, vocab = spec.hidden_size, spec.vocab_size // m.tp
    first = m.name == segs[0] and pp_rank == 0
    last = m.name == segs[-1] and pp_rank == m.pp - 1
    if first:
        total += vocab * h + (spec.seq_length * h if spec.position_embedding_type == "learned_absolute" else 0)
    if last:
        total += _norm(h, spec.normalization)
        if spec.untie_embeddings_and_output_weights or not first:
            total += vocab * h
    trainable = 0 if m.frozen else total
    return StageParams(total, expert, trainable, 0 if m.frozen else expert)


def _encoder_stage(enc: EncoderSpec, llm_hidden: int, m: ModuleLayout, pp_rank: int) -> int:
    h = enc.hidden_size
    layers = _stage_layers(enc.num_layers, m.pp) * _encoder_layer_params(enc, m.tp)
    first, last = pp_rank == 0, pp_rank == m.pp - 1
    if enc.kind == "clip":
        embed = 3 * enc.patch_size**2 * h + h + (enc.tokens + 1) * h + _norm(h, "LayerNorm")
        return embed + layers + _norm(h, "LayerNorm") + _projector_params(h, llm_hidden, m.tp)
    total = layers
    if first:
        total += enc.feature_dim * h + h + enc.tokens * h
    if last:
        total += _norm(h, "LayerNorm") + _projector_params(h, llm_hidden, m.tp)
    return total


# -- state bytes ---------------------------------------------------------------------------------
def _expert_dp(m: ModuleLayout) -> int:
    return max(1, m.tp * m.cp * m.dp // (m.ep * m.expt_tp))


def stage_state_bytes(m: ModuleLayout, p: StageParams, features: StateFeatures) -> dict[str, int]:
    """{params, grads, optimizer} bytes of stage parameters `p` of module `m` on one rank."""
    dense_trainable = p.trainable - p.trainable_expert
    opt = features.optimizer_bytes
    if features.distributed_optimizer:
        optimizer = dense_trainable * opt // (m.dp * m.cp) + p.trainable_expert * opt // _expert_dp(m)
    else:
        optimizer = p.trainable * opt
    return {
        "params": p.total * features.param_bytes,
        "grads": p.trainable * features.grad_bytes,
        "optimizer": optimizer,
    }


def rank_state_bytes(
    layout: HeteroLayout, spec: LlavaSpec, rank: int, features: StateFeatures
) -> dict[str, dict[str, int]]:
    """Module -> {params, grads, optimizer} bytes that rank `rank` holds (only the modules it serves)."""
    out: dict[str, dict[str, int]] = {}
    for m in layout.modules:
        if rank not in m.rank_range.ranks():
            continue
        c = coord_of(m, rank)
        out[m.name] = stage_state_bytes(m, stage_params(layout, spec, m.name, c.pp), features)
    return out


def total_bytes(per_module: dict[str, dict[str, int]], offloaded: Optional[set[str]] = None) -> int:
    """The sum over modules and parts (`offloaded` modules excluded)."""
    return sum(sum(v.values()) for k, v in per_module.items() if not offloaded or k not in offloaded)


# -- activations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivationFeatures:
    """What decides the activation bytes of a layer: dtype bytes of the activations, sequence
    parallelism (on a tp > 1 language module), and recompute ('full' keeps each recompute unit's
    input only, 'selective' drops the attention scores; None keeps everything)."""

    dtype_bytes: int = 4
    sequence_parallel: bool = False
    recompute: Optional[str] = None
    recompute_num_layers: int = 1

    def __post_init__(self) -> None:
        if self.recompute not in (None, "full", "selective"):
            raise ValueError(f"recompute must be None, 'full' or 'selective', got {self.recompute!r}")


def layer_activation_bytes(
    tokens: int,
    rows: int,
    hidden: int,
    ffn: int,
    heads: int,
    tp: int,
    features: ActivationFeatures,
    gated: bool = False,
    kv_channels: Optional[int] = None,
    normalization: str = "LayerNorm",
    query_groups: Optional[int] = None,
) -> int:
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

    Full recompute is the caller's (`stage_activation_bytes`); `norm_activation_bytes` is the final norm."""
    s, b, h = tokens, rows, hidden
    sp = tp if features.sequence_parallel else 1
    kvc = kv_channels or h // heads
    q, kv = heads * kvc, (query_groups or heads) * kvc
    per_norm, stats = (2, 2) if normalization == "LayerNorm" else (3, 1)
    elems = 2 * per_norm * s * b * h // sp + (5 if gated else 2) * s * b * ffn // tp
    if features.recompute == "selective":
        elems += (2 * q + 2 * kv) * s * b // tp
    else:
        elems += 4 * q * s * b // tp + heads * s * s * b // tp
    return elems * features.dtype_bytes + 2 * stats * s * b // sp * 4


def norm_activation_bytes(
    tokens: int, rows: int, hidden: int, tp: int, features: ActivationFeatures, normalization: str = "LayerNorm"
) -> int:
    """Bytes the final norm of a stack of layers saves: LayerNorm its input and 2 statistics, RMSNorm
    its input, the normalised input and 1 statistic (its output is the next module's to save)."""
    sp = tp if features.sequence_parallel else 1
    n = tokens * rows // sp
    kept, stats = (1, 2) if normalization == "LayerNorm" else (2, 1)
    return kept * n * hidden * features.dtype_bytes + stats * n * 4
