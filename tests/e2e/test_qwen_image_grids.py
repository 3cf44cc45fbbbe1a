"""Images of any (rows, cols) grid, several a sample, through the Qwen2.5-VL encoder module and the
M-RoPE ids (`qwen_encoder.images_grid_thw`, `qwen_positions.grid_mrope_ids`): the module's output
equals the tower run on each image alone, the ids equal Qwen2.5-VL's `rope_index` from the tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hetero.models.qwen_mrope import rope_index
from megatron_hetero.models.qwen_positions import grid_mrope_ids
from megatron_hetero.runtime.launcher import run_ranks

from qwen_train_case import SPEC

GRIDS = [[(2, 3), (3, 2)], [], [(1, 1)]]  # two images, text only, one single-token image


def test_grid_ids_equal_rope_index_from_the_tokens():
    s = 24
    mask = torch.zeros(3, s, dtype=torch.bool)
    mask[0, 2:8], mask[0, 10:16], mask[2, 5] = True, True, True
    tokens = torch.zeros(3, s, dtype=torch.long)
    tokens[mask] = 1
    tokens[0, 1], tokens[0, 9], tokens[2, 4] = 2, 2, 2  # the vision starts before each image
    grid = torch.tensor([[1, 4, 6], [1, 6, 4], [1, 2, 2]])
    want = rope_index(tokens, grid, image_token=1, vision_start=2, merge=2)
    assert torch.equal(grid_mrope_ids(mask, GRIDS), want)


def test_adjacent_images_and_bad_grids():
    mask = torch.zeros(1, 12, dtype=torch.bool)
    mask[0, 1:9] = True  # a 2 x 2 image right after a 2 x 2 image
    ids = grid_mrope_ids(mask, [[(2, 2), (2, 2)]])
    assert ids[:, 0, :10].T.tolist() == [
        [0, 0, 0], [1, 1, 1], [1, 1, 2], [1, 2, 1], [1, 2, 2],  # first image from base 1
        [3, 3, 3], [3, 3, 4], [3, 4, 3], [3, 4, 4],  # the second from the first's base + 2
        [5, 5, 5],
    ]  # fmt: skip
    with pytest.raises(ValueError, match="need 6 image positions"):
        grid_mrope_ids(mask, [[(2, 3)]])


def _images() -> list[float]:
    """World 1: the module on the merged tokens of GRIDS' images (tokens 1 a tile) against the tower
    run on each image alone, and with every sample's tokens read as one square-less image (wrong)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_weights import world_of_one, world_of_one_layout
    from megatron_hetero.training.setup import build_module

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    enc = dataclasses.replace(SPEC.encoders["vision"], tokens=1, image_rows=0, max_tiles=12)
    spec = dataclasses.replace(SPEC, encoders={"vision": enc})
    layout = world_of_one_layout(["vision"])
    with world_of_one(layout) as topo:
        vision = build_module("vision", layout, spec, topo.pg_collection("vision")).cpu().eval()
        x = torch.randn(13, 1, enc.feature_dim, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            got = vision(x, tiles=[12, 0, 1], grids=GRIDS).reshape(-1, SPEC.hidden_size)
            parts, start = [], 0
            for h, w in [g for row in GRIDS for g in row]:
                flat = x[start : start + h * w].reshape(-1, enc.feature_dim // 4)
                parts.append(vision.tower(flat, torch.tensor([[1, 2 * h, 2 * w]])))
                start += h * w
            wrong = vision(x, tiles=[12, 0, 1], grids=[[(3, 4)], [], [(1, 1)]]).reshape(-1, SPEC.hidden_size)
    want = torch.cat(parts)
    return [float((y - want).abs().max() / want.abs().max()) for y in (got, wrong)]


def test_each_image_runs_as_its_own_grid():
    ((got, wrong),) = run_ranks(1, _images, timeout=120)
    print(f"\nimages of their own grids: {got:.1e} relative; read as one 3 x 4 image: {wrong:.1e}")
    assert got <= 1e-6, got
    assert wrong > 1e-4, wrong
