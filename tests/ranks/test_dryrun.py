"""`megatron-hetero dryrun` against the real thing: every rank of a world-4 colocated, a world-8
colocated one with modules of equal shape (one set of groups for both), a world-8 disjoint layout
(with the distributed optimizer) and a world-3 disjoint one with a Qwen2.5-VL tower on two pipeline
stages, dry-run on the fake process group in
processes of their own, builds what the real fork-launched ranks of `train` build in their Session
(gloo): the same rank plan, the same boundary plans, the same process groups (created, and the rank
sets of those this rank belongs to: from the real groups' own ranks) and the same state bytes
(parameters, DDP's gradient buffers, and the optimizer's state after one real step). A job train
refuses exits 2 with train's message."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.config.job import JobConfig

from qwen_train_case import SPEC as QWEN_SPEC

pytestmark = pytest.mark.usefixtures("megatron_compat")

COLOC4 = {
    "placement": "colocated",
    "modules": {"vision": {"tp": 2, "dp": 2}, "language": {"tp": 1, "pp": 2, "dp": 2}},
    "edges": ["vision -> language"],
}
DISJ8 = {
    "placement": "disjoint",
    "modules": {
        "vision": {"tp": 1, "dp": 4, "ranks": "0-3"},
        "language": {"tp": 2, "pp": 2, "dp": 1, "ranks": "4-7"},
    },
    "edges": ["vision -> language"],
}
# colocated modules of equal shape: one set of groups, both modules' collections over it
EQUAL8 = {
    "placement": "colocated",
    "modules": {"vision": {"tp": 2, "pp": 2, "dp": 2}, "language": {"tp": 2, "pp": 2, "dp": 2}},
    "edges": ["vision -> language"],
}
# the Qwen2.5-VL tower on two pipeline stages (its stage tensor: the image's patches) and an M-RoPE
# language model (its position ids built with data under the meta device)
QWEN_PP3 = {
    "placement": "disjoint",
    "modules": {"vision": {"pp": 2, "ranks": "0-1"}, "language": {"ranks": "2-2"}},
    "edges": ["vision -> language"],
}
PLAIN = OptimConfig(adam_eps=1e-5)
CASES = {
    "qwen-tower-pp2-disjoint-3": (
        QWEN_PP3,
        3,
        JobConfig(spec=QWEN_SPEC, train_iters=1, micro_batch_size=2, optim=PLAIN),
    ),
    "colocated-4": (COLOC4, 4, JobConfig(train_iters=1, optim=PLAIN)),
    "colocated-equal-8": (EQUAL8, 8, JobConfig(train_iters=1, optim=PLAIN)),
    "disjoint-8": (
        DISJ8,
        8,
        JobConfig(train_iters=1, micro_batch_size=4, optim=dataclasses.replace(PLAIN, use_distributed_optimizer=True)),
    ),
}


def _real_rank(job) -> dict:
    """A real rank: train's Session (groups counted), its plan and boundaries, one step, the bytes."""
    from megatron_hetero.training.dryrun import GroupCounter, _digest, boundary_digest
    from megatron_hetero.runtime.schedules import Schedule
    from megatron_hetero.training.trainer import prepare_rank, train_session

    prepare_rank(job.config)
    with GroupCounter() as gc:
        s = train_session(job, log=None)
    try:
        assert isinstance(s.schedule, Schedule), type(s.schedule)  # both placements' interpreters
        member = sorted(
            tuple(sorted(dist.get_process_group_ranks(g)))
            for mg in s.topo.modules.values()
            for g in mg.groups
            if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER
        )
        bnds = {str(k): b for k, b in s.schedule.boundaries.items()}
        boundaries = {k: {str(q): boundary_digest(b, q) for q in b._plans} for k, b in bnds.items()}
        s.schedule.step(0)
        state = {}
        for n, st in s.states.items():
            grads = 0
            if st.ddp is not None:
                grads = sum(
                    b.grad_data.numel() * b.grad_data.element_size()
                    for b in st.ddp.buffers + st.ddp.expert_parallel_buffers
                )
            state[n] = {
                "params": sum(p.numel() * p.element_size() for p in st.module.parameters()),
                "grads": grads,
                "optimizer": st.optimizer_state_bytes(),
            }
        shared = None
        if len(s.states) == 2:
            a, b = (st.pgs for st in s.states.values())
            shared = all(getattr(a, f) is getattr(b, f) for f in ("tp", "cp", "dp", "pp", "dp_cp", "mp", "expt_dp"))
        return {
            "shared": shared,
            "created": gc.created,
            "member": member,
            "plan": _digest(s.plan),
            "boundaries": boundaries,
            "state": state,
        }
    finally:
        s.destroy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_dryrun_builds_what_the_real_ranks_build(case: str) -> None:
    from megatron_hetero.compat import default_backend
    from megatron_hetero.training.dryrun_world import dry_world
    from megatron_hetero.training.setup import JobDraft, validate_job

    doc, world, job = CASES[case]
    layout = layout_from_dict(doc, world_size=world)
    draft = JobDraft(layout, job)
    dry = dry_world(draft, list(range(world)), jobs=2, baseline=False)
    real = run_ranks(world, _real_rank, validate_job(draft), backend=default_backend(), timeout=300)
    assert [r["rank"] for r in dry["ranks"]] == list(range(world))
    for d, r in zip(dry["ranks"], real):
        rank = d["rank"]
        assert d["plan_digest"] == r["plan"], rank
        assert d["groups_created"] == r["created"], (rank, d["groups_created"], r["created"])
        assert [tuple(g) for g in d["group_members"]] == r["member"], rank
        assert d["groups_member"] == len(r["member"])
        # fixed-shape data: one plan per boundary, the one the real schedule planned
        assert d["boundaries"] == r["boundaries"], rank
        mods = d["state_bytes"]["modules"]
        assert set(mods) == set(r["state"]), rank
        for n, want in r["state"].items():
            assert mods[n]["built"] == want, (rank, n, mods[n]["built"], want)
        assert d["state_bytes"]["built"] == sum(sum(v.values()) for v in r["state"].values())
        if case == "colocated-equal-8":  # no duplicate grid: both modules' collections hold the same groups
            assert r["shared"] is True, rank
    if case == "disjoint-8":  # the distributed optimizer shards Adam's state over the module's DP
        v = dry["ranks"][0]["state_bytes"]["modules"]["vision"]["built"]
        assert 0 < v["optimizer"] < 2 * v["grads"]


