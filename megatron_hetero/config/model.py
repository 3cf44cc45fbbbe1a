"""The model section of a job: the LLaVA-style family's sizes and architecture, described once.

`LlavaSpec` is the whole model (Megatron flag names): the language model, one `EncoderSpec` per
encoder module (its tokens at their placeholder span of the text) and one `OutputSpec` per output
module. Every default of the model lives on these fields, and the fields that have a command-line
flag carry its name and help (`layout.flags`): the model flags every subcommand shares
(`cli/model_flags.py`) are generated from them. What derives from this description:

- the runtime model: `models/llava.py` builds the Megatron modules of a LlavaSpec (and the
  TransformerConfig fields, the dtype and the synthetic data's shape from it);
- the model of `train`'s flags on a layout: `spec_from_flags` (one encoder per encoder module, each
  with the `--encoder-*` sizes; one output head per output module; the layers the layout's segments
  cover);
- the cost model's workload (`planner.model.workload`): one `planner.workload.ModelSpec` per module;
- the benchmarks' models: instances of it (`bench/planner.py`).

A checkpoint records a LlavaSpec (`checkpoint.records.spec_record`; `LlavaSpec.from_record` reads
it back). Pure: no torch (the planner and the CLI's parsers import it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_hetero.layout.flags import default, dest, flag_field, flags_of, option
from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout, RankRange
from megatron_hetero.plan.roles import language_layers, roles
from megatron_hetero.plan.roles import language_modules as roles_language_modules


#: `EncoderSpec.kind` of Qwen2.5-VL's vision tower (`models.qwen_encoder`)
QWEN_VL = "qwen2.5-vl"


@dataclass(frozen=True)
class EncoderSpec:
    """Sizes of one encoder and where its tokens go in the text sequence. The flags (`--encoder-*`)
    size every encoder of a layout alike."""

    num_layers: int = flag_field(
        2, "layers of each encoder (default {default})", flag="--encoder-num-layers", group="encoder", given=True
    )
    hidden_size: int = flag_field(
        32, "hidden size of each encoder (default {default})", flag="--encoder-hidden-size", group="encoder", given=True
    )
    num_attention_heads: int = flag_field(
        4,
        "attention heads of each encoder (default {default})",
        flag="--encoder-num-attention-heads",
        group="encoder",
        given=True,
    )
    tokens: int = flag_field(
        8,
        "encoder tokens per sample, e.g. image patches (default {default})",
        flag="--encoder-tokens",
        group="encoder",
        given=True,
    )
    feature_dim: int = flag_field(
        24,
        "input features per encoder token (default {default})",
        flag="--encoder-feature-dim",
        group="encoder",
        given=True,
    )
    # variable image tokens (`data.samples`, `models.llava_runner`): K >= 1 tiles of `tokens` tokens each at
    # most per sample (0..K per sample: text-only samples have none), placed by the sample's image mask
    max_tiles: int = flag_field(
        0,
        "variable image tokens: each sample carries 0..K tiles (image crops) of --encoder-tokens tokens, "
        "the synthetic data draws the count per sample (default {default}: every sample has exactly "
        "--encoder-tokens tokens)",
        flag="--encoder-max-tiles",
        group="encoder",
        given=True,
    )
    offset: int = 1
    # "linear": the features go through a linear patch embedding + learned positions + a GPT-style
    # trunk (the default); "clip": Megatron's CLIPViTModel (patch convolution over the image the
    # features are the patches of, class token, learned positions, ln_pre, pre-norm LayerNorm
    # layers with quick-GELU, ln_post kept for the pooled output): `models.clip_encoder`.
    kind: str = "linear"
    patch_size: int = 0  # clip: the patch side (features = 3 * patch_size**2 per token)
    ffn_hidden_size: Optional[int] = None  # clip: the MLP width (default 4 * hidden_size)
    norm_epsilon: float = 1e-5
    activation: str = "quick_gelu"  # clip: quick_gelu or gelu; siglip: gelu_pytorch_tanh or gelu
    # "siglip": Megatron's CLIPViTModel siglip variant (patch convolution with bias, learned positions,
    # no class token, no ln_pre, the same layers; `models.siglip_encoder`). post_norm: its features
    # pass through the post LayerNorm (Hugging Face's last_hidden_state), else they are the last kept
    # layer's output (hidden_states[k]) and the norm is only kept; pooling_head: the tower's
    # attention-pooling head (`head.*`) is kept (never trains; the pooled output only)
    post_norm: bool = False
    pooling_head: bool = False
    # "qwen2.5-vl": Qwen2.5-VL's vision tower (`models.qwen_encoder` on `models.qwen_vision`: Conv3d
    # patch embedding, 2-D RoPE, window attention with full attention in `fullatt_block_indexes`,
    # RMSNorm, SwiGLU, the merge x merge patch merger into the language model's width). One image a
    # sample at a fixed size: `tokens` merged tokens in `image_rows` rows (0: a square), each token's
    # features the merge**2 patches it merges side by side (feature_dim = merge**2 * 3 *
    # temporal_patch_size * patch_size**2, in the Qwen image processor's patch order);
    # ffn_hidden_size is the tower's intermediate_size, activation "silu"
    temporal_patch_size: int = 2
    merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = ()
    image_rows: int = 0
    # "whisper": Whisper's speech encoder (two 1-D convolutions, sinusoidal positions, pre-LN layers,
    # final LayerNorm; `models.whisper_encoder`): feature_dim = 2 * mel bins (two log-mel frames a
    # token), tokens = the most speech tokens (max_source_positions)

    @property
    def stage_tokens(self) -> int:
        """The sequence one sample hands between this encoder's pipeline stages: a Qwen2.5-VL tower's
        patches before their merge (tokens * merge**2, window order), any other encoder's tokens."""
        return self.tokens * self.merge_size**2 if self.kind == QWEN_VL else self.tokens


