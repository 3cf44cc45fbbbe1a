"""The architecture options of the model family (language model: Megatron's `TransformerConfig` /
`GPTModel` options; encoders: the tiny linear-patch trunk, a CLIP or a SigLIP ViT) checked against each other
and the layout, before any process group exists. Pure: no torch."""

from __future__ import annotations

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.layout.validate import check_heads
from megatron_hetero.models.hybrid_pattern import check_pattern, check_pipeline, pattern_layers
from megatron_hetero.config.model import QWEN_VL

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "mrope")
ENCODER_KINDS = ("linear", "clip", "siglip", "whisper", "qwen2.5-vl")
CLIP_ACTIVATIONS = ("quick_gelu", "gelu")
SIGLIP_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
VIT_KINDS = ("clip", "siglip")  # Megatron's CLIPViTModel: a square RGB image cut into patches
#: why a Qwen2.5-VL tower with native-resolution images (`max_tiles`) keeps one pipeline stage
PP_NATIVE_REASON = (
    "a Qwen2.5-VL tower with native-resolution images (max_tiles) runs with pp 1: the images of a call "
    "vary in number and size, so the hidden states between tower stages have no one static shape"
)
#: why a Qwen2.5-VL tower keeps cp 1
CP_REASON = (
    "a Qwen2.5-VL tower runs with cp 1: its windows and images are attention segments over the patches "
    "of whole images (not a text sequence), which a context-parallel split of the sequence would cut"
)


def check_architecture(layout: HeteroLayout, spec, langs) -> None:
    """The architecture options against each other and the layout; ValueError with the reason."""
    if spec.normalization not in NORMALIZATIONS:
        raise ValueError(f"--normalization {spec.normalization!r}: one of {NORMALIZATIONS}")
    if spec.position_embedding_type not in POSITION_EMBEDDINGS:
        raise ValueError(f"--position-embedding-type {spec.position_embedding_type!r}: one of {POSITION_EMBEDDINGS}")
    groups = spec.num_query_groups or spec.num_attention_heads
    if spec.num_attention_heads % groups:
        raise ValueError(
            f"--num-query-groups {groups} does not divide --num-attention-heads {spec.num_attention_heads}"
        )
    for name in langs:
        m = layout.module(name)
        if m.tp > 1 and groups % m.tp:
            raise ValueError(f"module {name}: {groups} query groups are not divisible by tp({m.tp})")
        if m.tp > 1 and spec.vocab_size % m.tp:
            raise ValueError(f"module {name}: --vocab-size {spec.vocab_size} is not divisible by tp({m.tp})")
        if not spec.untie_embeddings_and_output_weights and (m.pp > 1 or len(langs) > 1):
            raise ValueError(
                f"module {name}: tied input and output embeddings need the whole language model on "
                f"one pipeline stage (pp 1, no segments); got {m.arithmetic()}"
            )
    if spec.hybrid_layer_pattern is not None:
        check_hybrid(layout, spec, langs)
    check_mrope(spec)
    for name, enc in spec.encoders.items():
        if enc.kind not in ENCODER_KINDS:
            raise ValueError(f"encoder {name}: kind {enc.kind!r}, one of {ENCODER_KINDS}")
        if enc.kind == "whisper" and name in layout.names:
            check_whisper(name, enc, layout)
        if enc.kind == QWEN_VL and name in layout.names:
            check_qwen(name, enc, layout, spec)
        if enc.kind not in VIT_KINDS or name not in layout.names:
            continue
        m = layout.module(name)
        if m.pp > 1:
            raise ValueError(f"encoder {name}: Megatron's CLIPViTModel runs on one pipeline stage; got pp({m.pp})")
        acts = SIGLIP_ACTIVATIONS if enc.kind == "siglip" else CLIP_ACTIVATIONS
        if enc.activation not in acts:
            raise ValueError(f"encoder {name}: activation {enc.activation!r}, one of {acts} for a {enc.kind} encoder")
        side = round(enc.tokens**0.5)
        if enc.patch_size < 1 or side * side != enc.tokens or enc.feature_dim != 3 * enc.patch_size**2:
            raise ValueError(
                f"encoder {name}: a {enc.kind.upper()} encoder takes a square RGB image cut into patches: tokens "
                f"{enc.tokens} must be a square and feature_dim {enc.feature_dim} = 3 * patch_size**2 "
                f"(patch_size {enc.patch_size})"
            )


