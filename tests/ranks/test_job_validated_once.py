"""A job is validated once per process and each rank's plan computed once: `validate_job` returns the
`Job` that carries the rank plans' checked arithmetic, and the forked ranks of `run_local` build
their own plans from it without running `check_rank_plans` again (they would fail here if they did),
with the losses of the ranks that compute it themselves."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan import rank_plan as rank_plan_module
from megatron_hetero.plan.rank_plan import check_rank_plans
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.config.job import Job
from megatron_hetero.training.job import run_local
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job
from megatron_hetero.training.trainer import train_rank

DOC = {
    "placement": "disjoint",
    "modules": {"vision": {"tp": 1, "dp": 1, "ranks": "0-0"}, "language": {"tp": 1, "pp": 2, "dp": 1, "ranks": "1-2"}},
    "edges": ["vision -> language"],
}


def test_forked_ranks_plan_from_the_validated_job(monkeypatch) -> None:
    layout = layout_from_dict(DOC, world_size=3)
    config = JobConfig(
        spec=LlavaSpec(num_layers=2), global_batch_size=4, micro_batch_size=1, train_iters=1, optim=OptimConfig(lr=0.1)
    )
    job = validate_job(JobDraft(layout, config))
    assert isinstance(job, Job) and (job.layout, job.config) == (layout, config)
    assert job.checked[1] == check_rank_plans(layout, 4, 1)[1]  # the same micro-batching
    unchecked = dataclasses.replace(job, checked=None)  # its ranks compute the plan arithmetic themselves
    want = [r["loss"] for r in run_ranks(3, train_rank, unchecked, timeout=120)[0]["records"]]

    def again(*args, **kwargs):
        raise AssertionError("a rank computed the layout's plan arithmetic again")

    monkeypatch.setattr(rank_plan_module, "check_rank_plans", again)  # the forked ranks inherit it
    got = [r["loss"] for r in run_local(job, timeout=120)]
    assert got == want  # bit for bit
    with pytest.raises(Exception, match="computed the layout's plan arithmetic again"):
        run_ranks(3, train_rank, unchecked, timeout=120)
