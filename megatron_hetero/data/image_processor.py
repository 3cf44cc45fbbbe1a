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

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from megatron_hetero.data.image_processor_config import (  # noqa: F401 (re-exported)
    CLIP,
    CONFIG_NAME,
    SIGLIP,
    processor_kind,
    read_preprocessor_config,
    recipe_fields,
)


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


def load_image_processor(path: str | Path) -> ImageProcessor:
    """`processor_from_dict` of `path`'s preprocessor_config.json (a folder or the file)."""
    p = Path(path)
    where = str(p / CONFIG_NAME if p.is_dir() else p)
    return processor_from_dict(read_preprocessor_config(path), where)


def processor_from_dict(cfg: dict, where: str = "preprocessor config") -> ImageProcessor:
    """The processor of a preprocessor_config.json object (`image_processor_config.recipe_fields`)."""
    return ImageProcessor(**recipe_fields(cfg, where))


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
