"""Parameter counts of the memory model (pure): how many parameters each module stage holds on a rank
(`memory.py` turns them into bytes).

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
  `1 + tokens` positions, ln_pre), its layers, ln_post, and the projector; `kind: siglip`: its
  siglip variant (patch convolution `3 p^2 h + h` with bias, `tokens` positions, no class token, no
  ln_pre), its layers (MLP `ffn_hidden_size`), the post LayerNorm, with `pooling_head` SigLIP's
  attention-pooling head (probe h, attention `4 h^2 + 4 h`, LayerNorm 2h, MLP `2 h f + f + h`), and
  the projector; `kind: qwen2.5-vl`: the Qwen2.5-VL tower (`memory_qwen.py`). Frozen parameters (`encoder_frozen_params`: CLIP's ln_post, SigLIP's head and,
  without `post_norm`, its post LayerNorm; every parameter but the projector's of a frozen
  encoder) count in `total` only, never in `trainable`;
* an output head: the MLP projector `H -> hidden -> out_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.planner.memory_qwen import merger_params, qwen_stage_params
from megatron_hetero.config.model import EncoderSpec, LlavaSpec, OutputSpec
from megatron_hetero.plan.roles import language_modules, roles


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


def hybrid_layer_params(spec: LlavaSpec, symbol: str, tp: int, ep: int = 1, expt_tp: int = 1) -> tuple[int, int]:
    """(all, expert) parameters of one HybridModel layer on one rank: `*` a norm and the attention,
    `-` a norm and the MLP, `E` a norm, the router `E x h` and E/ep local experts (expert-TP
    `expt_tp`, no linear biases); the same pieces as `language_layer_params`'s GPT layer."""
    h = spec.hidden_size
    f = spec.ffn_hidden_size or 4 * h
    norm = _norm(h, spec.normalization)
    if symbol == "*":
        groups = spec.num_query_groups or spec.num_attention_heads
        kvc = spec.kv_channels or h // spec.num_attention_heads
        attn = _attention(h, spec.num_attention_heads, groups, kvc, tp, spec.add_bias_linear, spec.add_qkv_bias)
        return norm + attn, 0
    if symbol == "-":
        return norm + _mlp(h, f, tp, spec.swiglu, spec.add_bias_linear), 0
    if symbol == "E":
        if not spec.num_experts:
            raise ValueError("--hybrid-layer-pattern: MoE layers ('E') need --num-experts")
        fe = spec.moe_ffn_hidden_size or f
        experts = (spec.num_experts // ep) * _mlp(h, fe, expt_tp, spec.swiglu, False)
        return norm + spec.num_experts * h + experts, experts
    raise ValueError(f"--hybrid-layer-pattern: layer {symbol!r} is not priced (priced: '*', '-', 'E')")


def hybrid_stage_symbols(pattern: str, pp: int, pp_rank: int) -> str:
    """The layer symbols of pipeline stage `pp_rank` of `pp`: the pattern's `|`-separated stage, or
    without pipes the even split (Megatron's rule; ValueError where the layers do not split)."""
    if "|" in pattern:
        stages = pattern.split("|")
        if len(stages) != pp:
            raise ValueError(f"--hybrid-layer-pattern {pattern!r} has {len(stages)} pipeline stages, pp is {pp}")
        return stages[pp_rank]
    per = _stage_layers(len(pattern), pp)
    return pattern[pp_rank * per : (pp_rank + 1) * per]


def _encoder_layer_params(enc: EncoderSpec, tp: int) -> int:
    h = enc.hidden_size
    f = enc.ffn_hidden_size or 4 * h
    return _attention(
        h, enc.num_attention_heads, enc.num_attention_heads, h // enc.num_attention_heads, tp, True, False
    ) + (2 * _norm(h, "LayerNorm") + _mlp(h, f, tp, False, True))


def _pooling_head_params(enc: EncoderSpec) -> int:
    """SigLIP's attention-pooling head (replicated over TP): the probe, torch's MultiheadAttention
    (packed QKV and output projection, with biases), its LayerNorm and its MLP h -> f -> h."""
    h = enc.hidden_size
    f = enc.ffn_hidden_size or 4 * h
    return h + (3 * h * h + 3 * h + h * h + h) + _norm(h, "LayerNorm") + (h * f + f + f * h + h)


def encoder_frozen_params(enc: EncoderSpec) -> int:
    """The parameters of an encoder that never train, even when the module trains (outside LLaVA's
    features): CLIP's ln_post (the pooled output only); SigLIP's pooling head, and its post LayerNorm
    when the features are read before it (no `post_norm`)."""
    if enc.kind == "clip":
        return _norm(enc.hidden_size, "LayerNorm")
    if enc.kind == "siglip":
        head = _pooling_head_params(enc) if enc.pooling_head else 0
        return head + (0 if enc.post_norm else _norm(enc.hidden_size, "LayerNorm"))
    if enc.kind == "whisper":  # the sinusoidal position table
        return enc.tokens * enc.hidden_size
    return 0


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
        if enc.kind == "qwen2.5-vl":  # a frozen tower trains its merger and ln_q
            projector = merger_params(enc, spec.hidden_size, m.tp) if last else 0
        return StageParams(total, 0, projector if m.frozen else total - encoder_frozen_params(enc), 0)
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
    if spec.hybrid_layer_pattern is not None:  # each layer its type's (one language module, no segments)
        pieces = [
            hybrid_layer_params(spec, c, m.tp, m.ep, m.expt_tp)
            for c in hybrid_stage_symbols(spec.hybrid_layer_pattern, m.pp, pp_rank)
        ]
        total, expert = sum(p for p, _ in pieces), sum(e for _, e in pieces)
    else:
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
    if enc.kind == "qwen2.5-vl":
        return qwen_stage_params(enc, llm_hidden, m, pp_rank)
    h = enc.hidden_size
    layers = _stage_layers(enc.num_layers, m.pp) * _encoder_layer_params(enc, m.tp)
    first, last = pp_rank == 0, pp_rank == m.pp - 1
    if enc.kind == "clip":
        embed = 3 * enc.patch_size**2 * h + h + (enc.tokens + 1) * h + _norm(h, "LayerNorm")
        return embed + layers + _norm(h, "LayerNorm") + _projector_params(h, llm_hidden, m.tp)
    if enc.kind == "siglip":  # conv with bias, positions, no class token or ln_pre; post norm; head
        embed = 3 * enc.patch_size**2 * h + h + enc.tokens * h
        head = _pooling_head_params(enc) if enc.pooling_head else 0
        return embed + layers + _norm(h, "LayerNorm") + head + _projector_params(h, llm_hidden, m.tp)
    if enc.kind == "whisper":  # conv1 (mel -> h, kernel 3), conv2 (h -> h, kernel 3), positions, final norm
        embed = (enc.feature_dim // 2) * h * 3 + h + h * h * 3 + h + enc.tokens * h
        return embed + layers + _norm(h, "LayerNorm") + _projector_params(h, llm_hidden, m.tp)
    total = layers
    if first:
        total += enc.feature_dim * h + h + enc.tokens * h
    if last:
        total += _norm(h, "LayerNorm") + _projector_params(h, llm_hidden, m.tp)
    return total


# -- state bytes ---------------------------------------------------------------------------------
