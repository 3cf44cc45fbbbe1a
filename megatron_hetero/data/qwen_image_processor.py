"""Qwen2.5-VL's native-resolution image preprocessing from its `preprocessor_config.json`
(`Qwen2VLImageProcessor`, the PIL path), without transformers: each image keeps (about) its own size,
so its token count follows it.

Per image: convert to RGB (with `do_convert_rgb`) -> `smart_resize`: both sides rounded to multiples
of `patch_size * merge_size`, scaled down to at most `max_pixels` (`size.longest_edge`) or up to at
least `min_pixels` (`size.shortest_edge`) pixels keeping the aspect ratio -> PIL resize on the 8-bit
image -> rescale (float64 x factor -> float32) -> normalise per channel in float32 -> the frame
repeated to `temporal_patch_size` -> cut into the tower's flat patches `[t*h*w, 3*T*p*p]` in merge
blocks (`models.qwen_vision`'s input order). `batch(images)` concatenates the patches of images of
any sizes and stacks their `grid_thw` rows (t, h, w in patches).

For training on conversations (`data.chat_batches` with a Qwen2.5-VL tower): `merged_grid(size)`
gives an image's (rows, cols) of merged tokens from its size alone (no pixel decoded),
`merged_tokens(image)` its features `[rows * cols, merge**2 * 3*T*p*p]` (a merged token's
merge**2 patches side by side: the encoder module's input), and `for_tower(...)` the processor a
tower of another patch size reads by default: Qwen2.5-VL's bounds in merged tokens (min_pixels 4,
max_pixels 1280 merged tokens of (patch * merge)**2 pixels).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_hetero.data.image_processor import _pil_filter, as_pil

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) multiples of `factor`, min_pixels <= h * w <= max_pixels, about the aspect ratio."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {height}x{width}: aspect ratio above 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "preprocessor config") -> "QwenImageProcessor":
        kind = cfg.get("image_processor_type")
        if kind not in TYPES:
            raise ValueError(f"{where}: image_processor_type {kind!r} is not one of {', '.join(TYPES)}")
        for off in ("do_resize", "do_rescale", "do_normalize"):
            if cfg.get(off) is False:
                raise ValueError(f"{where}: {off} false is not supported (the tower expects its recipe)")
        size = cfg.get("size") or {}
        kw: dict[str, Any] = {
            "min_pixels": cfg.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels,
            "max_pixels": cfg.get("max_pixels") or size.get("longest_edge") or cls.max_pixels,
        }
        for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "resample", "do_convert_rgb"):
            if cfg.get(k) is not None:
                kw[k] = cfg[k]
        for k in ("image_mean", "image_std"):
            if cfg.get(k) is not None:
                kw[k] = tuple(cfg[k])
        return cls(**kw)

    @classmethod
    def load(cls, folder: str | Path) -> "QwenImageProcessor":
        path = Path(folder) / "preprocessor_config.json"
        return cls.from_dict(json.loads(path.read_text()), str(path))

    def __call__(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches [t*h*w, 3*T*p*p] float32, (t, h, w)) of one image."""
        pil = as_pil(image)
        if self.do_convert_rgb and pil.mode != "RGB":
            pil = pil.convert("RGB")
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        h, w = smart_resize(pil.height, pil.width, p * m, self.min_pixels, self.max_pixels)
        x = np.asarray(pil.resize((w, h), resample=_pil_filter(self.resample)), dtype=np.uint8)
        y = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        y = (y - np.asarray(self.image_mean, dtype=np.float32)) / np.asarray(self.image_std, dtype=np.float32)
        frames = np.repeat(y.transpose(2, 0, 1)[None], t, axis=0)  # [T, 3, H, W]
        gh, gw = h // p, w // p
        blocks = frames.reshape(1, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return torch.from_numpy(np.ascontiguousarray(blocks.reshape(gh * gw, 3 * t * p * p))), (1, gh, gw)

    @classmethod
    def for_tower(cls, patch_size: int, merge_size: int, temporal_patch_size: int) -> "QwenImageProcessor":
        """Qwen2.5-VL's processor for a tower of these sizes: its min/max pixels as 4 and 1280 merged tokens
        (56*56 and 28*28*1280 at patch 14, merge 2), the rest Qwen's defaults."""
        side = patch_size * merge_size
        return cls(
            min_pixels=4 * side * side,
            max_pixels=1280 * side * side,
            patch_size=patch_size,
            merge_size=merge_size,
            temporal_patch_size=temporal_patch_size,
        )

    def check_tower(self, patch_size: int, merge_size: int, temporal_patch_size: int, where: str) -> None:
        """ValueError when the processor's patch, merge and temporal patch sizes are not the tower's."""
        mine = (self.patch_size, self.merge_size, self.temporal_patch_size)
        if mine != (patch_size, merge_size, temporal_patch_size):
            raise ValueError(
                f"{where}: the image processor's patch_size, merge_size, temporal_patch_size {mine} are not the "
                f"tower's {(patch_size, merge_size, temporal_patch_size)}"
            )

    @property
    def feature_dim(self) -> int:
        """Features of one merged token: merge**2 patches of 3 * T * p * p."""
        return self.merge_size**2 * 3 * self.temporal_patch_size * self.patch_size**2

    def merged_grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of merged tokens of an (H, W) image after `smart_resize` (no pixel read)."""
        side = self.patch_size * self.merge_size
        h, w = smart_resize(int(size[0]), int(size[1]), side, self.min_pixels, self.max_pixels)
        return h // side, w // side

    def merged_tokens(self, image: Any) -> torch.Tensor:
        """[rows * cols, feature_dim] of one image: its merged tokens row-major (module docstring)."""
        patches, _ = self(image)
        return patches.reshape(-1, self.feature_dim)

    def batch(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(patches of all images one after the other, grid_thw [images, 3])."""
        done = [self(im) for im in images]
        return torch.cat([d[0] for d in done]), torch.tensor([d[1] for d in done])
