"""A `Qwen2_5_VLForConditionalGeneration` folder <-> the weights of our two modules (whole tensors):

    read_qwen_vl(HF_DIR) -> (config dict, {"vision": QwenVisionTower state, "language": GPTModel state})
    write_qwen_vl(config, states, OUT) -> OUT/config.json + OUT/model.safetensors

In: the config's model_type must be `qwen2_5_vl` and its architectures (top level, or the text
config's, where transformers 4.57 writes them) `Qwen2_5_VLForConditionalGeneration` (else ValueError);
tensors under the hub's names (`visual.*`, `model.*` the language model, `lm_head.weight`) or
transformers' in-memory names (`model.visual.*`, `model.language_model.*`); a tensor of neither part,
or one a part does not use, is refused by name. The tower maps through `convert.hf_qwen_vision`, the
language model through `models.hf_names.language_to_ours` (fused per-group QKV with bias, SwiGLU fc1).
Out: the hub's names (what `save_pretrained` writes; `from_pretrained` loads them), the config as read.
The round trip returns every tensor bit for bit. Not yet a megatron-hetero checkpoint (`convert
hf-to-checkpoint --model` takes LLaVA folders): the states load into `models.qwen_vision` and
`models.qwen_vl` modules directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_hetero.convert.hf_qwen_vision import hf_to_tower, tower_to_hf
from megatron_hetero.models.hf_names import language_to_hf

ARCH = "Qwen2_5_VLForConditionalGeneration"


def _hub_name(name: str) -> str:
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


def read_qwen_vl(folder: str | Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(config.json, {"vision": tower state, "language": GPTModel state}) of a Qwen2.5-VL folder."""
    from safetensors.torch import load_file

    from megatron_hetero.models.qwen_vision import QwenVisionSpec
    from megatron_hetero.models.qwen_vl import QwenTextSpec, language_from_hf

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    archs = (cfg.get("architectures") or []) + ((cfg.get("text_config") or {}).get("architectures") or [])
    if cfg.get("model_type") != "qwen2_5_vl" or any(a != ARCH for a in archs):
        raise ValueError(
            f"{folder}: config.json model_type {cfg.get('model_type')!r}, architectures {archs} is not {ARCH}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update({_hub_name(k): v for k, v in load_file(str(f)).items()})
    if not tensors:
        raise ValueError(f"{folder}: no *.safetensors files")
    vspec = QwenVisionSpec.from_hf(cfg["vision_config"])
    tspec = QwenTextSpec.from_hf(cfg.get("text_config") or cfg)
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        hub = _hub_name(name)
        if hub not in tensors:
            raise ValueError(f"{folder}: tensor {hub} is missing")
        used.add(hub)
        return tensors[hub]

    vision = hf_to_tower(_Recorder(tensors, used), vspec.depth, vspec.num_heads, prefix="visual.")
    language = language_from_hf(get, tspec)
    stray = sorted(set(tensors) - used)
    if stray:
        raise ValueError(f"{folder}: tensors of no converted part: {stray[:8]}")
    return cfg, {"vision": vision, "language": language}


class _Recorder(dict):
    """A read-only view of `tensors` that notes each name read into `used`."""

    def __init__(self, tensors: dict, used: set) -> None:
        super().__init__(tensors)
        self.used = used

    def __getitem__(self, name: str) -> torch.Tensor:
        if not dict.__contains__(self, name):
            raise ValueError(f"tensor {name} is missing")
        self.used.add(name)
        return dict.__getitem__(self, name)


def write_qwen_vl(cfg: dict, states: dict[str, dict[str, torch.Tensor]], out: str | Path) -> Path:
    """OUT/config.json + OUT/model.safetensors (hub names) of the two modules' whole states."""
    from safetensors.torch import save_file

    from megatron_hetero.models.qwen_vision import QwenVisionSpec
    from megatron_hetero.models.qwen_vl import QwenTextSpec

    vspec = QwenVisionSpec.from_hf(cfg["vision_config"])
    tspec = QwenTextSpec.from_hf(cfg.get("text_config") or cfg)
    tensors = tower_to_hf([states["vision"]], vspec.depth, vspec.num_heads, prefix="visual.")
    ours = {"gpt." + k: v for k, v in states["language"].items()}
    tensors.update(language_to_hf(ours, tspec.names_view()))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out