def check_whisper(name: str, enc, layout: HeteroLayout) -> None:
    """A Whisper speech encoder (`models.whisper_encoder`) against the layout: one stage, cp 1, heads
    divisible by tp, feature_dim = 2 * mel bins (two log-mel frames a token), an even hidden size."""
    m = layout.module(name)
    if m.pp > 1 or m.cp > 1:
        raise ValueError(f"encoder {name}: a Whisper encoder runs with pp 1 and cp 1; got {m.arithmetic()}")
    check_heads(m, enc.num_attention_heads)
    if enc.feature_dim % 2 or enc.hidden_size % 2:
        raise ValueError(
            f"encoder {name}: a Whisper encoder takes two log-mel frames a token (feature_dim = 2 * mel bins, "
            f"got {enc.feature_dim}) and an even hidden size (got {enc.hidden_size})"
        )


def check_mrope(spec) -> None:
    """M-RoPE (`--position-embedding-type mrope`) and its `mrope_section` go together: three sections
    summing to the head dimension / 2, the image positions from exactly one Qwen2.5-VL encoder."""
    qwen = [n for n, e in spec.encoders.items() if e.kind == QWEN_VL]
    if spec.position_embedding_type != "mrope":
        if spec.mrope_section is not None:
            raise ValueError("--mrope-section needs --position-embedding-type mrope")
        if qwen:
            raise ValueError(
                f"encoder {qwen[0]}: a Qwen2.5-VL tower feeds a language model with M-RoPE "
                f"(--position-embedding-type mrope --mrope-section T H W); got {spec.position_embedding_type}"
            )
        return
    head = spec.kv_channels or spec.hidden_size // spec.num_attention_heads
    sec = spec.mrope_section
    if sec is None or len(sec) != 3 or 2 * sum(sec) != head:
        raise ValueError(f"--mrope-section {sec}: three sections summing to the head dimension / 2 = {head // 2}")
    if len(qwen) != 1:
        raise ValueError(
            f"--position-embedding-type mrope takes its image positions from one Qwen2.5-VL encoder "
            f"(--vision-model-type qwen2.5-vl); the model has {len(qwen)}"
        )
    if spec.rope_scaling or spec.hybrid_layer_pattern is not None or spec.reset_position_ids:
        raise ValueError("--position-embedding-type mrope: no rope scaling, hybrid pattern or position reset")


