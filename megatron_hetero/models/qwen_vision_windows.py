"""Qwen2.5-VL vision tower index arithmetic (pure tensor code, no Megatron): the 2-D rotary position
ids of the patches, the window ordering and the attention segments (windows, whole images).

Patches arrive per image in the reference's order: for each image (t, h, w grid in patches), row
blocks of `merge` x `merge` patches, each block's patches in row-major order (what Qwen2.5-VL's image
processor emits). The tower runs in *window order*: merged tokens (one per block) are regrouped by
windows of `window // merge // patch` blocks a side, windows in row-major order, images one after the
other (transformers' `Qwen2_5_VisionTransformerPretrainedModel.get_window_index`; the same order).
"""

from __future__ import annotations

import torch


def check_grid(grid_thw: torch.Tensor, merge: int) -> None:
    """A [n, 3] integer grid (t, h, w per image) whose h and w are multiples of `merge`."""
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
        raise ValueError(f"grid_thw must be [images, 3] (t, h, w), got {list(grid_thw.shape)}")
    if bool((grid_thw <= 0).any()) or bool((grid_thw[:, 1:] % merge != 0).any()):
        raise ValueError(f"grid_thw {grid_thw.tolist()}: t, h, w must be positive, h and w multiples of {merge}")


def position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[patches, 2] (row, column) of every patch in the input order (merge blocks, row-major)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).unsqueeze(1).expand(-1, w)
        cols = torch.arange(w).unsqueeze(0).expand(h, -1)
        ids = torch.stack([rows, cols], dim=-1).reshape(h // merge, merge, w // merge, merge, 2)
        out.append(ids.permute(0, 2, 1, 3, 4).reshape(-1, 2).repeat(t, 1))
    return torch.cat(out, dim=0)


def rotary_freqs(grid_thw: torch.Tensor, merge: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[patches, head_dim // 2] rotary angles: the row's then the column's (head_dim // 4 each)."""
    dim = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    ids = position_ids(grid_thw, merge)
    side = int(grid_thw[:, 1:].max())
    table = torch.outer(torch.arange(side, dtype=torch.float), inv)
    return table[ids].flatten(1)


def window_index(grid_thw: torch.Tensor, merge: int, blocks: int) -> tuple[torch.Tensor, list[int]]:
    """(the merged-token permutation into window order, the window lengths in patches).

    `blocks`: the window side in merged tokens (window_size // merge // patch_size)."""
    order, lengths, first = [], [], 0
    unit = merge * merge
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = -gh % blocks, -gw % blocks
        nh, nw = (gh + pad_h) // blocks, (gw + pad_w) // blocks
        padded = torch.nn.functional.pad(index, (0, pad_w, 0, pad_h), value=-1)
        padded = padded.reshape(t, nh, blocks, nw, blocks).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
        for window in padded.reshape(-1, blocks * blocks):
            kept = window[window >= 0]
            if kept.numel():
                order.append(kept + first)
                lengths.append(int(kept.numel()) * unit)
        first += t * gh * gw
    return torch.cat(order), lengths


def image_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Full-attention segments in patches: one per frame (t of them per image), as the reference."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


def segment_mask(lengths: list[int]) -> torch.Tensor:
    """[1, 1, s, s] boolean, True where attention is masked (across segments of `lengths`)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (seg[:, None] != seg[None, :]).unsqueeze(0).unsqueeze(0)
