"""Training the Qwen2.5-VL tower (`models.qwen_encoder`: the encoder kind "qwen2.5-vl") into a
Qwen2.5 language model with M-RoPE through the runtime: loss and parameter parity of held-out
colocated and disjoint layouts with the world-1 run of the same model and data (fp32, SGD), window
and full attention layers in the tower, the M-RoPE ids of a non-square image."""

from __future__ import annotations

import pytest


from qwen_train_case import JOB

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

E = ["vision -> language"]
CASES = [
    ("colocated: vision TP2, language TP2", "colocated", {"vision": {"tp": 2}, "language": {"tp": 2}}, 2),
    (
        "disjoint: vision DP2 | language CP2",
        "disjoint",
        {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"cp": 2, "ranks": "2-3"}},
        4,
    ),
    (
        "disjoint: vision TP1 | language PP2",
        "disjoint",
        {"vision": {"ranks": "0-0"}, "language": {"pp": 2, "ranks": "1-2"}},
        3,
    ),
]
_REF: dict = {}


def _reference():
    if "ref" not in _REF:
        per_rank = run_job(world1_doc(JOB), 1, JOB)
        _REF["ref"] = (losses(per_rank), full_params(per_rank, gated=True))
    return _REF["ref"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,placement,modules,world", CASES, ids=[c[0] for c in CASES])
def test_qwen_tower_training_matches_world_1(label, placement, modules, world):
    ref_losses, ref_params = _reference()
    assert any(n.startswith("tower.merger.") for n in ref_params["vision"])  # the tower trained
    per_rank = run_job({"placement": placement, "modules": modules, "edges": E}, world, JOB, timeout=360)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank, gated=True), ref_params)
    print(f"\n{label}: loss {dl:.1e}, parameters {dp:.1e} relative ({where})")
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"
