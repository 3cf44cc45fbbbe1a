"""The cost model's view of a job's model (`config.model.LlavaSpec`): its `Workload` (`workload`), one
`planner.workload.ModelSpec` per module sized from the spec, trained as `train` trains it. Pure: no torch.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_hetero.config.model import EncoderSpec, LlavaSpec, check_sizes
from megatron_hetero.planner.workload import ModelSpec, Workload
from megatron_hetero.planner.qwen_vision_cost import attention_span


def _ffn(hidden: int, ffn: Optional[int]) -> int:
    return 4 * hidden if ffn is None else ffn


def layer_mix_of(pattern: str) -> tuple[float, float, float]:
    """The shares (attention `*`, dense MLP `-`, MoE `E`) of a hybrid layer pattern's layers (`|`
    ignored); ValueError for other symbols (Mamba `M` is not priced)."""
    layers = pattern.replace("|", "")
    other = sorted(set(layers) - set("*-E"))
    if other or not layers:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: the cost model prices attention '*', MLP '-' and MoE 'E' "
            f"layers; {other or 'no layers'} are not priced"
        )
    n = float(len(layers))
    return (layers.count("*") / n, layers.count("-") / n, layers.count("E") / n)


def workload(spec: LlavaSpec, global_batch: int, micro_batch: int, inputs: Optional[dict] = None) -> Workload:
    """The cost model's `Workload` of `spec` (its first encoder `Workload.encoder`, the others
    `extra_encoders`), trained as `train` trains it: fp32 with Adam (fp32 weights and main grads:
    4 + 4 bytes, two fp32 moments: 8 bytes, no distributed optimizer), the encoders' MLP 4 * their
    hidden size. inputs: encoder name -> inputs per sample (default 1: one input of the encoder's
    tokens; a speech encoder's clip of k chunks: k); an encoder with variable tiles needs its entry.
    micro_batch: the cost model's (samples per replica of the largest language DP)."""
    if not spec.encoders:
        raise ValueError("the cost model prices a model with at least one encoder; this one has none")
    inputs = dict(inputs or {})
    unknown = sorted(set(inputs) - set(spec.encoders))
    if unknown:
        raise ValueError(f"inputs for encoders {unknown} the model does not have ({sorted(spec.encoders)})")
    specs, counts = [], []
    for name, e in spec.encoders.items():
        check_sizes(spec, e)
        if e.max_tiles and name not in inputs:
            raise ValueError(
                f"--encoder-max-tiles {e.max_tiles}: the cost model prices a fixed number of image tokens per "
                "sample; plan with --encoder-tokens set to the tokens of a typical sample (tiles x tokens per tile)"
            )
        k = inputs.get(name, 1)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"encoder {name}: inputs per sample must be a positive integer, got {k!r}")
        h = spec.hidden_size
        specs.append(qwen_encoder_spec(name, e, h) if e.kind == "qwen2.5-vl" else encoder_model_spec(name, e, h))
        counts.append(k)
    enc = specs[0]
    h = spec.hidden_size
    hybrid: dict[str, Any] = {}
    if spec.hybrid_layer_pattern is not None:  # each layer one type: their shares, E's experts
        hybrid["layer_mix"] = layer_mix_of(spec.hybrid_layer_pattern)
        if "E" in spec.hybrid_layer_pattern:
            hybrid.update(
                num_experts=spec.num_experts or 0,
                moe_topk=spec.moe_router_topk,
                moe_ffn_hidden=spec.moe_ffn_hidden_size,
            )
    llm = ModelSpec(
        "language",
        spec.num_layers,
        h,
        _ffn(h, spec.ffn_hidden_size),
        spec.num_attention_heads,
        spec.seq_length,
        kind="llm",
        vocab=spec.vocab_size,
        **hybrid,
    )
    return Workload(
        enc,
        llm,
        global_batch=global_batch,
        micro_batch=micro_batch,
        images_per_sample=counts[0],
        dtype_bytes=4,  # train's defaults: fp32 Adam, no distributed optimizer, SP or recompute
        distributed_optimizer=False,
        sequence_parallel=False,
        recompute=None,
        extra_encoders=tuple(specs[1:]),
        extra_inputs=tuple(counts[1:]),
    )


def encoder_model_spec(name: str, e: EncoderSpec, h: int) -> ModelSpec:
    """The cost model's encoder of `train`'s fixed-token encoders (linear, CLIP, SigLIP, Whisper)."""
    eh = e.hidden_size
    enc_layer = 4 * eh**2 + 2 * eh * _ffn(eh, None)
    # the encoder's non-layer parameters (patch embedding, positions, projector) count with its layers;
    # Whisper's embedding is two kernel-3 convolutions (mel bins -> h, h -> h) over 2 frames a token
    if e.kind == "whisper":
        embed = (e.feature_dim // 2) * eh * 3 + eh + 3 * eh * eh + eh
    else:
        embed = (e.feature_dim + 1) * eh
    extra = embed + e.tokens * eh + (eh + 1) * h + (h + 1) * h
    return ModelSpec(
        name,
        e.num_layers,
        eh,
        _ffn(eh, None),
        e.num_attention_heads,
        e.tokens,
        kind="encoder",
        params=int(e.num_layers * enc_layer + extra),
    )


def qwen_encoder_spec(name: str, e: EncoderSpec, h: int) -> ModelSpec:
    """The cost model's Qwen2.5-VL tower (`models.qwen_encoder`): a gated (SwiGLU) transformer over
    the image's patches (merge**2 per image token), attention priced by its windows and full layers
    (`planner.qwen_vision_cost.attention_span`), the merger handing `tokens` to the language model;
    parameters: the blocks (QKV and output with biases, SwiGLU with biases, two RMSNorms), the Conv3d
    patch embedding, the merger (RMSNorm, m^2 h -> m^2 h -> h_llm)."""

    eh, unit = e.hidden_size, e.merge_size**2
    ffn = e.ffn_hidden_size or 4 * eh
    rows = e.image_rows or round(e.tokens**0.5)
    grid = [(1, e.merge_size * rows, e.merge_size * (e.tokens // rows))]
    full = len(e.fullatt_block_indexes)
    span = attention_span(
        grid, depth=e.num_layers, full_layers=full, merge=e.merge_size, patch=e.patch_size, window=e.window_size
    )
    layer = 4 * eh * eh + 4 * eh + 3 * eh * ffn + 2 * ffn + eh + 2 * eh
    patch_in = 3 * e.temporal_patch_size * e.patch_size**2
    merger = eh + (unit * eh) ** 2 + unit * eh + unit * eh * h + h
    return ModelSpec(
        name,
        e.num_layers,
        eh,
        ffn,
        e.num_attention_heads,
        e.tokens * unit,
        kind="encoder",
        gated=True,
        features=patch_in,
        params=int(e.num_layers * layer + patch_in * eh + merger),
        attention_span=span,
        out_tokens=e.tokens,
    )
