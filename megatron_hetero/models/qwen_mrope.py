"""M-RoPE position ids of Qwen2.5-VL's language model (pure tensor code): three ids per token
(temporal, height, width). Text tokens carry the same id thrice, counting on from the previous
token's largest id + 1; an image's merged tokens carry (0, row, column) on top of the position the
image starts at (images have no time: transformers' `get_rope_index` multiplies their frame index by
0), and the text after an image continues from that image's largest id + 1.

An image is a `vision_start` token followed by its run of `t * (h / merge) * (w / merge)` image
tokens; `grid_thw` lists the images of the whole batch in order (row by row), as the tower's input.
"""

from __future__ import annotations

import torch


def rope_index(
    tokens: torch.Tensor, grid_thw: torch.Tensor, *, image_token: int, vision_start: int, merge: int
) -> torch.Tensor:
    """[b, s] token ids + [images, 3] grid -> [3, b, s] position ids (transformers' `get_rope_index`
    for images without padding)."""
    b, s = tokens.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    grids = [tuple(g) for g in grid_thw.tolist()]
    used = 0
    for row in range(b):
        ids = tokens[row].tolist()
        starts = [i for i in range(s - 1) if ids[i] == vision_start and ids[i + 1] == image_token]
        parts, st, nxt = [], 0, 0
        for _ in starts:
            if used >= len(grids):
                raise ValueError(f"row {row}: more images in the text than the {len(grids)} of grid_thw")
            t, h, w = grids[used]
            used += 1
            gh, gw = h // merge, w // merge
            ed = ids.index(image_token, st)
            text = torch.arange(ed - st) + nxt
            parts.append(text.expand(3, -1))
            base = nxt + ed - st
            hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw).flatten()
            ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw).flatten()
            img = torch.stack([torch.zeros_like(hh), hh, ww]) + base
            if ids[ed : ed + t * gh * gw] != [image_token] * (t * gh * gw):
                raise ValueError(f"row {row}: image {used - 1} needs {t * gh * gw} image tokens at {ed}")
            parts.append(img)
            nxt = int(img.max()) + 1
            st = ed + t * gh * gw
        if st < s:
            parts.append((torch.arange(s - st) + nxt).expand(3, -1))
        out[:, row] = torch.cat(parts, dim=1)
    if used != len(grids):
        raise ValueError(f"grid_thw lists {len(grids)} images, the text holds {used}")
    return out
