"""GPU/NCCL checks: skipped where there is no CUDA GPU; they must pass where there is one.

The ranks are forked before CUDA is initialised in the parent (the launcher's rule), and each binds
its GPU from LOCAL_RANK. What one GPU can run (a world-1 NCCL job) runs on one GPU; the two-rank
layout needs one GPU per rank (NCCL refuses two ranks on one device) and says so when it skips.
Compat is applied by tests/conftest.py (on a GPU machine only the pg_collection fix acts).
"""

from __future__ import annotations

import pytest
import torch

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
from megatron_hetero.training.trainer import train_rank

# torch.cuda.device_count() reads NVML/the driver without initialising CUDA in this process, so the
# launcher can still fork afterwards.
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (NCCL); none is present"),
]

JOB = JobConfig(train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5))


def _losses(doc: dict, world: int) -> list[float]:
    layout = layout_from_dict(doc, world_size=world)
    per_rank = run_ranks(world, train_rank, validate_job(JobDraft(layout, JOB)), backend="nccl", timeout=500)
    return [r["loss"] for r in per_rank[0]["records"]]


_REFERENCE: list[float] = []


def _reference() -> list[float]:
    """The world-1 NCCL run (one GPU), computed once per session."""
    if not _REFERENCE:
        one = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
        _REFERENCE.extend(_losses(one, 1))
    return list(_REFERENCE)


@pytest.mark.timeout(600)
def test_world1_trains_on_one_gpu():
    ref = _reference()
    assert len(ref) == JOB.train_iters
    assert all(torch.isfinite(torch.tensor(ref))), ref
    assert ref[-1] < ref[0], ref


@pytest.mark.timeout(600)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (one per NCCL rank); {GPUS} present")
def test_colocated_two_gpus_same_loss_as_world1():
    two = {
        "placement": "colocated",
        "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
        "edges": ["vision -> language"],
    }
    got, ref = _losses(two, 2), _reference()
    assert len(got) == len(ref) == JOB.train_iters
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)


@pytest.mark.timeout(600)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (one per NCCL rank); {GPUS} present")
def test_disjoint_on_nccl_same_loss_as_world1():
    """The disjoint schedule's batch_isend_irecv batches on NCCL: encoder @0 -> language PP1 @1, and
    with 3+ GPUs a pipelined language model (fused send-forward/receive-backward pairs)."""
    two = {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    got, ref = _losses(two, 2), _reference()
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
    if GPUS >= 3:
        three = {
            "placement": "disjoint",
            "modules": {"vision": {}, "language": {"pp": 2}},
            "edges": ["vision -> language"],
        }
        got = _losses(three, 3)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
