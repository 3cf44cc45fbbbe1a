"""Image preprocessing from a vision tower's own Hugging Face `preprocessor_config.json`.

A converted CLIP (or SigLIP) tower was trained on pixels made by one exact recipe; this module reads
that recipe from the tower's `preprocessor_config.json` and applies it, so the tower sees the inputs
it saw in pretraining. The result is the `pixel_values` tensor transformers' processor gives for one
image, `[3, H, W]` float32, equal to within float32 rounding of the same operations (measured 0.0
max abs difference: docs/images.md). transformers is NOT imported (a test-only extra); the work is
done with pillow and numpy (the `data` extra).

Processors read (the config's `image_processor_type`, or the older `feature_extractor_type`):

  CLIP    `CLIPImageProcessor` (`CLIPFeatureExtractor`, `CLIPImageProcessorFast`): convert to RGB ->
          resize the SHORTEST edge to `size.shortest_edge` (the other edge keeps the aspect ratio,
          rounded down), or to a fixed `size.height` x `size.width` -> center crop to `crop_size`
          (zero padding where the crop is larger than the image) -> rescale by `rescale_factor`
          -> normalise with `image_mean` / `image_std`.
  SigLIP  `SiglipImageProcessor` (`SiglipImageProcessorFast`): convert to RGB only if
          `do_convert_rgb` -> resize to `size.height` x `size.width` -> rescale -> normalise
          (defaults mean = std = 0.5: pixels in [-1, 1]); no crop.

Every `do_*` switch, `resample` (PIL's filter numbers: 0 nearest, 1 lanczos, 2 bilinear, 3 bicubic,
4 box, 5 hamming) and the old integer forms of `size` / `crop_size` are honoured, with the
processor class's defaults where a key is absent. Anything else that would change the pixels is
refused with a ValueError naming the option (`do_pad`, `image_grid_pinpoints` (anyres grids),
`longest_edge`, `crop_pct`, an unknown processor type, ...); an unknown option that is off (null or
false) is ignored. The `...Fast` names are read as their class's configuration, but the numbers are
those of the PIL path: transformers' fast processors resize with torchvision instead and differ by
resampling noise.

The exact arithmetic (that of transformers' default, PIL path, reproduced here by reading it):

  1. the image becomes an 8-bit PIL image; with `do_convert_rgb`, one not in RGB mode is converted
     with PIL's `convert("RGB")` (grey L replicated, RGBA's alpha dropped, palettes expanded);
  2. resize with PIL's `Image.resize(filter)` on the 8-bit image (output 8-bit, rounded by PIL);
     for `shortest_edge` n the short edge becomes n and the long one floor(n * long / short);
  3. center crop (h, w) per axis: a larger image is cut from offset (size - crop) // 2, a smaller
     one is placed at offset ceil((crop - size) / 2) on zeros;
  4. rescale: uint8 -> float64, times `rescale_factor`, cast to float32;
  5. normalise in float32: (x - float32(mean)) / float32(std), per channel;
  6. channels first: [3, H, W].

Accepted inputs (`ImageProcessor.__call__`):

  * a PIL image (any mode PIL can convert to RGB): the reference case, what transformers is given;
  * a numpy uint8 array HxW, HxWx1, HxWx3 or HxWx4: read as the PIL image `Image.fromarray` makes
    of it (L, RGB or RGBA), so HxW grey is converted like a grey PIL image;
  * a torch tensor CxHxW (C in 1, 3, 4), either uint8 (energon's `torchrgb8` decoding) or float in
    [0, 1], which is what energon's default `torchrgb` decoding yields: PIL's RGB pixels divided by
    255 in float32. A float tensor is turned back into its 8-bit pixels by round(x * 255), which is
    exact for any image decoded from an 8-bit file (the error of the division is below 1e-4 of a
    level); one that is not 8-bit data (further than 1e-3 of a level from a multiple of 1/255,
    or outside [0, 1]) is refused: the resize arithmetic is defined on 8-bit pixels. So the energon
    path gives exactly what transformers gives for the file's decoded PIL image.

For the encoder: `to_patches(pixels, patch)` cuts `[3, H, W]` (or `[b, 3, H, W]`) into the feature
layout the data path hands `ClipEncoderModule` (`[tokens, 3 * p * p]`, row-major patches, each
flattened (channel, row, column), the layout of `energon_data.patchify`), which the encoder puts
back together into the same pixels bit for bit before its own patch convolution.
`caption_features(image, processor, patch)` is the drop-in for `energon_data.patchify` when a
processor is configured, `caption_format(processor, patch)` the image fields of the caption data
config it implies (in place of probing the data), and `check_fits(processor, image_size, where)`
checks that the processor's output is the tower's input size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

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
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}

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


@dataclass(frozen=True)
class ImageProcessor:
    """One preprocessing recipe (module docstring), as read by `processor_from_dict`.

    `shortest_edge` and `size` are exclusive: a shortest-edge resize, or a fixed (height, width)
    one; both None: no resize. `crop` None: no center crop. `rescale` None: no rescale. `mean` /
    `std` None: no normalisation."""

    kind: str
    convert_rgb: bool = True
    shortest_edge: Optional[int] = None
    size: Optional[tuple[int, int]] = None
    resample: int = 3
    crop: Optional[tuple[int, int]] = None
    rescale: Optional[float] = 1 / 255
    mean: Optional[tuple[float, float, float]] = None
    std: Optional[tuple[float, float, float]] = None
    source: str = "preprocessor config"

    @property
    def output_size(self) -> Optional[tuple[int, int]]:
        """(H, W) of every output, or None when it depends on the input (shortest-edge resize or no
        resize, and no crop)."""
        if self.crop is not None:
            return self.crop
        return self.size

    # -- the steps ---------------------------------------------------------------------------------

    def rgb(self, image: Any):
        """Step 1: the 8-bit RGB PIL image of `image` (module docstring, "Accepted inputs")."""
        pil = as_pil(image)
        if pil.mode != "RGB":
            if not self.convert_rgb:
                raise ValueError(
                    f"{self.source}: the image is in PIL mode {pil.mode}, and do_convert_rgb is off: "
                    "only RGB images are processed without do_convert_rgb (set it to true to convert)"
                )
            pil = pil.convert("RGB")
        return pil

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) after step 2 for an input of `height` x `width`."""
        if self.size is not None:
            return self.size
        if self.shortest_edge is None:
            return height, width
        n = self.shortest_edge
        if width <= height:
            return n * height // width, n  # floor(n * long / short), in integers
        return n, n * width // height

    def pixels_hwc(self, image: Any) -> np.ndarray:
        """Steps 1-5: the processed image as a float32 numpy array [H, W, 3]."""
        pil = self.rgb(image)
        if self.shortest_edge is not None or self.size is not None:
            h, w = self.resized_size(pil.height, pil.width)
            pil = pil.resize((w, h), resample=_pil_filter(self.resample))
        x = np.asarray(pil, dtype=np.uint8)
        if self.crop is not None:
            x = center_crop(x, self.crop)
        y: np.ndarray
        if self.rescale is not None:
            y = (x.astype(np.float64) * self.rescale).astype(np.float32)
        else:
            y = x.astype(np.float32)
        if self.mean is not None and self.std is not None:
            y = (y - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32)
        return y

    def __call__(self, image: Any) -> torch.Tensor:
        """The pixel tensor [3, H, W] float32 of one image (steps 1-6)."""
        return torch.from_numpy(np.ascontiguousarray(self.pixels_hwc(image).transpose(2, 0, 1)))

    def batch(self, images: list) -> torch.Tensor:
        """[b, 3, H, W] of several images (they must come out the same size)."""
        out = [self(im) for im in images]
        shapes = sorted({tuple(t.shape) for t in out})
        if len(shapes) > 1:
            raise ValueError(
                f"{self.source}: the images come out in {len(shapes)} sizes {shapes} (a shortest-edge resize "
                "without a center crop keeps each image's aspect ratio); they cannot be stacked"
            )
        return torch.stack(out)


