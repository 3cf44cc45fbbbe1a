"""Reading a vision tower's Hugging Face `preprocessor_config.json` (pure: no torch, no PIL): which
processor it is (CLIP or SigLIP), the recipe's fields with each class's defaults where a key is absent,
and a ValueError naming the option for anything `data.image_processor` cannot reproduce (its
docstring lists what is read and refused). transformers is not imported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

CONFIG_NAME = "preprocessor_config.json"

CLIP, SIGLIP = "clip", "siglip"
_TYPES = {
    "CLIPImageProcessor": CLIP,
    "CLIPImageProcessorFast": CLIP,
    "CLIPFeatureExtractor": CLIP,
    "SiglipImageProcessor": SIGLIP,
    "SiglipImageProcessorFast": SIGLIP,
}
# transformers' constants (OPENAI_CLIP_MEAN/STD and IMAGENET_STANDARD_MEAN/STD), the classes' defaults
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
RESAMPLE_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

# keys that name the processor or the output container, not the pixels
_METADATA = {"image_processor_type", "feature_extractor_type", "processor_class", "_processor_class", "return_tensors"}
_READ = {
    CLIP: {
        "do_convert_rgb",
        "do_resize",
        "size",
        "resample",
        "do_center_crop",
        "crop_size",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
    },
    SIGLIP: {
        "do_convert_rgb",
        "do_resize",
        "size",
        "resample",
        "do_rescale",
        "rescale_factor",
        "do_normalize",
        "image_mean",
        "image_std",
    },
}
# options that change the pixels and are not implemented: refused by name when on
_REFUSED = {
    "do_pad": "padding (LLaVA's pad-to-square / anyres) is not implemented",
    "image_grid_pinpoints": "anyres grids (LLaVA-NeXT) are not implemented",
    "crop_pct": "crop_pct resizing is not implemented",
    "use_square_size": "use_square_size (Kosmos-2) is not implemented",
    "do_center_crop": "SiglipImageProcessor does not crop",
    "crop_size": "SiglipImageProcessor does not crop",
}


def read_preprocessor_config(path: str | Path) -> dict:
    """The JSON object of `path` (a folder holding preprocessor_config.json, or the file)."""
    p = Path(path)
    f = p / CONFIG_NAME if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"{path}: no {CONFIG_NAME} (a Hugging Face model folder holds the image processor's config)")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{f} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def processor_kind(cfg: dict, where: str = "preprocessor config") -> str:
    """`clip` or `siglip` from the config's image_processor_type (or feature_extractor_type)."""
    name = cfg.get("image_processor_type") or cfg.get("feature_extractor_type")
    if name is None:
        raise ValueError(
            f"{where}: neither image_processor_type nor feature_extractor_type says which processor this is "
            f"(supported: {', '.join(_TYPES)})"
        )
    if name not in _TYPES:
        raise ValueError(f"{where}: image processor {name!r} is not supported (supported: {', '.join(_TYPES)})")
    return _TYPES[name]