@dataclass(frozen=True)
class OutputSpec:
    """One output module: reads the language model's final hidden states at text positions
    [offset, offset + tokens) and maps them through an MLP of width `hidden_size` to `out_dim`."""

    tokens: int = 4
    offset: int = 24
    hidden_size: int = 32
    out_dim: int = 16


# Megatron-LM's --transformer-impl choices (`LlavaSpec.transformer_impl`)
TRANSFORMER_IMPLS = ("local", "transformer_engine")


@dataclass(frozen=True)
class LlavaSpec:
    """Sizes of the whole model (Megatron flag names)."""

    num_layers: int = flag_field(
        2,
        "language-model layers (default: {default}, or what the layout's segments' `layers` cover)",
        group="language",
        given=True,
    )
    hidden_size: int = flag_field(64, "language-model hidden size (default {default})", group="language", given=True)
    num_attention_heads: int = flag_field(
        4, "language-model attention heads (default {default})", group="language", given=True
    )
    ffn_hidden_size: Optional[int] = flag_field(
        None, "language-model MLP hidden size (default 4 * --hidden-size)", group="language", given=True
    )
    vocab_size: int = flag_field(128, "vocabulary size (default {default})", group="language", given=True)
    seq_length: int = flag_field(
        32,
        "tokens per sample (default {default}; conversation data: the data's, see docs/data.md)",
        group="language",
        given=True,
    )
    encoders: dict[str, EncoderSpec] = field(default_factory=lambda: {"vision": EncoderSpec()})
    seed: int = flag_field(1234, group="training")  # also the synthetic data's and the caption stream's seed
    # Megatron's MoE flags: MoE MLPs in the language model (ep/expt_tp come from the layout)
    num_experts: Optional[int] = flag_field(None, "experts per MoE layer (default: dense MLPs)", group="moe")
    moe_router_topk: int = flag_field(2, "experts per token (default {default})", group="moe")
    moe_aux_loss_coeff: float = flag_field(0.0, "load-balancing loss weight (default 0)", group="moe")
    moe_ffn_hidden_size: Optional[int] = flag_field(
        None, "expert MLP hidden size (default --ffn-hidden-size)", group="moe"
    )
    outputs: dict[str, OutputSpec] = field(default_factory=dict)
    # Megatron's --bf16 (`config.optim.OptimConfig.bf16` carries the flag: it sets both): bf16
    # parameters and compute (the optimizer keeps fp32 main weights)
    bf16: bool = False
    # Megatron's --fp16 (`config.optim.OptimConfig.fp16` carries the flag): fp16 parameters and compute
    fp16: bool = False
    # Language-model architecture (Megatron's TransformerConfig / GPTModel options; the defaults are
    # the original tiny GPT; a Llama/Qwen2-style model: RMSNorm, swiglu, rope, no linear biases,
    # grouped-query attention, QKV bias for Qwen2, tied embeddings for the small Qwen2 models).
    # Megatron-LM's architecture flags set them (`config.arch`).
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    # Megatron's --use-rope-scaling / --rope-scaling-factor: Llama 3.1+'s rope frequency scaling
    # (low_freq_factor 1, high_freq_factor 4, original context 8192: what Megatron-core fixes)
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = True
    # Qwen2.5-VL's M-RoPE (`position_embedding_type` "mrope", Megatron's `mrope_section`): the rotary
    # channels in three sections of temporal, height and width position ids (`models.qwen_encoder.
    # mrope_ids`); they sum to the head dimension / 2
    mrope_section: Optional[tuple[int, int, int]] = None
    # Sequence packing (Megatron's --reset-position-ids / --reset-attention-mask with EOD-separated
    # documents, `megatron.core.datasets.gpt_dataset`'s masks): attention stays inside each document
    # and positions restart after every EOD token (`models.llava_runner`)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    # synthetic documents (`data.documents`): `documents` P >= 1 documents of at most seq_length // P
    # tokens (EOD included) each; `pack_documents`: P of them per sequence, else one per sequence
    # (the unpacked run of the same documents)
    documents: int = 0
    pack_documents: bool = True
    # Megatron-LM's --transformer-impl: "local" (Megatron-core's own modules, the default) or
    # "transformer_engine" (its TE layer specs: GPU machines only; `models.layer_specs`)
    transformer_impl: str = "local"
    # Megatron's --hybrid-layer-pattern: the language model is Megatron-core's HybridModel over these
    # layers (`*` attention, `-` MLP, `E` MoE, `M` Mamba, `|` pipeline stage; `models.hybrid_lm`), and
    # num_layers counts them; None: the GPT path (GPTModel, num_layers attention+MLP layers)
    hybrid_layer_pattern: Optional[str] = None

    @classmethod
    def from_record(cls, record: dict, seed: int = 1234) -> "LlavaSpec":
        """The spec a checkpoint recorded (`checkpoint.records.spec_record`); ValueError naming an
        unknown field (a checkpoint of a newer model family)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"the checkpoint's model has fields this build does not know: {unknown}")
        enc_known = {f.name for f in dataclasses.fields(EncoderSpec)}
        out_known = {f.name for f in dataclasses.fields(OutputSpec)}
        d = dict(record)
        for name, e in d.get("encoders", {}).items():
            if set(e) - enc_known:
                raise ValueError(f"the checkpoint's encoder {name} has unknown fields {sorted(set(e) - enc_known)}")
        d["encoders"] = {n: EncoderSpec(**_tuples(e)) for n, e in d.get("encoders", {}).items()}
        d["outputs"] = {
            n: OutputSpec(**{k: v for k, v in o.items() if k in out_known}) for n, o in d.get("outputs", {}).items()
        }
        if d.get("mrope_section") is not None:
            d["mrope_section"] = tuple(d["mrope_section"])
        return cls(**d, seed=seed)


def _tuples(record: dict) -> dict:
    """A recorded encoder with its tuple fields back as tuples (JSON keeps lists)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}


