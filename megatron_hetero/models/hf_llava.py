"""A whole Hugging Face `LlavaForConditionalGeneration` folder <-> the model family (pure: no torch).

One folder holds the vision tower, LLaVA's `multi_modal_projector` and the language model under one
`config.json` (model_type `llava`: `vision_config`, `text_config`, `image_token_index`,
`vision_feature_layer`, `vision_feature_select_strategy`, `projector_hidden_act`, ...) and one
safetensors file set whose names carry the part as a prefix. This file reads that configuration,
decides from it alone (before any weight is read) whether the family can express the model, and
maps the whole-model tensor names to the per-part names `models.hf_names` knows (and back).

What LLaVA computes, and what the family must match:
  * the image features are `hidden_states[vision_feature_layer]` of the tower; transformers 4.57
    (`utils.generic.check_model_inputs`) replaces the LAST entry of hidden_states by the tower's
    `last_hidden_state`, so a SigLIP tower read at layer -1 has its post LayerNorm applied
    (`EncoderSpec.post_norm` True, as the two-folder form's -1), read at any other layer not; for
    CLIP (no LayerNorm in last_hidden_state) both are the layer's output;
  * `vision_feature_select_strategy` "default" drops the first token: the CLIP class token (our
    CLIP encoder drops it); "full" keeps every token: a SigLIP tower (no class token). The other
    two combinations (CLIP "full": the class token would reach the LM; SigLIP "default": the first
    patch is dropped) are refused with the reason;
  * the projector is linear_1 -> `projector_hidden_act` (gelu only: Megatron's MultimodalProjector
    MLP) -> linear_2, with biases; a list of feature layers (concatenated features) is refused.

Tensor names (both forms transformers writes are read): legacy (transformers 4.x `save_pretrained`)
`vision_tower.<tower>`, `multi_modal_projector.*`, `language_model.model.*`,
`language_model.lm_head.weight`; current `model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.language_model.*`, `lm_head.weight`. Written back in the legacy form, which both
transformers 4.57 and later load.
"""

from __future__ import annotations

from typing import Optional

from megatron_hetero.models.hf_config import UnsupportedModel, language_fields, vision_tower_config

LLAVA_TYPE = "llava"
# files of a LLaVA folder that are the processor's and the tokenizer's (copied as they are)
PROCESSOR_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
WEIGHT_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json")

# (whole-model prefix, part, the part's own prefix); first match wins, longest first
_PREFIXES = (
    ("model.vision_tower.", "vision", ""),
    ("model.multi_modal_projector.", "projector", "multi_modal_projector."),
    ("model.language_model.", "language", "model."),
    ("vision_tower.", "vision", ""),
    ("multi_modal_projector.", "projector", "multi_modal_projector."),
    ("language_model.model.", "language", "model."),
    ("language_model.lm_head.", "language", "lm_head."),
    ("lm_head.", "language", "lm_head."),
)


def is_llava(cfg: dict) -> bool:
    return cfg.get("model_type") == LLAVA_TYPE


def read_llava(cfg: dict, where: str = "--model") -> dict:
    """The parts of a LLaVA config.json: {vision: the tower's config (model_type *_vision_model),
    language: text_config, feature_layer: int, image_token_index: int, select: str}; UnsupportedModel
    naming the option the family cannot express."""
    if not is_llava(cfg):
        arch = cfg.get("architectures")
        raise UnsupportedModel(
            f"{where}: model_type {cfg.get('model_type')!r} ({arch}) is not a LlavaForConditionalGeneration "
            "folder (model_type 'llava'); for a separate tower and language model give --vision and --language"
        )
    for key in ("vision_config", "text_config"):
        if not isinstance(cfg.get(key), dict):
            raise ValueError(f"{where}: config.json has no {key!r} object")
    vision = vision_tower_config(cfg["vision_config"], f"{where} vision_config")
    language = dict(cfg["text_config"])
    language.setdefault("model_type", "llama")  # LlavaConfig's default text model
    language_fields(language, f"{where} text_config")  # refuses here, before any weight
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise UnsupportedModel(
            f"{where}: vision_feature_layer {layer!r}: several feature layers (concatenated) are not "
            "supported; one layer index only"
        )
    act = cfg.get("projector_hidden_act", "gelu")
    if act != "gelu":
        raise UnsupportedModel(
            f"{where}: projector_hidden_act {act!r} is not supported (the projector is Megatron's "
            "MultimodalProjector MLP: linear -> gelu -> linear)"
        )
    if cfg.get("multimodal_projector_bias", True) is not True:
        raise UnsupportedModel(f"{where}: multimodal_projector_bias false is not supported (the projector has biases)")
    select = cfg.get("vision_feature_select_strategy", "default")
    siglip = vision["model_type"].startswith("siglip")
    if select == "default" and siglip:
        raise UnsupportedModel(
            f"{where}: vision_feature_select_strategy 'default' with a SigLIP tower drops its first patch "
            "(SigLIP has no class token); the SigLIP encoder passes every patch ('full')"
        )
    if select == "full" and not siglip:
        raise UnsupportedModel(
            f"{where}: vision_feature_select_strategy 'full' with a CLIP tower keeps the class token; "
            "the CLIP encoder drops it ('default', LLaVA's own setting)"
        )
    if select not in ("default", "full"):
        raise UnsupportedModel(f"{where}: vision_feature_select_strategy {select!r} (known: default, full)")
    return {
        "vision": vision,
        "language": language,
        "feature_layer": layer,
        "image_token_index": int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))),
        "select": select,
    }


def split_name(name: str) -> Optional[tuple[str, str]]:
    """(part, the part's own Hugging Face name) of a whole-model tensor name; None for a name of no
    part (the caller reports it as unexpected)."""
    for prefix, part, own in _PREFIXES:
        if name.startswith(prefix):
            return part, own + name[len(prefix) :]
    return None


def join_name(part: str, name: str) -> str:
    """The legacy whole-model name of a part's tensor (`split_name`'s inverse for the legacy form)."""
    if part == "vision":
        return "vision_tower." + name
    if part == "projector":
        return name  # already multi_modal_projector.*
    return "language_model." + name  # model.* and lm_head.weight


def llava_config_json(vision: dict, language: dict, tokens: int, siglip: bool, like: Optional[dict] = None) -> dict:
    """A LLaVA config.json around a tower's and a language model's config.json. `like`: the original
    LLaVA config (its image token, pad token, etc. are kept); the feature layer is -1 (the written
    tower ends at the converted feature layer) and the strategy is the tower's."""
    out = dict(like or {})
    for key in ("transformers_version", "torch_dtype", "dtype"):
        out.pop(key, None)
    out.update(
        architectures=["LlavaForConditionalGeneration"],
        model_type=LLAVA_TYPE,
        vision_config={k: v for k, v in vision.items() if k != "architectures"},
        text_config={k: v for k, v in language.items() if k != "architectures"},
        vision_feature_layer=-1,
        vision_feature_select_strategy="full" if siglip else "default",
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        image_seq_length=tokens,
        torch_dtype="float32",
    )
    out.setdefault("image_token_index", 0)  # data.samples.PLACEHOLDER_ID when no original config is given
    out["tie_word_embeddings"] = bool(language.get("tie_word_embeddings", False))
    return out
