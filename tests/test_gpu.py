"""GPU/NCCL checks: skipped where there is no CUDA GPU; they must pass where there is one.

The ranks are forked before CUDA is initialised in the parent (the launcher's rule), and each binds
its GPU from LOCAL_RANK.
"""
from __future__ import annotations

import pytest
import torch

from megatron_hetero.compat import apply_compat

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

@pytest.mark.timeout(600)
def test_colocated_train_on_gpu_same_loss_across_layouts():
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig, validate_job
    from megatron_hetero.training.trainer import train_rank

    apply_compat()
    n = torch.cuda.device_count()
    job = JobConfig(train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5))
    one = layout_from_dict({"placement": "colocated", "modules": {"vision": {}, "language": {}},
                            "edges": ["vision -> language"]}, world_size=1)
    validate_job(one, job)
    ref = [r["loss"] for r in run_ranks(1, train_rank, one, job, backend="nccl", timeout=500)[0]["records"]]
    assert ref[-1] < ref[0]
    if n >= 2:
        two = layout_from_dict({"placement": "colocated", "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
                                "edges": ["vision -> language"]}, world_size=2)
        got = [r["loss"] for r in run_ranks(2, train_rank, two, job, backend="nccl", timeout=500)[0]["records"]]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-5