# The model flags every subcommand shares (`cli/model_flags.py`), in --help order: the language
# model's sizes, then each encoder's. (The batch flags beside them are the job's:
# `config.job.JobConfig`.)
LANGUAGE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size")
ENCODER_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "tokens", "feature_dim", "max_tiles")
MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_aux_loss_coeff", "moe_ffn_hidden_size")
# sizes that must be >= 1 (ffn_hidden_size: None or a size, as Megatron takes it)
_POSITIVE = {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size", "tokens", "feature_dim"}


def size_flags() -> list[dataclasses.Field]:
    """The fields of the shared size flags: the language model's, then the encoders'."""
    return flags_of(LlavaSpec, LANGUAGE_FLAGS) + flags_of(EncoderSpec, ENCODER_FLAGS)


@dataclass(frozen=True)
class ModelFlags:
    """The model flags a front end was given, read once at its door (`cli.train_door.model_flags`):
    the language model's size flags given (field name -> value; a flag not given is absent), one
    encoder's (`--encoder-*`: every encoder alike), the MoE flags that are not None (Megatron's:
    their defaults included) and --seed. What the floors below take instead of the flags."""

    language: dict[str, Any] = field(default_factory=dict)
    encoder: dict[str, Any] = field(default_factory=dict)
    moe: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234

    @classmethod
    def from_dests(cls, values: dict[str, Any]) -> "ModelFlags":
        """The flags of `values` (by argparse dest, as `flag_values` writes them; None or absent: not
        given)."""
        lang = {f.name: values[dest(f)] for f in flags_of(LlavaSpec, LANGUAGE_FLAGS) if values.get(dest(f)) is not None}
        enc = {f.name: values[dest(f)] for f in flags_of(EncoderSpec, ENCODER_FLAGS) if values.get(dest(f)) is not None}
        moe = {f.name: values[dest(f)] for f in flags_of(LlavaSpec, MOE_FLAGS) if values.get(dest(f)) is not None}
        seed = values.get("seed")
        return cls(language=lang, encoder=enc, moe=moe, seed=LlavaSpec.seed if seed is None else int(seed))


def check_sizes(spec: LlavaSpec, encoder: EncoderSpec) -> None:
    """ValueError, naming the flags, for sizes the model cannot be built with: the language model's
    and one encoder's (every encoder of `spec_from_flags` has the same sizes)."""
    for f, v in [(f, getattr(spec, f.name)) for f in flags_of(LlavaSpec, LANGUAGE_FLAGS)] + [
        (f, getattr(encoder, f.name)) for f in flags_of(EncoderSpec, ENCODER_FLAGS)
    ]:
        if f.name in _POSITIVE and v < 1:
            raise ValueError(f"{option(f)} must be >= 1, got {v}")
    if encoder.max_tiles < 0:
        raise ValueError(f"--encoder-max-tiles must be >= 0, got {encoder.max_tiles}")
    if encoder.hidden_size % encoder.num_attention_heads:
        raise ValueError(
            f"--encoder-hidden-size {encoder.hidden_size} is not divisible by "
            f"--encoder-num-attention-heads {encoder.num_attention_heads}"
        )


def spec_from_flags(flags: ModelFlags, layout: Optional[HeteroLayout] = None) -> LlavaSpec:
    """The model the size flags given in `flags` describe (a flag not given: the field's default), on
    `layout` (`spec_on_layout`; --num-layers not given: the layers the layout's language segments
    cover). Without a layout: one encoder, `vision` (what `search` plans). ValueError for sizes the
    model cannot be built with."""
    lang = {f.name: flags.language.get(f.name, default(f)) for f in flags_of(LlavaSpec, LANGUAGE_FLAGS)}
    encoder = EncoderSpec(
        **{f.name: flags.encoder.get(f.name, default(f)) for f in flags_of(EncoderSpec, ENCODER_FLAGS)}
    )
    if layout is not None and "num_layers" not in flags.language:
        lang["num_layers"] = language_layers(layout, lang["num_layers"])
    sizes = LlavaSpec(**lang, encoders={"vision": encoder})
    check_sizes(sizes, encoder)
    return sizes if layout is None else spec_on_layout(layout, sizes, encoder)


def spec_on_layout(
    layout: HeteroLayout, sizes: Optional[LlavaSpec] = None, encoder: Optional[EncoderSpec] = None
) -> LlavaSpec:
    """`sizes` (default: LlavaSpec's, with the layers the layout's language segments cover) with one
    encoder per module before the language model, each `encoder` (default EncoderSpec's sizes) with
    its tokens right after the previous encoder's from text position 1, and one output head per
    module after it, each reading the 4 text positions before the previous one's, from the end."""
    if sizes is None:
        sizes = LlavaSpec(num_layers=language_layers(layout, LlavaSpec().num_layers))
    encoder = encoder or EncoderSpec()
    who = roles(layout)
    encoders, offset = {}, 1
    for m in layout.modules:
        if m.name in who.language or m.name in who.outputs:
            continue
        encoders[m.name] = dataclasses.replace(encoder, offset=offset)
        offset += encoder.tokens * max(1, encoder.max_tiles)  # the span its placeholders may take
    outputs = {n: OutputSpec(tokens=4, offset=sizes.seq_length - 4 * (k + 1)) for k, n in enumerate(who.outputs)}
    return dataclasses.replace(sizes, encoders=encoders, outputs=outputs)


def flag_values(spec: LlavaSpec, keep_none: bool = False) -> dict[str, Any]:
    """The size flags' values of `spec` with one encoder, by dest ({'num_layers': 2, ...,
    'encoder_feature_dim': 24}); a size left to its rule (ffn_hidden_size None) is left out unless
    `keep_none`. `spec_from_flags(ModelFlags.from_dests(...))` of them gives `spec` back."""
    (e,) = spec.encoders.values()
    out = {dest(f): getattr(spec, f.name) for f in flags_of(LlavaSpec, LANGUAGE_FLAGS)}
    out.update({dest(f): getattr(e, f.name) for f in flags_of(EncoderSpec, ENCODER_FLAGS)})
    return {k: v for k, v in out.items() if keep_none or v is not None}


def language_modules(layout: HeteroLayout, spec: LlavaSpec) -> list[ModuleLayout]:
    """The language-model modules in layer order (`plan.roles`'s rule), checked against the model:
    segments must cover exactly layers 0..num_layers-1."""
    mods = roles_language_modules(layout)
    last = mods[-1].layers
    if mods[0].layers is not None and last is not None and last.end + 1 != spec.num_layers:
        raise ValueError(f"language segments cover layers 0-{last.end} but --num-layers is {spec.num_layers}")
    return mods


def segment_layers(m: ModuleLayout, spec: LlavaSpec) -> RankRange:
    """The language layers module `m` holds (all of them for a language model in one module)."""
    return m.layers if m.layers is not None else RankRange(0, spec.num_layers - 1)
