"""Native-resolution images through the runtime: the Qwen2.5-VL tower with variable image tokens
(`EncoderSpec.max_tiles`: a sample's 0..2 tiles of 2 x 3 merged tokens are one image of 0, 2 or 4
rows, so images of different sizes share a batch; `models.qwen_encoder.tile_grid_thw`), their tokens
through the boundaries as variable tokens, the M-RoPE ids per image size
(`models.qwen_positions.batch_mrope_ids`): loss and parameter parity of a colocated and a disjoint
held-out layout with the world-1 run (fp32, SGD)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hetero.models.qwen_encoder import tile_grid_thw
from megatron_hetero.models.qwen_positions import batch_mrope_ids
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from qwen_train_case import QWEN, SPEC

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

NATIVE = dataclasses.replace(SPEC, encoders={"vision": dataclasses.replace(QWEN, max_tiles=2)})
JOB = JobConfig(
    spec=NATIVE, global_batch_size=4, micro_batch_size=2, train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5)
)
E = ["vision -> language"]
CASES = [
    ("colocated: vision TP2, language TP2", "colocated", {"vision": {"tp": 2}, "language": {"tp": 2}}, 2),
    (
        "disjoint: vision DP2 | language PP2",
        "disjoint",
        {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"pp": 2, "ranks": "2-3"}},
        4,
    ),
    (
        "disjoint: vision TP1 | language CP2",
        "disjoint",
        {"vision": {"ranks": "0"}, "language": {"cp": 2, "ranks": "1-2"}},
        3,
    ),
]
_REF: dict = {}


def test_a_samples_tiles_are_one_taller_image_and_its_ids_follow_it():
    assert tile_grid_thw(QWEN, [2, 0, 1], 3).tolist() == [[1, 8, 6], [1, 4, 6]]
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, 2:14] = True  # 2 tiles: 4 x 3 merged tokens
    ids = batch_mrope_ids(QWEN, mask, [2, 0])
    assert ids[:, 0, 2].tolist() == [2, 2, 2] and ids[:, 0, 13].tolist() == [2, 5, 4]  # last: row 3, column 2
    assert ids[:, 0, 14].tolist() == [6, 6, 6]  # text continues after max(rows, cols) = 4
    assert ids[:, 1].tolist() == [list(range(16))] * 3  # no image: text ids
    with pytest.raises(ValueError, match="do not add up"):
        tile_grid_thw(QWEN, [2, 1], 2)


def test_the_steps_mix_image_sizes_in_one_batch():
    from megatron_hetero.data import synthetic
    from megatron_hetero.models.llava import data_config

    steps = [synthetic.image_tiles(data_config(NATIVE), 4 * i, 4)["vision"] for i in range(JOB.train_iters)]
    assert any(len({n for n in step if n}) == 2 for step in steps), steps  # a 2-row and a 4-row image together


def _reference():
    if "ref" not in _REF:
        per_rank = run_job(world1_doc(JOB), 1, JOB)
        _REF["ref"] = (losses(per_rank), full_params(per_rank, gated=True))
    return _REF["ref"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,placement,modules,world", CASES, ids=[c[0] for c in CASES])
def test_native_resolution_training_matches_world_1(label, placement, modules, world):
    ref_losses, ref_params = _reference()
    per_rank = run_job({"placement": placement, "modules": modules, "edges": E}, world, JOB, timeout=360)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank, gated=True), ref_params)
    print(f"\n{label}: loss {dl:.1e}, parameters {dp:.1e} relative ({where}); losses {losses(per_rank)}")
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"