def test_dryrun_variable_tokens_plans_every_shape() -> None:
    """Variable image tokens (max_tiles 2): the boundary is planned for every edge length the data
    can produce: 0, 1 or 2 tiles of 4 tokens per sample, so a call's longest run is 1 (the minimal
    tensor of a text-only call), 4 or 8 on a CP-1 language model, as the runtime plans them
    (`Boundary.plan_for`)."""
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.model import EncoderSpec
    from megatron_hetero.config.job import JobDraft
    from megatron_hetero.training.dryrun_world import dry_world

    spec = LlavaSpec(encoders={"vision": EncoderSpec(tokens=4, max_tiles=2)})
    layout = layout_from_dict(COLOC4, world_size=4)
    job = JobConfig(train_iters=1, optim=PLAIN, spec=spec)
    dry = dry_world(JobDraft(layout, job), [0], jobs=1, baseline=False)
    assert list(dry["ranks"][0]["boundaries"]["vision->language"]) == ["1", "4", "8"]


def _message(capsys, argv: list[str]) -> tuple[int, str]:
    from megatron_hetero.cli import main

    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_dryrun_refuses_what_train_refuses(tmp_path, capsys) -> None:
    """A batch the layout cannot split: exit 2 with train's message, before any process starts."""
    import yaml

    path = tmp_path / "layout.yaml"
    path.write_text(yaml.safe_dump(COLOC4))
    args = [str(path), "--global-batch-size", "5", "--nproc-per-node", "4"]
    code_t, train = _message(capsys, ["train", "--hetero-layout", *args[:1], *args[1:]])
    code_d, dry = _message(capsys, ["dryrun", *args])
    assert code_t == code_d == 2
    assert train.startswith("megatron-hetero train: invalid input: ") and "divisible" in train
    assert dry == train.replace("megatron-hetero train:", "megatron-hetero dryrun:")
