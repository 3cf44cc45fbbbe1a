"""A whole `Qwen2_5_VLForConditionalGeneration` folder <-> a megatron-hetero checkpoint
(`convert hf-to-checkpoint --model HF_DIR` when the folder's config.json is Qwen2.5-VL's;
`checkpoint-to-hf DIR --model --out OUT` for a checkpoint of that model).

    is_qwen_vl(HF_DIR)                                  the folder's config.json model_type is qwen2_5_vl
    qwen_to_checkpoint(HF_DIR, out=DIR, image_size=(H, W), seq_length=None)
    checkpoint_to_qwen(DIR, out=OUT, like=None)         -> OUT/config.json + model.safetensors (+ files)

In: `convert.hf_qwen_vl.read_qwen_vl` (config and names checked, every tensor placed or refused by
name); the model becomes the family's `LlavaSpec`: the language model a Qwen2.5 decoder with M-RoPE
(`position_embedding_type` "mrope", the config's `mrope_section`), the `vision` encoder of kind
"qwen2.5-vl" (`models.qwen_encoder`) at a fixed image size: `image_size` (H, W) pixels, each a
multiple of patch_size * spatial_merge_size, giving (H / (p*m)) x (W / (p*m)) merged tokens at
text position 1 (after the vision-start token). `seq_length` default: max_position_embeddings, at
most 2048, at least the image tokens + 64. The tensors load into the whole modules (the tower's
under `tower.`, the decoder's under `gpt.`) and are written as iteration 0, weights only; the
config.json and the folder's processor and tokenizer files are kept under `hf/qwen2_5_vl/`.

Out: the two modules' whole states back under the hub's names (`convert.hf_qwen_vl.write_qwen_vl`)
with the kept config.json (or `like`'s, for a checkpoint `train --save` wrote) and processor files.
The round trip returns every tensor bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from megatron_hetero.convert.hf_weights import (
    HF_DIR,
    LANGUAGE,
    VISION,
    _load_whole,
    build_whole,
    world_of_one,
    world_of_one_layout,
    write_checkpoint,
)
from megatron_hetero.checkpoint.files import read_train_state, verify_manifest

QWEN_VL = "qwen2_5_vl"  # the model_type, and the folder under hf/ keeping its config and files
PROCESSOR_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_SKIP = ("config.json", "model.safetensors.index.json")


def is_qwen_vl(folder: str | Path) -> bool:
    """Whether `folder`'s config.json says Qwen2.5-VL (model_type `qwen2_5_vl`)."""
    p = Path(folder) / "config.json"
    return p.is_file() and json.loads(p.read_text()).get("model_type") == QWEN_VL


