"""A whole `LlavaForConditionalGeneration` folder <-> a megatron-hetero checkpoint
(`megatron-hetero convert hf-to-checkpoint --model HF_DIR`, `checkpoint-to-hf DIR --model --out OUT`).

    llava_to_checkpoint(HF_DIR, out=DIR)        one LLaVA folder -> the same checkpoint the two-folder
                                                form writes (`convert.hf_weights`)
    checkpoint_to_llava(DIR, out=OUT, like=None) -> OUT/config.json + OUT/model.safetensors (+ the
                                                processor and tokenizer files), loadable with
                                                `LlavaForConditionalGeneration.from_pretrained(OUT)`

In: the LLaVA config.json is read and checked first (`models.hf_llava.read_llava`: tower, language
model, feature layer, selection strategy, projector; refusals name the option), the tower is cut at
`vision_feature_layer` (LLaVA reads `hidden_states[layer]`; transformers (4.57) puts the tower's
`last_hidden_state` there as the last entry, so a SigLIP tower read at -1 has its post LayerNorm
applied, at any other layer not), then the safetensors headers are split into the three parts by name
prefix and each part is checked and converted as in the two-folder form (`hf_weights.convert_sources`).
The checkpoint keeps, under `hf/`: the tower's and the language model's config.json (as the
two-folder form does), the whole LLaVA config.json as `hf/llava/config.json` (image token id,
pad token, ...) and the folder's processor and tokenizer files (chat template included) under
`hf/llava/`.

Out: the checkpoint's parts as in `checkpoint-to-hf` (`hf_export.hf_parts`), joined under LLaVA's
legacy names (`vision_tower.`, `multi_modal_projector.`, `language_model.`) in one
model.safetensors, with a LLaVA config.json around the tower's and the language model's: the
converted folder's own (kept in the checkpoint, or `like`: the LLaVA folder it came from, for a
checkpoint `train --save` wrote, which keeps no hf/ folder), with `vision_feature_layer` -1 (the
written tower ends at the feature layer) and the strategy of the tower. Without either, the image
token id is 0 (`data.samples.PLACEHOLDER_ID`). A SigLIP tower cut before its last layer (features
without the post LayerNorm) has no LLaVA form: the written tower would end at the feature layer and
transformers would apply the post LayerNorm there; refused (the three-part form writes it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from megatron_hetero.convert.hf_export import hf_parts
from megatron_hetero.convert.hf_weights import (
    HF_DIR,
    LANGUAGE,
    VISION,
    Source,
    _Reader,
    convert_sources,
    spec_from_configs,
    tensor_index,
    with_hybrid_pattern,
)
from megatron_hetero.models import hf_config, hf_llava

LLAVA = "llava"  # the whole config.json and the processor files under hf/llava/


def processor_files(folder: Path) -> dict[str, Path]:
    """The processor's and tokenizer's files of a LLaVA folder (relative name -> path): every
    top-level file with a known suffix but the weights' and the model's config."""
    return {
        f"{LLAVA}/{p.name}": p
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix in hf_llava.PROCESSOR_SUFFIXES and p.name not in hf_llava.WEIGHT_FILES
    }


def split_parts(shapes: dict, where: str) -> dict[str, dict[str, str]]:
    """{part: {the part's own name: the whole-model name}}; ValueError naming names of no part."""
    parts: dict[str, dict[str, str]] = {"vision": {}, "language": {}, "projector": {}}
    stray = []
    for name in shapes:
        got = hf_llava.split_name(name)
        if got is None:
            stray.append(name)
            continue
        parts[got[0]][got[1]] = name
    if stray:
        raise ValueError(
            f"{where}: tensors of no LLaVA part (vision_tower, multi_modal_projector, language_model): {sorted(stray)[:8]}"
        )
    return parts


def llava_to_checkpoint(
    model: str | Path, out: str | Path, seq_length: Optional[int] = None, hybrid_layer_pattern: Optional[str] = None
) -> dict:
    """Convert one LLaVA folder (module docstring); returns `convert_sources`'s summary plus
    `image_token_index`. `hybrid_layer_pattern`: the language model as Megatron's HybridModel
    (`hf_weights.with_hybrid_pattern`)."""
    folder = Path(model)
    where = f"--model {folder}"
    cfg = hf_config.read_config(folder)
    llava = hf_llava.read_llava(cfg, where)
    spec = spec_from_configs(
        llava["vision"],
        llava["language"],
        f"{where} vision_config",
        f"{where} text_config",
        seq_length,
        feature_layer=llava["feature_layer"],
        last_hidden_state=True,  # transformers' hidden_states[-1] is last_hidden_state (see models.hf_llava)
    )
    spec = with_hybrid_pattern(spec, hybrid_layer_pattern)
    shapes, files = tensor_index(folder)
    parts = split_parts(shapes, where)
    read = _Reader(files)

    def source(part: str) -> Source:
        names = parts[part]
        return Source(
            {own: shapes[full] for own, full in names.items()}, lambda own: read(names[own]), f"{where} ({part})"
        )

    summary = convert_sources(
        spec,
        source("vision"),
        source("language"),
        source("projector"),
        out,
        origin={"model": str(folder)},
        configs={VISION: llava["vision"], LANGUAGE: llava["language"], LLAVA: cfg},
        extra_files={k: v for k, v in processor_files(folder).items() if k != f"{LLAVA}/config.json"},
    )
    summary["image_token_index"] = llava["image_token_index"]
    return summary


def checkpoint_to_llava(root: str | Path, out: str | Path, like: Optional[str | Path] = None) -> Path:
    """Write the latest checkpoint under `root` as one LLaVA folder (module docstring); returns it."""
    from safetensors.torch import save_file

    from megatron_hetero.models import hf_names

    like_dir = Path(like) if like is not None else None
    like_cfg = None
    if like_dir is not None:
        like_cfg = hf_config.read_config(like_dir)
        hf_llava.read_llava(like_cfg, f"--like {like_dir}")
    parts = hf_parts(root)
    if any(e.kind == "whisper" for e in parts.spec.encoders.values()):
        raise ValueError(
            f"checkpoint {parts.directory}: it holds a Whisper speech encoder, which a LLaVA folder cannot: "
            "write the parts (without --model)"
        )
    enc = parts.encoder
    if enc.kind == "siglip" and not enc.post_norm:
        raise ValueError(
            f"checkpoint {parts.directory}: its SigLIP tower is cut before its last layer (features without "
            "the post LayerNorm); as a LLaVA folder the tower would end at the feature layer and transformers "
            "applies the post LayerNorm to the last hidden_states entry: write the three parts (without --model)"
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty")
    kept = parts.directory / HF_DIR / LLAVA
    saved = json.loads((kept / "config.json").read_text()) if (kept / "config.json").is_file() else None
    cfg = hf_llava.llava_config_json(
        _tower_only(parts.configs[VISION]),
        parts.configs[LANGUAGE],
        enc.tokens,
        siglip=enc.kind == "siglip",
        like=like_cfg or saved,
    )
    tensors = {hf_llava.join_name(part, k): v for part, t in parts.tensors.items() for k, v in t.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_names.contiguous(tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    extra = processor_files(like_dir) if like_dir is not None else {}
    if not extra and kept.is_dir():
        extra = {f"{LLAVA}/{p.name}": p for p in sorted(kept.iterdir()) if p.is_file()}
    for rel, src in extra.items():
        name = rel.split("/", 1)[1]
        if name != "config.json":
            shutil.copyfile(src, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return out


def _tower_only(cfg: dict) -> dict:
    """A tower's config.json; a full CLIPModel's / SiglipModel's (two-folder form) -> its vision_config."""
    if cfg.get("model_type") in ("clip", "siglip"):
        return hf_config.vision_tower_config(cfg, "vision")
    return cfg