def recipe_fields(cfg: dict, where: str = "preprocessor config") -> dict[str, Any]:
    """The recipe of a preprocessor_config.json object as `image_processor.ImageProcessor`'s fields,
    with the class's defaults where a key is absent; ValueError naming the option for anything it
    cannot reproduce (`data.image_processor`'s docstring)."""
    kind = processor_kind(cfg, where)
    for key, value in cfg.items():
        if key in _METADATA or key in _READ[kind]:
            continue
        if key in _REFUSED and _on(value):
            raise ValueError(f"{where}: {key}={value!r} is not supported: {_REFUSED[key]}")
        if _on(value):
            raise ValueError(
                f"{where}: option {key}={value!r} is not one this {kind.upper()} processor reads "
                f"(it reads {', '.join(sorted(_READ[kind]))}); refusing rather than ignoring it"
            )
    convert_default = kind == CLIP  # SiglipImageProcessor's do_convert_rgb defaults to None (off)
    convert_rgb = _flag(cfg, "do_convert_rgb", convert_default, where)
    shortest: Optional[int] = None
    size: Optional[tuple[int, int]] = None
    if _flag(cfg, "do_resize", True, where):
        if kind == CLIP:
            shortest, size = _clip_size(_given(cfg, "size", {"shortest_edge": 224}), where)
        else:
            size = _height_width(_given(cfg, "size", {"height": 224, "width": 224}), "size", where, square_int=False)
    resample = cfg.get("resample", 3)
    if isinstance(resample, bool) or not isinstance(resample, int) or resample not in RESAMPLE_FILTERS:
        raise ValueError(
            f"{where}: resample={resample!r} is not one of PIL's filters "
            f"({', '.join(f'{k} {v}' for k, v in RESAMPLE_FILTERS.items())})"
        )
    crop: Optional[tuple[int, int]] = None
    if kind == CLIP and _flag(cfg, "do_center_crop", True, where):
        crop = _height_width(
            _given(cfg, "crop_size", {"height": 224, "width": 224}), "crop_size", where, square_int=True
        )
    rescale: Optional[float] = None
    if _flag(cfg, "do_rescale", True, where):
        rescale = cfg.get("rescale_factor", 1 / 255)
        if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or not math.isfinite(rescale):
            raise ValueError(f"{where}: rescale_factor={rescale!r} is not a finite number")
        rescale = float(rescale)
    mean = std = None
    if _flag(cfg, "do_normalize", True, where):
        default_mean, default_std = (_CLIP_MEAN, _CLIP_STD) if kind == CLIP else (_HALF, _HALF)
        mean = _per_channel(_given(cfg, "image_mean", default_mean), "image_mean", where)
        std = _per_channel(_given(cfg, "image_std", default_std), "image_std", where)
        if any(s == 0 for s in std):
            raise ValueError(f"{where}: image_std={list(std)} has a zero (normalising divides by it)")
    return dict(
        kind=kind,
        convert_rgb=convert_rgb,
        shortest_edge=shortest,
        size=size,
        resample=resample,
        crop=crop,
        rescale=rescale,
        mean=mean,
        std=std,
        source=where,
    )


def _given(cfg: dict, key: str, default: Any) -> Any:
    """A value with a class default: absent or null -> the default."""
    value = cfg.get(key)
    return default if value is None else value


def _on(value: Any) -> bool:
    return value is not None and value is not False


def _flag(cfg: dict, key: str, default: bool, where: str) -> bool:
    """A do_* switch: absent -> the class's default; null -> off (the processor stores None, which
    its preprocess reads as false)."""
    value = cfg.get(key, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r} must be true or false")
    return value


def _positive(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: {name}={value!r} must be a positive integer")
    return value


def _clip_size(size: Any, where: str) -> tuple[Optional[int], Optional[tuple[int, int]]]:
    """CLIP's `size`: an int or {"shortest_edge": n} -> (n, None); {"height", "width"} or [h, w] ->
    (None, (h, w))."""
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return _positive(size["shortest_edge"], "size.shortest_edge", where), None
    if isinstance(size, int) and not isinstance(size, bool):
        return _positive(size, "size", where), None
    if isinstance(size, dict) and "longest_edge" in size:
        raise ValueError(
            f"{where}: size={size!r}: longest_edge is not supported (CLIPImageProcessor resizes by "
            "shortest_edge alone, or to a fixed height and width)"
        )
    return None, _height_width(size, "size", where, square_int=True)


def _height_width(size: Any, name: str, where: str, *, square_int: bool) -> tuple[int, int]:
    """{"height": h, "width": w} or [h, w] (or an int n -> (n, n) where `square_int`)."""
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return _positive(size["height"], f"{name}.height", where), _positive(size["width"], f"{name}.width", where)
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return _positive(size[0], f"{name}[0]", where), _positive(size[1], f"{name}[1]", where)
    if square_int and isinstance(size, int) and not isinstance(size, bool):
        n = _positive(size, name, where)
        return n, n
    want = '{"height": H, "width": W}' + (" or an integer" if square_int else "")
    raise ValueError(f"{where}: {name}={size!r} is not supported here (expected {want})")


def _per_channel(value: Any, name: str, where: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    ):
        raise ValueError(f"{where}: {name}={value!r} must be 3 finite numbers (R, G, B) or one")
    return float(value[0]), float(value[1]), float(value[2])
