"""Sequence packing: 4 EOD-separated documents per sequence (with 0..2 image tiles each) under
Megatron's --reset-attention-mask and --reset-position-ids (Megatron-core's own masks) train exactly as
the same documents one per sequence: loss and parameters against the unpacked world-1 run (fp32, SGD),
on world 1, with CP on the language model, and in a disjoint pipeline."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

SGD = OptimConfig(optimizer="sgd", lr=0.5)
BASE = LlavaSpec(seq_length=64, documents=4, encoders={"vision": EncoderSpec(tokens=2, max_tiles=2, offset=1)})
PACKED = dataclasses.replace(BASE, reset_attention_mask=True, reset_position_ids=True)
UNPACKED = dataclasses.replace(BASE, pack_documents=False)
EDGE = ["vision -> language"]


def _job(spec: LlavaSpec, rows: int, mbs: int) -> JobConfig:
    return JobConfig(spec=spec, global_batch_size=rows, micro_batch_size=mbs, train_iters=3, optim=SGD)


_REF: dict = {}


def _unpacked(spec: LlavaSpec = UNPACKED):
    """The world-1 run of 16 documents per step, one per sequence."""
    key = repr(spec)
    if key not in _REF:
        per_rank = run_job(world1_doc(_job(spec, 16, 4)), 1, _job(spec, 16, 4))
        _REF[key] = (losses(per_rank), full_params(per_rank))
    return _REF[key]


def _check(per_rank, ref, label: str, tol: float = 1e-5) -> None:
    dl = max_loss_rel_diff(losses(per_rank), ref[0])
    dp, where = max_param_rel_diff(full_params(per_rank), ref[1])
    assert dl <= tol, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref[0]}"
    assert dp <= tol, f"{label}: parameter {where} differs by {dp:.2e} relative"


CASES = [
    ("world 1", {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": EDGE}, 1),
    (
        "colocated: vision DP2 -> language CP2",
        {"placement": "colocated", "modules": {"vision": {"dp": 2}, "language": {"cp": 2}}, "edges": EDGE},
        2,
    ),
    (
        "disjoint: vision DP1 | language TP2",
        {
            "placement": "disjoint",
            "modules": {"vision": {"ranks": "0-0"}, "language": {"tp": 2, "ranks": "1-2"}},
            "edges": EDGE,
        },
        3,
    ),
]


@pytest.mark.parametrize("label,doc,world", CASES, ids=[c[0] for c in CASES])
def test_packed_documents_train_as_unpacked(label, doc, world):
    job = _job(PACKED, 4, 1)
    _check(run_job(doc, world, job), _unpacked(), label)


def test_without_the_reset_flags_packing_changes_the_loss():
    per_rank = run_job(world1_doc(_job(BASE, 4, 1)), 1, _job(BASE, 4, 1))
    dl = max_loss_rel_diff(losses(per_rank), _unpacked()[0])
    assert dl > 1e-3, f"documents attending across EOD should train differently, got {dl:.2e}"


def test_packing_with_rope_matches_its_unpacked_run():
    rope = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True}
    packed = dataclasses.replace(PACKED, **rope)
    unpacked = dataclasses.replace(UNPACKED, **rope)
    # RoPE scores depend on relative positions only, so the restart changes rounding, not values
    _check(run_job(world1_doc(_job(packed, 4, 1)), 1, _job(packed, 4, 1)), _unpacked(unpacked), "rope", tol=1e-5)
