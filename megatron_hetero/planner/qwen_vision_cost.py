"""What the Qwen2.5-VL vision tower costs for given images (pure arithmetic): the forward FLOPs of
`models.qwen_vision.QwenVisionTower` from the images' `grid_thw`, window attention priced by its
windows and full attention by whole frames, so the cost follows the resolution.

Matmul FLOPs (2 per multiply-add), N patches, hidden h, MLP width f, merge m, out width o:
    patch embedding   2 N (3 T p^2) h
    per layer         2 N (3h) h + 2 N h h + 3 (2 N h f)      QKV, output, SwiGLU (gate, up, down)
                      + 4 h * sum over segments of L^2          QK^T and AV per attention segment
    merger            2 (N / m^2) (m^2 h)^2 + 2 (N / m^2) (m^2 h) o
Segments: layers in `fullatt_block_indexes` attend within each frame (L = h_p * w_p patches), the
others within windows of `window_size / merge / patch` merged tokens a side, cut at the image's edge
(`models.qwen_vision_windows.window_index`'s lengths, computed here without torch).
The planner's search prices a Qwen2.5-VL encoder (`planner.model.workload` of a model with the
encoder kind "qwen2.5-vl") as a transformer over the image's patches whose attention meets
`attention_span` keys per query (window layers their window, full layers their frame) and whose
merger hands the language model patches / merge**2 tokens.
"""

from __future__ import annotations

from typing import Sequence


def window_lengths(grid_thw: Sequence[Sequence[int]], merge: int, blocks: int) -> list[int]:
    """Every window's length in patches, images and frames in order (empty windows dropped)."""
    out = []
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        for _ in range(t):
            for i in range(0, gh, blocks):
                for j in range(0, gw, blocks):
                    out.append(min(blocks, gh - i) * min(blocks, gw - j) * merge * merge)
    return out


def frame_lengths(grid_thw: Sequence[Sequence[int]]) -> list[int]:
    """Full-attention segments in patches: one per frame."""
    return [h * w for t, h, w in grid_thw for _ in range(t)]


def tower_forward_flops(
    grid_thw: Sequence[Sequence[int]],
    *,
    hidden: int,
    ffn: int,
    depth: int,
    full_layers: int,
    out_hidden: int,
    patch: int = 14,
    temporal_patch: int = 2,
    merge: int = 2,
    window: int = 112,
) -> float:
    """Forward FLOPs of the tower over these images (`full_layers` of the `depth` attend whole frames)."""
    if not 0 <= full_layers <= depth:
        raise ValueError(f"full_layers {full_layers} must be within 0..depth ({depth})")
    n = sum(t * h * w for t, h, w in grid_thw)
    unit = merge * merge
    windows = sum(L * L for L in window_lengths(grid_thw, merge, window // merge // patch))
    frames = sum(L * L for L in frame_lengths(grid_thw))
    dense = 2.0 * n * 3 * hidden * hidden + 2.0 * n * hidden * hidden + 3 * 2.0 * n * hidden * ffn
    layers = depth * dense + 4.0 * hidden * ((depth - full_layers) * windows + full_layers * frames)
    embed = 2.0 * n * 3 * temporal_patch * patch * patch * hidden
    merger = 2.0 * (n / unit) * (unit * hidden) ** 2 + 2.0 * (n / unit) * unit * hidden * out_hidden
    return embed + layers + merger


def attention_span(
    grid_thw: Sequence[Sequence[int]],
    *,
    depth: int,
    full_layers: int,
    merge: int = 2,
    patch: int = 14,
    window: int = 112,
) -> float:
    """Mean keys per query over the tower's layers: (sum over layers of sum over its attention
    segments of L^2) / (depth * patches), the `seq` of the 4*T*s*h attention FLOPs term."""
    if not 0 <= full_layers <= depth or depth < 1:
        raise ValueError(f"full_layers {full_layers} must be within 0..depth ({depth})")
    n = sum(t * h * w for t, h, w in grid_thw)
    windows = sum(L * L for L in window_lengths(grid_thw, merge, window // merge // patch))
    frames = sum(L * L for L in frame_lengths(grid_thw))
    return ((depth - full_layers) * windows + full_layers * frames) / (depth * n)
