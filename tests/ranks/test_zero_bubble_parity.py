"""`--hetero-schedule zb` (the disjoint schedule's zero-bubble tables: each backward split into its
input-gradient pass and weight-gradient pass) trains exactly what 1F1B trains: the same losses at every
step and the same parameters on every rank after the last step, bit for bit (fp32, SGD), on a PP chain
with a TP language module and on the LLM-segments layout (TP segment -> DP segment)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
from megatron_hetero.training.trainer import train_rank

JOB = JobConfig(
    spec=LlavaSpec(num_layers=4),
    global_batch_size=8,
    micro_batch_size=1,
    train_iters=3,
    optim=OptimConfig(optimizer="sgd", lr=0.1),
    comm_timeout_s=60.0,
)
CASES = [
    (
        "enc PP2@0-1 -> LLM TP2·PP2@2-5",
        {
            "placement": "disjoint",
            "modules": {"vision": {"pp": 2}, "language": {"tp": 2, "pp": 2}},
            "edges": ["vision -> language"],
        },
        6,
        1,
    ),
    (
        "segments enc DP1@0 -> layers 0-1 TP2@1-2 -> layers 2-3 DP2@3-4",
        {
            "placement": "disjoint",
            "modules": {
                "vision": {},
                "language_a": {"tp": 2, "layers": "0-1"},
                "language_b": {"dp": 2, "layers": "2-3"},
            },
            "edges": ["vision -> language_a", "language_a -> language_b"],
        },
        5,
        2,
    ),
]


def _run(doc: dict, world: int, job: JobConfig):
    layout = layout_from_dict(doc, world_size=world)
    return run_ranks(world, train_rank, validate_job(JobDraft(layout, job)), collect_params=True, timeout=120)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_zero_bubble_equals_1f1b_exactly(case):
    _, doc, world, mbs = case
    job = dataclasses.replace(JOB, micro_batch_size=mbs)
    one = _run(doc, world, job)
    zb = _run(doc, world, dataclasses.replace(job, hetero_schedule="zb"))
    losses = [r["loss"] for r in one[0]["records"]]
    assert len(losses) == 3 and all(x == x for x in losses)
    assert [r["loss"] for r in zb[0]["records"]] == losses
    for rank, (a, b) in enumerate(zip(one, zb)):
        assert a["params"].keys() == b["params"].keys()
        for module, params in a["params"].items():
            for name, t in params.items():
                assert torch.equal(t, b["params"][module][name]), (rank, module, name)


def test_zero_bubble_is_refused_on_colocated_placement():
    layout = layout_from_dict(
        {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]},
        world_size=1,
    )
    with pytest.raises(ValueError, match="--hetero-schedule zb applies to the disjoint schedule only"):
        validate_job(JobDraft(layout, dataclasses.replace(JOB, hetero_schedule="zb")))
