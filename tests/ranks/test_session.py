"""`training.session.Session`, the one assembly both front ends use: a model spec that fails while
its session is built leaves nothing behind (the spec released, the layout's process groups
destroyed; a new session builds and steps in the same processes), and `finish()` closes the
schedule once, with a world barrier only where the spec asks (the scripts' spec does)."""

from __future__ import annotations

import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job

DOC = {
    "placement": "colocated",
    "modules": {"vision": {"tp": 1, "dp": 2, "ranks": "0-1"}, "language": {"tp": 2, "dp": 1, "ranks": "0-1"}},
    "edges": ["vision -> language"],
}
JOB = JobConfig(
    spec=LlavaSpec(num_layers=2), global_batch_size=4, micro_batch_size=2, train_iters=1, optim=OptimConfig(lr=0.1)
)


def _rank_fails_then_builds(job) -> dict:
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.llava_spec import LlavaTrainSpec
    from megatron_hetero.training.session import Session
    from megatron_hetero.training.trainer import prepare_rank

    calls: list[str] = []
    destroy = Topology.destroy

    def counted(self) -> None:
        calls.append("destroy")
        destroy(self)

    Topology.destroy = counted  # this forked rank's class only

    class Failing(LlavaTrainSpec):
        def front_end(self, session):
            raise ValueError("the front end refused")

        def release(self) -> None:
            calls.append("release")

    prepare_rank(job.config)
    try:
        Session(job, Failing(job))
    except ValueError as exc:
        calls.append(str(exc))
    failed = list(calls)
    s = Session(job, LlavaTrainSpec(job))  # the same groups again, in the same processes
    try:
        loss = s.schedule.step(0).loss
    finally:
        s.destroy()
    return {"failed": failed, "loss": loss, "calls": calls}


def test_a_spec_failing_while_building_leaves_no_groups_behind() -> None:
    from megatron_hetero.training.trainer import train_rank

    job = validate_job(JobDraft(layout_from_dict(DOC, world_size=2), JOB))
    got = run_ranks(2, _rank_fails_then_builds, job, timeout=120)
    want = run_ranks(2, train_rank, job, timeout=120)[0]["records"][0]["loss"]
    for r in got:
        # the topology destroyed after the spec released what it held, then the error raised
        assert r["failed"] == ["release", "destroy", "the front end refused"], r["failed"]
        assert r["calls"][-1] == "destroy"  # the second session torn down too
        assert r["loss"] == want  # the rebuilt session trains as train's own first step, bit for bit


def _rank_finish(job, barrier: bool) -> list[str]:
    from megatron_hetero.training.llava_spec import LlavaTrainSpec
    from megatron_hetero.training.session import Session
    from megatron_hetero.training.trainer import prepare_rank

    prepare_rank(job.config)
    spec = LlavaTrainSpec(job)
    spec.barrier_at_finish = barrier
    s = Session(job, spec)
    calls: list[str] = []
    close, barrier_fn = s.schedule.close, dist.barrier
    try:
        s.schedule.step(0)
        s.schedule.close = lambda: (calls.append("close"), close())[1]
        dist.barrier = lambda *a, **k: (calls.append("barrier"), barrier_fn(*a, **k))[1]
        s.finish()
    finally:
        dist.barrier = barrier_fn
        s.destroy()
    return calls


def test_finish_closes_the_schedule_and_meets_where_the_spec_asks() -> None:
    job = validate_job(JobDraft(layout_from_dict(DOC, world_size=2), JOB))
    assert run_ranks(2, _rank_finish, job, False, timeout=120) == [["close"]] * 2
    assert run_ranks(2, _rank_finish, job, True, timeout=120) == [["close", "barrier"]] * 2
