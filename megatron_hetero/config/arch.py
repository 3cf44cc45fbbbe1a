"""Megatron-LM's architecture flags for the model family (`train`), declared once (`ArchFlags`: the
flags `cli.arch_flags` generates; train's door reads them into one), and applied to a `LlavaSpec`
(`apply_arch_flags`); ValueError for contradictory flags. Every flag defaults to None (unset): the model keeps its description's defaults
(`config.model.LlavaSpec`, the tiny GPT). Pure: no torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megatron_hetero.layout.flags import flag_field
from megatron_hetero.config.model import QWEN_VL, ModelFlags


def _arch(help: Optional[str] = None, **kw: Any) -> Any:
    return flag_field(None, help, group="arch", given=True, **kw)


@dataclass(frozen=True)
class ArchFlags:
    """Megatron-LM's architecture flags (its names and meanings); None: not given."""

    normalization: Optional[str] = _arch(choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: Optional[float] = _arch()
    swiglu: Optional[bool] = _arch("gated SiLU MLP (Llama/Qwen2)")
    position_embedding_type: Optional[str] = _arch(choices=["learned_absolute", "rope", "mrope"])
    mrope_section: Optional[tuple] = _arch(
        "M-RoPE's temporal, height and width sections of the rotary channels (summing to the head "
        "dimension / 2; Qwen2.5-VL-7B: 16 24 24; needs --position-embedding-type mrope)",
        type=int,
        nargs=3,
    )
    rotary_base: Optional[float] = _arch()
    use_rope_scaling: Optional[bool] = _arch(
        "Llama 3.1+'s rope frequency scaling (needs --position-embedding-type rope)"
    )
    rope_scaling_factor: Optional[float] = _arch("the rope scaling factor (default 8.0; needs --use-rope-scaling)")
    group_query_attention: Optional[bool] = _arch()
    num_query_groups: Optional[int] = _arch()
    kv_channels: Optional[int] = _arch("attention head dimension (default hidden/heads)")
    add_qkv_bias: Optional[bool] = _arch("QKV bias (Qwen2)")
    disable_bias_linear: Optional[bool] = _arch()
    share_embeddings_and_output_weights: Optional[bool] = _arch("tie the output layer to the input embeddings")
    untie_embeddings_and_output_weights: Optional[bool] = _arch("untied (the default here)")
    vision_model_type: Optional[str] = _arch(
        "clip / siglip: Megatron's CLIPViTModel (its clip or siglip variant) for every encoder (needs --patch-dim); "
        "qwen2.5-vl: Qwen2.5-VL's vision tower (needs --patch-dim, --position-embedding-type mrope and "
        "--mrope-section)",
        choices=["linear", "clip", "siglip", "qwen2.5-vl"],
    )
    patch_dim: Optional[int] = _arch("CLIP/SigLIP patch side (features per token: 3 * patch**2)")
    audio_model_type: Optional[str] = _arch(
        "whisper: the layout's `audio` encoder is Whisper's speech encoder (two log-mel frames a token: "
        "--encoder-feature-dim = 2 * mel bins; --vision-model-type leaves it alone)",
        choices=["linear", "whisper"],
    )
    hybrid_layer_pattern: Optional[str] = _arch(
        "the language model is Megatron's HybridModel over these layers: * attention, - MLP, E MoE, "
        "M Mamba (GPU), | pipeline stage (e.g. '*-*-|*-*E'); sets --num-layers"
    )


# the spec's language-model fields that take the flag of their own name
_SAME_NAME = (
    "normalization",
    "norm_epsilon",
    "swiglu",
    "position_embedding_type",
    "rotary_base",
    "num_query_groups",
    "kv_channels",
    "add_qkv_bias",
    "mrope_section",
)


# What `--vision-model-type` sets on every encoder beside its kind, patch size and features: SigLIP
# as Megatron-LM builds it for `--vision-model-type siglip` (gelu's tanh form, LayerNorm epsilon
# 1e-6, the post LayerNorm on the features, no pooling head); CLIP keeps the EncoderSpec defaults
# (quick-GELU, 1e-5, no post norm on the features).
VIT_FIELDS: dict[str, dict[str, Any]] = {
    "clip": {},
    "siglip": {"activation": "gelu_pytorch_tanh", "norm_epsilon": 1e-6, "post_norm": True, "pooling_head": False},
}


def _rope_scaling(g: ArchFlags, spec) -> dict[str, Any]:
    """The `rope_scaling` / `rope_scaling_factor` fields the flags set (ValueError when
    contradictory); `spec`: the model with the other language-model flags applied."""
    if g.rope_scaling_factor is not None and not g.use_rope_scaling:
        raise ValueError(
            f"--rope-scaling-factor {g.rope_scaling_factor} needs --use-rope-scaling (Llama 3.1's rope scaling)"
        )
    if not g.use_rope_scaling:
        return {}
    if spec.position_embedding_type != "rope":
        raise ValueError(
            f"--use-rope-scaling scales rotary positions: it needs --position-embedding-type rope "
            f"(the model's is {spec.position_embedding_type})"
        )
    out: dict[str, Any] = {"rope_scaling": True}
    if g.rope_scaling_factor is not None:
        if not g.rope_scaling_factor >= 1:
            raise ValueError(f"--rope-scaling-factor {g.rope_scaling_factor} must be >= 1")
        out["rope_scaling_factor"] = float(g.rope_scaling_factor)
    return out


def qwen_encoder(enc, patch: Optional[int], feature_dim: Optional[int]):
    """`enc` as Qwen2.5-VL's tower (`--vision-model-type qwen2.5-vl`): patch side `patch`, 2 x 2 merge,
    two frames a patch, SiLU, windows of 8 patches a side (Qwen2.5-VL's 112 pixels at patch 14),
    full attention in every eighth block (its 7, 15, 23, 31), the last block in towers of fewer;
    features = the 4 patches of a merged token (`models.qwen_encoder`)."""
    if not patch or patch < 1:
        raise ValueError("--vision-model-type qwen2.5-vl needs --patch-dim P (>= 1)")
    want = 4 * 3 * 2 * patch * patch
    if feature_dim not in (None, want):
        raise ValueError(
            f"--encoder-feature-dim {feature_dim}: a Qwen2.5-VL token's features are its 2 x 2 patches of "
            f"two frames, 4 * 3 * 2 * --patch-dim**2 = {want}"
        )
    full = tuple(i for i in range(enc.num_layers) if i % 8 == 7) or (enc.num_layers - 1,)
    return dataclasses.replace(
        enc,
        kind=QWEN_VL,
        patch_size=patch,
        feature_dim=want,
        activation="silu",
        temporal_patch_size=2,
        merge_size=2,
        window_size=8 * patch,
        fullatt_block_indexes=full,
    )


def apply_arch_flags(g: ArchFlags, spec, model: Optional[ModelFlags] = None):
    """`spec` with the language-model and encoder architecture the flags `g` set; the size flags
    given in `model` are checked against them (--num-layers against --hybrid-layer-pattern,
    --encoder-feature-dim against a CLIP or SigLIP encoder's)."""
    model = model or ModelFlags()
    if g.share_embeddings_and_output_weights and g.untie_embeddings_and_output_weights:
        raise ValueError("--share-embeddings-and-output-weights and --untie-embeddings-and-output-weights contradict")
    if g.group_query_attention and g.num_query_groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups N")
    lm = {k: getattr(g, k) for k in _SAME_NAME if getattr(g, k) is not None}
    if "mrope_section" in lm:
        lm["mrope_section"] = tuple(lm["mrope_section"])
    if g.disable_bias_linear:
        lm["add_bias_linear"] = False
    if g.share_embeddings_and_output_weights:
        lm["untie_embeddings_and_output_weights"] = False
    spec = dataclasses.replace(spec, **lm)
    spec = dataclasses.replace(spec, **_rope_scaling(g, spec))
    if g.hybrid_layer_pattern is not None:
        layers = len(g.hybrid_layer_pattern.replace("|", ""))
        given_layers = model.language.get("num_layers")
        if given_layers is not None and given_layers != layers:
            raise ValueError(
                f"--num-layers {given_layers} contradicts --hybrid-layer-pattern {g.hybrid_layer_pattern!r} "
                f"({layers} layers)"
            )
        spec = dataclasses.replace(spec, hybrid_layer_pattern=g.hybrid_layer_pattern, num_layers=layers)
    audio = spec.encoders.get("audio")
    kind = g.vision_model_type
    if kind in VIT_FIELDS:
        if not g.patch_dim or g.patch_dim < 1:
            raise ValueError(f"--vision-model-type {kind} needs --patch-dim P (>= 1)")
        p = g.patch_dim
        feature_dim = model.encoder.get("feature_dim")
        if feature_dim not in (None, 3 * p * p):
            raise ValueError(
                f"--encoder-feature-dim {feature_dim}: a {kind.upper()} encoder's features are "
                f"3 * --patch-dim**2 = {3 * p * p}"
            )
        fields = dict(VIT_FIELDS[kind], kind=kind, patch_size=p, feature_dim=3 * p * p)
        spec = dataclasses.replace(
            spec, encoders={n: dataclasses.replace(e, **fields) for n, e in spec.encoders.items()}
        )
    elif kind == QWEN_VL:
        spec = dataclasses.replace(
            spec,
            encoders={
                n: qwen_encoder(e, g.patch_dim, model.encoder.get("feature_dim")) for n, e in spec.encoders.items()
            },
        )
    elif g.patch_dim is not None:
        raise ValueError("--patch-dim applies to --vision-model-type clip, siglip or qwen2.5-vl")
    if g.audio_model_type == "whisper":
        if audio is None:
            raise ValueError("--audio-model-type whisper needs an encoder module named `audio` in the layout")
        whisper = dataclasses.replace(audio, kind="whisper", activation="gelu", patch_size=0)
        spec = dataclasses.replace(spec, encoders={**spec.encoders, "audio": whisper})
    return spec