def parse_image_size(text: str) -> tuple[int, int]:
    """'448x336' -> (448, 336) (height x width in pixels); ValueError otherwise."""
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size {text!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448") from None
    if h < 1 or w < 1:
        raise ValueError(f"--image-size {text!r}: both sides must be >= 1")
    return h, w


def spec_from_qwen(cfg: dict, image_size: tuple[int, int], seq_length: Optional[int] = None):
    """The family's `LlavaSpec` of a Qwen2.5-VL config.json (module docstring); ValueError for an
    image size the tower cannot cut or a sequence too short for its tokens."""
    from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
    from megatron_hetero.models.qwen_vision import QwenVisionSpec
    from megatron_hetero.models.qwen_vl import QwenTextSpec

    v, t = QwenVisionSpec.from_hf(cfg["vision_config"]), QwenTextSpec.from_hf(cfg.get("text_config") or cfg)
    v.check()
    unit = v.patch_size * v.spatial_merge_size
    h, w = image_size
    if h % unit or w % unit:
        raise ValueError(
            f"--image-size {h}x{w}: both sides must be multiples of patch_size * spatial_merge_size = {unit}"
        )
    rows, cols = h // unit, w // unit
    tokens = rows * cols
    seq = seq_length or max(min(t.max_position_embeddings, 2048), tokens + 64)
    if seq < tokens + 2:
        raise ValueError(f"--seq-length {seq}: the image's {tokens} tokens and its start and end need {tokens + 2}")
    enc = EncoderSpec(
        kind="qwen2.5-vl",
        num_layers=v.depth,
        hidden_size=v.hidden_size,
        num_attention_heads=v.num_heads,
        ffn_hidden_size=v.intermediate_size,
        tokens=tokens,
        image_rows=rows,
        feature_dim=v.spatial_merge_size**2 * v.in_channels * v.temporal_patch_size * v.patch_size**2,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size,
        window_size=v.window_size,
        fullatt_block_indexes=tuple(v.fullatt_block_indexes),
        activation=v.hidden_act,
        offset=1,
    )
    return LlavaSpec(
        num_layers=t.num_hidden_layers,
        hidden_size=t.hidden_size,
        num_attention_heads=t.num_attention_heads,
        ffn_hidden_size=t.intermediate_size,
        vocab_size=t.vocab_size,
        seq_length=seq,
        encoders={VISION: enc},
        normalization="RMSNorm",
        norm_epsilon=t.rms_norm_eps,
        swiglu=True,
        position_embedding_type="mrope",
        mrope_section=tuple(t.mrope_section),
        rotary_base=float(t.rope_theta),
        num_query_groups=t.num_key_value_heads,
        add_bias_linear=False,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=not t.tie_word_embeddings,
    )


def _files(folder: Path) -> dict[str, Path]:
    return {
        f"{QWEN_VL}/{p.name}": p
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix in PROCESSOR_SUFFIXES and p.name not in _SKIP
    }


def qwen_to_checkpoint(
    model: str | Path, out: str | Path, image_size: tuple[int, int], seq_length: Optional[int] = None
) -> dict:
    """Convert one Qwen2.5-VL folder (module docstring); returns the summary `convert` prints."""
    from megatron_hetero.convert.hf_qwen_vl import read_qwen_vl

    folder, out = Path(model), Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty")
    cfg, parts = read_qwen_vl(folder)
    spec = spec_from_qwen(cfg, image_size, seq_length)
    layout = world_of_one_layout([VISION])
    vision = {"tower." + k: v for k, v in parts["vision"].items()}
    language = {"gpt." + k: v for k, v in parts["language"].items()}
    with world_of_one(layout) as topo:
        states = build_whole(layout, spec, topo)
        _load_whole(states[VISION].module, vision, f"--model {folder} (vision)")
        _load_whole(states[LANGUAGE].module, language, f"--model {folder} (language)")
        d = write_checkpoint(
            out,
            layout,
            spec,
            states,
            origin={"model": str(folder)},
            configs={QWEN_VL: cfg},
            extra_files=_files(folder),
        )
    return {
        "directory": str(d),
        "model": spec,
        "tensors": {VISION: len(vision), LANGUAGE: len(language)},
        "image_token_id": cfg.get("image_token_id"),
    }


def checkpoint_states(root: str | Path) -> SimpleNamespace:
    """The latest checkpoint under `root` of a Qwen2.5-VL model: `states` {vision: tower state,
    language: GPTModel state} (whole tensors, `read_qwen_vl`'s names), `spec`, `directory`, `config`
    (the kept config.json or None); ValueError for another model."""
    from megatron_hetero.checkpoint import save_load as ckpt
    from megatron_hetero.models.llava import LlavaSpec

    d, state = read_train_state(root)
    verify_manifest(d, state)
    spec = LlavaSpec.from_record(state.get("model") or {})
    if [e.kind for e in spec.encoders.values()] != ["qwen2.5-vl"] or VISION not in spec.encoders:
        raise ValueError(f"checkpoint {d}: not a Qwen2.5-VL model (one `vision` encoder of kind qwen2.5-vl)")
    layout = world_of_one_layout([VISION])
    with world_of_one(layout) as topo:
        states = build_whole(layout, spec, topo)
        ckpt.load_weights(root, layout, spec, topo, states)
        sd = {
            n: {k: v for k, v in st.module.state_dict().items() if not k.endswith("_extra_state")}
            for n, st in states.items()
        }
    kept = d / HF_DIR / QWEN_VL / "config.json"
    return SimpleNamespace(
        states={
            VISION: {k.removeprefix("tower."): v for k, v in sd[VISION].items()},
            LANGUAGE: {k.removeprefix("gpt."): v for k, v in sd[LANGUAGE].items()},
        },
        spec=spec,
        directory=d,
        config=json.loads(kept.read_text()) if kept.is_file() else None,
    )


def is_qwen_checkpoint(root: str | Path) -> bool:
    """Whether the latest checkpoint under `root` records a Qwen2.5-VL model."""

    _, state = read_train_state(root)
    encs = (state.get("model") or {}).get("encoders") or {}
    return any(e.get("kind") == "qwen2.5-vl" for e in encs.values())


def checkpoint_to_qwen(root: str | Path, out: str | Path, like: Optional[str | Path] = None) -> Path:
    """Write the latest checkpoint under `root` as one Qwen2.5-VL folder (module docstring)."""
    from megatron_hetero.convert.hf_qwen_vl import write_qwen_vl

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty")
    got = checkpoint_states(root)
    like_dir = Path(like) if like is not None else None
    cfg = json.loads((like_dir / "config.json").read_text()) if like_dir is not None else got.config
    if cfg is None:
        raise ValueError(
            f"checkpoint {got.directory}: it keeps no Qwen2.5-VL config.json (a checkpoint `train --save` "
            "wrote): give --like HF_DIR, the folder it was converted from"
        )
    write_qwen_vl(cfg, got.states, out)
    kept = got.directory / HF_DIR / QWEN_VL
    files = _files(like_dir) if like_dir is not None else ({} if not kept.is_dir() else _files(kept))
    for src in files.values():
        shutil.copyfile(src, out / src.name)
    return out