def check_qwen(name: str, enc, layout: HeteroLayout, spec) -> None:
    """A Qwen2.5-VL tower (`models.qwen_encoder`) against the layout and its image: cp 1 (`CP_REASON`),
    its blocks split evenly over pp, pp 1 with native-resolution images (`PP_NATIVE_REASON`), heads
    divisible by tp, its features the merge**2 patches of a token, the image's rows; with
    `max_tiles` (native resolution: a sample's tiles are one image) one image a row, no packing."""
    m = layout.module(name)
    if m.cp > 1:
        raise ValueError(f"encoder {name}: {CP_REASON}; got {m.arithmetic()}")
    if m.pp > 1 and enc.max_tiles:
        raise ValueError(f"encoder {name}: {PP_NATIVE_REASON}; got {m.arithmetic()}")
    if enc.num_layers % m.pp:
        raise ValueError(f"encoder {name}: the tower's {enc.num_layers} blocks do not split evenly over pp({m.pp})")
    if enc.num_attention_heads % m.tp or (enc.ffn_hidden_size or 4 * enc.hidden_size) % m.tp:
        raise ValueError(f"encoder {name}: heads and MLP width must divide by tp({m.tp})")
    if enc.max_tiles and spec.documents:  # native resolution: one image per row for its M-RoPE ids
        raise ValueError(
            f"encoder {name}: a Qwen2.5-VL tower with max_tiles takes one image a row, not packed documents"
        )
    want = enc.merge_size**2 * 3 * enc.temporal_patch_size * enc.patch_size**2
    side = enc.merge_size * enc.patch_size
    if enc.patch_size < 1 or enc.feature_dim not in (want, side * side, 3 * side * side):
        raise ValueError(
            f"encoder {name}: a Qwen2.5-VL token's features are its merge**2 patches: feature_dim must be "
            f"{enc.merge_size}**2 * 3 * {enc.temporal_patch_size} * patch_size**2 = {want} (or its pixel block, "
            f"C * {side}**2), got {enc.feature_dim} (patch_size {enc.patch_size})"
        )
    rows = enc.image_rows or round(enc.tokens**0.5)
    if rows < 1 or enc.tokens % rows:
        raise ValueError(f"encoder {name}: {enc.tokens} tokens do not make rows of {rows} (image_rows)")
    if enc.offset < 1:
        raise ValueError(f"encoder {name}: the image needs its vision-start token before it (offset >= 1)")


def check_hybrid(layout: HeteroLayout, spec, langs) -> None:
    """A HybridModel language model (`--hybrid-layer-pattern`) against the other options and the
    layout: the pattern's symbols and stages (`models.hybrid_lm.check_pattern` / `check_pipeline`),
    one language module (no segments), no llama3 rope scaling (HybridModel has no such option)."""

    pattern = spec.hybrid_layer_pattern
    check_pattern(pattern, spec.transformer_impl, spec.num_experts)
    if len(pattern_layers(pattern)) != spec.num_layers:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} has {len(pattern_layers(pattern))} layers, --num-layers is {spec.num_layers}"
        )
    if spec.rope_scaling:
        raise ValueError("--use-rope-scaling: Megatron-core 0.19's HybridModel has no rope scaling option")
    if len(langs) > 1:
        raise ValueError("--hybrid-layer-pattern: language segments are not supported; give pp and '|' stages")
    for name in langs:
        check_pipeline(pattern, name, layout.module(name).pp)


# The architecture fields added to `LlavaSpec` / `EncoderSpec` with their defaults (the tiny GPT and
# linear-patch encoder). A checkpoint's model record leaves them out at these values, so checkpoints
# saved before the fields existed still match; `LlavaSpec.from_record` fills them back in.
LANGUAGE_DEFAULTS = {
    "normalization": "LayerNorm",
    "norm_epsilon": 1e-5,
    "swiglu": False,
    "position_embedding_type": "learned_absolute",
    "rotary_base": 10000.0,
    "rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "num_query_groups": None,
    "kv_channels": None,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": True,
    # sequence packing and the synthetic documents (`data.documents`): not architecture, but fields
    # whose defaults keep a record what checkpoints before them hold
    "reset_position_ids": False,
    "reset_attention_mask": False,
    "documents": 0,
    "pack_documents": True,
    "transformer_impl": "local",
    "hybrid_layer_pattern": None,
    "mrope_section": None,
}
ENCODER_DEFAULTS = {
    "kind": "linear",
    "patch_size": 0,
    "ffn_hidden_size": None,
    "norm_epsilon": 1e-5,
    "activation": "quick_gelu",
    "post_norm": False,
    "pooling_head": False,
    "max_tiles": 0,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": (),
    "image_rows": 0,
}


def drop_default_architecture(record: dict) -> None:
    """Remove (in place) the architecture fields at their defaults from a `dataclasses.asdict(LlavaSpec)`."""
    for k, v in LANGUAGE_DEFAULTS.items():
        if k in record and record[k] == v:
            del record[k]
    for enc in record.get("encoders", {}).values():
        for k, v in ENCODER_DEFAULTS.items():
            if k in enc and enc[k] == v:
                del enc[k]
