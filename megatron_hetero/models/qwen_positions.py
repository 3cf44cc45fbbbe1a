"""The M-RoPE position ids of a language model reading one Qwen2.5-VL encoder's image
(`EncoderSpec.kind` "qwen2.5-vl", `models.qwen_encoder`) at its placeholder span: Qwen2.5-VL's
(`models.qwen_mrope.rope_index`) for that image: text 0..offset-1, the image's tokens (offset,
offset + row, offset + column), the text after it continuing from offset + max(rows, cols). Every
row of a batch has the same ids (the image sits at the same span). Pure tensor code.
"""

from __future__ import annotations

import torch

from megatron_hetero.models.qwen_mrope import rope_index
from megatron_hetero.config.model import QWEN_VL

# token ids of the text `mrope_ids` hands `rope_index` (only their roles matter)
_TEXT, _IMAGE, _START = 0, 1, 2


def image_grid(enc) -> tuple[int, int]:
    """(rows, cols) of merged tokens of an encoder's image (`image_rows`, 0: a square)."""
    rows = enc.image_rows or round(enc.tokens**0.5)
    if rows < 1 or enc.tokens % rows:
        raise ValueError(f"{enc.tokens} image tokens do not make rows of {rows}")
    return rows, enc.tokens // rows


def mrope_ids(spec, seq_length: int) -> torch.Tensor:
    """[3, 1, seq_length] M-RoPE ids of the model's text (module docstring): the one Qwen2.5-VL
    encoder's image at its span [offset, offset + tokens). Built on the CPU whatever the default device
    (index arithmetic that reads its own values: also under the meta device of `dryrun`)."""
    (enc,) = [e for e in spec.encoders.values() if e.kind == QWEN_VL]
    rows, cols = image_grid(enc)
    with torch.device("cpu"):
        tokens = torch.full((1, seq_length), _TEXT)
        tokens[0, enc.offset - 1] = _START
        tokens[0, enc.offset : enc.offset + enc.tokens] = _IMAGE
        grid = torch.tensor([[1, rows * enc.merge_size, cols * enc.merge_size]])
        return rope_index(tokens, grid, image_token=_IMAGE, vision_start=_START, merge=enc.merge_size)


def batch_mrope_ids(enc, image_mask: torch.Tensor, tiles: list[int]) -> torch.Tensor:
    """[3, b, S] M-RoPE ids of a batch with native-resolution images (`max_tiles`): row r's image is
    its `tiles[r]` tiles stacked (`models.qwen_encoder.tile_grid_thw`), at the positions its
    `image_mask` [b, S] sets (the placeholder before them plays the vision start); a row without
    tiles has text ids 0..S-1."""
    b, s = image_mask.shape
    if len(tiles) != b:
        raise ValueError(f"{len(tiles)} tile counts for a batch of {b} rows")
    rows, cols = image_grid(enc)
    tokens = torch.full((b, s), _TEXT)
    tokens[image_mask.bool()] = _IMAGE
    grids = []
    for r, n in enumerate(tiles):
        if not n:
            continue
        first = int(image_mask[r].nonzero()[0])
        if first < 1 or int(image_mask[r].sum()) != n * enc.tokens:
            raise ValueError(f"row {r}: {n} tiles need {n * enc.tokens} image positions after a vision start")
        tokens[r, first - 1] = _START
        grids.append([1, rows * n * enc.merge_size, cols * enc.merge_size])
    if not grids:
        return torch.arange(s).expand(3, b, -1).clone()
    return rope_index(tokens, torch.tensor(grids), image_token=_IMAGE, vision_start=_START, merge=enc.merge_size)


def grid_mrope_ids(image_mask: torch.Tensor, grids: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[3, b, S] M-RoPE ids of a batch whose rows hold any number of images of any size: row r's
    images are `grids[r]`, (rows, cols) of merged tokens each, in order, over the positions its
    `image_mask` [b, S] sets (image after image; adjacent images need no text between them). Qwen2.5-VL's
    rule (`qwen_mrope.rope_index`, the text before an image playing its vision start): text counts on
    from the previous id + 1, an image's tokens are (base, base + row, base + column) with base the
    next id, the text after it continuing from base + max(rows, cols). Pure: from the data's grids and
    the mask, which every language stage has (nothing crosses the wire for them)."""
    b, s = image_mask.shape
    if len(grids) != b:
        raise ValueError(f"{len(grids)} rows of image grids for a batch of {b} rows")
    out = torch.empty(3, b, s, dtype=torch.long)
    for r in range(b):
        where = image_mask[r].bool().nonzero().flatten().tolist()
        sizes = [int(h) * int(w) for h, w in grids[r]]
        if any(n < 1 for n in sizes) or sum(sizes) != len(where):
            raise ValueError(
                f"row {r}: images of {list(grids[r])} merged tokens need {sum(sizes)} image positions, "
                f"its mask sets {len(where)}"
            )
        ids = torch.empty(3, s, dtype=torch.long)
        nxt, pos, k = 0, 0, 0
        for (h, w), n in zip(grids[r], sizes):
            first = where[k]
            if where[k + n - 1] != first + n - 1:
                raise ValueError(f"row {r}: an image's {n} positions from {first} are not one run")
            ids[:, pos:first] = torch.arange(first - pos) + nxt
            base = nxt + first - pos
            rows = torch.arange(h).repeat_interleave(w)
            cols = torch.arange(w).repeat(h)
            ids[:, first : first + n] = torch.stack([torch.zeros(n, dtype=torch.long), rows, cols]) + base
            nxt, pos, k = base + max(h, w), first + n, k + n
        ids[:, pos:] = torch.arange(s - pos) + nxt
        out[:, r] = ids
    return out