# ---------------------------------------------------------------------------------------------------
# reading the config
# ---------------------------------------------------------------------------------------------------


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


def load_image_processor(path: str | Path) -> ImageProcessor:
    """`processor_from_dict` of `path`'s preprocessor_config.json (a folder or the file)."""
    p = Path(path)
    where = str(p / CONFIG_NAME if p.is_dir() else p)
    return processor_from_dict(read_preprocessor_config(path), where)


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


def processor_from_dict(cfg: dict, where: str = "preprocessor config") -> ImageProcessor:
    """The recipe of a preprocessor_config.json object, with the class's defaults where a key is
    absent; ValueError naming the option for anything it cannot reproduce (module docstring)."""
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
    if isinstance(resample, bool) or not isinstance(resample, int) or resample not in _RESAMPLE:
        raise ValueError(
            f"{where}: resample={resample!r} is not one of PIL's filters "
            f"({', '.join(f'{k} {v}' for k, v in _RESAMPLE.items())})"
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
    return ImageProcessor(
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


def _pil_filter(resample: int):
    from PIL import Image

    return Image.Resampling(resample)


# ---------------------------------------------------------------------------------------------------
# inputs and crop
# ---------------------------------------------------------------------------------------------------


def as_pil(image: Any):
    """An 8-bit PIL image of a PIL image, a uint8 numpy array (HxW, HxWx{1,3,4}) or a torch tensor
    CxHxW (C in 1, 3, 4; uint8, or float holding 8-bit levels / 255). ValueError otherwise."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("image preprocessing needs pillow (the `data` extra: pip install -e '.[data]')") from None
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, torch.Tensor):
        image = _tensor_to_hwc_uint8(image)
    if not isinstance(image, np.ndarray):
        raise ValueError(
            f"an image is a PIL image, a uint8 numpy array HxWxC or a CxHxW torch tensor, not {type(image).__name__}"
        )
    if image.dtype != np.uint8:
        raise ValueError(
            f"a numpy image must be uint8 (8-bit pixels), not {image.dtype}; a float image in [0, 1] is "
            "accepted as a CxHxW torch tensor (energon's decoding)"
        )
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (3, 4))):
        raise ValueError(f"a numpy image is HxW, HxWx1, HxWx3 or HxWx4, got shape {list(image.shape)}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ValueError(f"the image is empty (shape {list(image.shape)})")
    return Image.fromarray(np.ascontiguousarray(image))


def _tensor_to_hwc_uint8(t: torch.Tensor) -> np.ndarray:
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[0] not in (1, 3, 4):
        raise ValueError(f"a tensor image is CxHxW with C in 1, 3, 4 (energon's decoding), got shape {list(t.shape)}")
    t = t.detach().cpu()
    if t.dtype == torch.uint8:
        u = t.numpy()
    elif t.is_floating_point():
        x = t.float().numpy()
        lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
        if not (lo >= 0 and hi <= 1):  # NaN fails this too
            raise ValueError(f"a float tensor image must hold values in [0, 1] (energon's decoding), got [{lo}, {hi}]")
        levels = x * np.float32(255)  # float32: 8-bit levels come back within ~2e-5 of an integer
        rounded = np.rint(levels)
        levels -= rounded
        off = float(np.abs(levels, out=levels).max()) if x.size else 0.0
        if off > 1e-3:
            raise ValueError(
                f"a float tensor image must hold 8-bit levels / 255 (an image decoded from an 8-bit file); this "
                f"one is {off:.3g} of a level away from them: the processor's resize is defined on 8-bit pixels"
            )
        u = rounded.astype(np.uint8)
    else:
        raise ValueError(f"a tensor image is uint8 or float in [0, 1], not {t.dtype}")
    return np.ascontiguousarray(u.transpose(1, 2, 0))


def center_crop(x: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """[H, W, C] -> [ch, cw, C]: per axis, a larger image is cut from offset (size - crop) // 2, a
    smaller one is placed at offset ceil((crop - size) / 2) on zeros."""
    ch, cw = crop
    h, w = x.shape[:2]
    out = np.zeros((ch, cw) + x.shape[2:], dtype=x.dtype)

    def span(size: int, want: int) -> tuple[slice, slice]:  # (source, destination)
        if size >= want:
            start = (size - want) // 2
            return slice(start, start + want), slice(0, want)
        start = (want - size + 1) // 2
        return slice(0, size), slice(start, start + size)

    (sy, dy), (sx, dx) = span(h, ch), span(w, cw)
    out[dy, dx] = x[sy, sx]
    return out


# ---------------------------------------------------------------------------------------------------
# to the encoder
# ---------------------------------------------------------------------------------------------------


def to_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [(H/p)*(W/p), 3*p*p] (or [b, 3, H, W] -> [b, tokens, 3*p*p]): non-overlapping
    p x p patches in row-major order, each flattened (channel, row, column): the encoder features
    `ClipEncoderModule` takes (its `image` is the exact inverse: a reshape, no arithmetic)."""
    single = pixels.dim() == 3
    x = pixels.unsqueeze(0) if single else pixels
    if x.dim() != 4:
        raise ValueError(f"pixels are [3, H, W] or [b, 3, H, W], got shape {list(pixels.shape)}")
    b, c, h, w = x.shape
    if patch <= 0 or h % patch or w % patch:
        raise ValueError(f"a {h}x{w} image does not cut into {patch}x{patch} patches ({h} % {patch}, {w} % {patch})")
    gh, gw = h // patch, w // patch
    out = x.reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * patch * patch)
    out = out.contiguous()
    return out[0] if single else out


def check_fits(processor: ImageProcessor, image_size: tuple[int, int], where: str = "--image-processor") -> None:
    """ValueError unless every output of `processor` is `image_size` (H, W), the tower's input."""
    out = processor.output_size
    if out is None:
        raise ValueError(
            f"{where}: {processor.source} gives images whose size depends on the input (a shortest-edge resize "
            f"without a center crop); the encoder takes {image_size[0]}x{image_size[1]}"
        )
    if tuple(out) != tuple(image_size):
        raise ValueError(
            f"{where}: {processor.source} gives {out[0]}x{out[1]} images; the encoder takes "
            f"{image_size[0]}x{image_size[1]}"
        )


def caption_format(processor: ImageProcessor, patch: int) -> dict:
    """The image fields of a caption data config (`CaptionDataConfig.image_size`, `channels`) that
    `processor` implies: `dataclasses.replace(cfg, **caption_format(proc, cfg.patch_size))` in place
    of probing the data (`energon_data.resolve_config`). ValueError when the output size depends on
    the input or does not cut into `patch` x `patch` patches."""
    out = processor.output_size
    if out is None:
        raise ValueError(
            f"{processor.source}: the output size depends on the input (a shortest-edge resize without a center "
            "crop); the encoder needs one image size"
        )
    if patch <= 0 or out[0] % patch or out[1] % patch:
        raise ValueError(f"{processor.source}: its {out[0]}x{out[1]} images do not cut into {patch}x{patch} patches")
    return {"image_size": (out[0], out[1]), "channels": 3}


def caption_features(image: Any, processor: ImageProcessor, patch: int) -> torch.Tensor:
    """One decoded caption image -> its encoder features [tokens, 3*p*p] through `processor`: the
    drop-in for `energon_data.patchify` when the tower's own preprocessing is configured."""
    return to_patches(processor(image), patch)
