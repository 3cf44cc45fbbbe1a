"""A checkpoint back to Hugging Face folders (`megatron-hetero convert checkpoint-to-hf`): the
latest checkpoint under a root, loaded in a world of one as `hf_weights.py` builds it, written as
one folder per part (`vision`, `language`, `projector`; with a Whisper encoder also `audio`,
`audio_projector`): `model.safetensors` (no pickle) and the part's `config.json` (the converted one
kept under `hf/`, else rebuilt from the recorded model). The inverse of `hf_weights.hf_to_checkpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from megatron_hetero.convert.hf_weights import (
    HF_DIR,
    LANGUAGE,
    VISION,
    build_whole,
    from_hybrid_names,
    gpt_view,
    world_of_one,
    world_of_one_layout,
)
from megatron_hetero.models import hf_config
from megatron_hetero.checkpoint.files import read_train_state, verify_manifest
from megatron_hetero.convert import hf_audio


def checkpoint_to_hf(root: str | Path, out: str | Path) -> dict[str, Path]:
    """Write the latest checkpoint under `root` as Hugging Face folders; returns {module: folder}."""
    from safetensors.torch import save_file

    from megatron_hetero.models import hf_names

    parts = hf_parts(root)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty")
    written = {}
    for name, t in parts.tensors.items():
        folder = out / name
        folder.mkdir(parents=True)
        save_file(hf_names.contiguous(t), str(folder / "model.safetensors"), metadata={"format": "pt"})
        if name in parts.configs:
            (folder / "config.json").write_text(json.dumps(parts.configs[name], indent=2, sort_keys=True))
        written[name] = folder
    return written


def hf_parts(root: str | Path) -> SimpleNamespace:
    """The latest checkpoint under `root` as Hugging Face tensors and configs, part by part:
    `tensors` {vision, language, projector: {HF name: tensor}}, `configs` {vision, language:
    config.json (the converted one's, else rebuilt from the recorded model)}, `spec`, `encoder`
    (its EncoderSpec), `directory` (the iteration folder). ValueError for a model with no HF form."""
    from megatron_hetero.models import hf_names
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.checkpoint import save_load as ckpt

    d, state = read_train_state(root)
    verify_manifest(d, state)
    spec = LlavaSpec.from_record(state.get("model") or {})
    hf_config.check_hf_expressible(spec)

    encoders = [n for n, e in spec.encoders.items() if e.kind in ("clip", "siglip")]
    speech = [n for n, e in spec.encoders.items() if e.kind == "whisper"]
    if len(encoders) != 1 or len(speech) > 1 or len(spec.encoders) != len(encoders) + len(speech):
        raise ValueError(
            f"checkpoint {d}: expected one CLIP or SigLIP encoder (and at most one Whisper encoder), the model has "
            f"{dict((n, e.kind) for n, e in spec.encoders.items())}"
        )
    enc_name = encoders[0]
    layout = world_of_one_layout(encoders + speech)
    with world_of_one(layout) as topo:
        states = build_whole(layout, spec, topo)
        ckpt.load_weights(root, layout, spec, topo, states)
        sd = {
            n: {k: v for k, v in st.module.state_dict().items() if not k.endswith("_extra_state")}
            for n, st in states.items()
        }
    enc = spec.encoders[enc_name]
    tensors = {
        VISION: hf_names.vision_to_hf(sd[enc_name], enc),
        LANGUAGE: hf_names.language_to_hf(from_hybrid_names(sd[LANGUAGE], spec), gpt_view(spec)),
        "projector": hf_names.projector_to_hf(sd[enc_name]),
    }
    configs = {
        VISION: _layers_as_kept(_saved_config(d, enc_name), enc.num_layers) or hf_config.vision_config_json(enc),
        LANGUAGE: _saved_config(d, LANGUAGE) or hf_config.language_config_json(gpt_view(spec)),
    }
    for name in speech:  # the Whisper encoder: OUT/audio, OUT/audio_projector
        extra = hf_audio.audio_parts(sd[name], spec.encoders[name], _saved_config(d, name))
        tensors.update(extra.tensors)
        configs.update(extra.configs)
    return SimpleNamespace(tensors=tensors, configs=configs, spec=spec, encoder=enc, directory=d)


def _layers_as_kept(cfg: Optional[dict], layers: int) -> Optional[dict]:
    """The original vision config with num_hidden_layers = the layers the tower kept (a tower cut at
    --vision-feature-layer writes back as the shorter tower it is)."""
    if cfg is None:
        return None
    inner = cfg.get("vision_config") if cfg.get("model_type") in ("clip", "siglip") else cfg
    if isinstance(inner, dict) and inner.get("num_hidden_layers") != layers:
        inner["num_hidden_layers"] = layers
    return cfg


def _saved_config(d: Path, name: str) -> Optional[dict]:
    p = d / HF_DIR / name / "config.json"
    if not p.is_file():  # a checkpoint saved by `train` after the conversion: the first one's copy is gone
        return None
    return json.loads(p.read_text())
