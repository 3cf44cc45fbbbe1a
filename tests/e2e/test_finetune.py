"""Megatron-LM's `--finetune`, `--no-load-optim` and `--no-load-rng` on `train --load`
(`checkpoint/loadable.py`, `checkpoint/save_load.py`).

A rope model (no position table: its sequence length may change under --finetune) is trained 2 steps
at global batch 8 under TP2 and saved. `--finetune --load` of it at batch 4 and another sequence
length starts at iteration 1 (consumed samples 4, 8, ...), with a fresh optimizer and schedule, and
its losses equal (1e-5 relative: another layout) those of a world-1 run whose modules got the saved
weights by hand (the full tensors of the saving run copied into the freshly built modules, nothing
of the checkpoint code). `--no-load-optim` continues at iteration 3 on the same data with the saved
weights (its first loss is the full resume's, bitwise) but a fresh Adam and a fresh schedule (its
learning rates are the first run's first ones, its second loss is not the resume's). fp32, world <= 2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from parity import full_params, losses, max_loss_rel_diff, run_job
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.config.lr_schedule import LRSchedule
from megatron_hetero.training.setup import JobConfig

TP2 = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language"],
}
WORLD1 = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
SPEC = LlavaSpec(position_embedding_type="rope")
# a warm-up, so that the learning rate tells a fresh schedule (step 1) from the checkpoint's (step 3)
JOB = JobConfig(
    spec=SPEC, train_iters=2, optim=OptimConfig(lr=1e-2), schedule=LRSchedule(lr_warmup_iters=4, lr_decay_iters=10)
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, megatron_compat):
    """The 2-step run under TP2 that saved at iteration 2: (its folder, its records, its full weights)."""
    root = tmp_path_factory.mktemp("finetune") / "run"
    per_rank = run_job(TP2, 2, dataclasses.replace(JOB, save=str(root)))
    return root, per_rank[0]["records"], full_params(per_rank)


def _train_from_weights(job, weights: dict[str, dict[str, torch.Tensor]]) -> dict:
    """train_rank of a fresh job (no --load) on a world-1 layout whose modules, once built, take
    `weights` (full tensors by module and parameter name) by hand; the optimizers start afresh."""
    from megatron_hetero.training import llava_spec, trainer

    build = llava_spec.build_states  # what the session's spec (`LlavaTrainSpec`) builds its states with

    def build_with_weights(plan, job_, topo):
        states = build(plan, job_, topo)
        with torch.no_grad():
            for name, st in states.items():
                params = dict(st.module.named_parameters())
                assert set(params) == set(weights[name]), (name, set(params) ^ set(weights[name]))
                for k, p in params.items():
                    p.copy_(weights[name][k])
        return states

    llava_spec.build_states = build_with_weights  # in this forked rank only
    return trainer.train_rank(job)


@pytest.mark.timeout(300)
def test_finetune_takes_the_weights_only_at_another_batch_and_sequence_length(saved):
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.runtime.launcher import run_ranks
    from megatron_hetero.training.setup import JobDraft, validate_job

    root, _, weights = saved
    spec = dataclasses.replace(SPEC, seq_length=24)
    # another batch, sequence length, --train-iters and schedule: all this job's
    job = dataclasses.replace(
        JOB, spec=spec, global_batch_size=4, train_iters=3, schedule=LRSchedule(lr_warmup_iters=2, lr_decay_iters=10)
    )
    tuned = run_job(TP2, 2, dataclasses.replace(job, load=str(root), finetune=True))[0]["records"]
    assert [r["iteration"] for r in tuned] == [1, 2, 3]
    assert [r["consumed_samples"] for r in tuned] == [4, 8, 12]
    layout = layout_from_dict(WORLD1, world_size=1)
    ref = run_ranks(1, _train_from_weights, validate_job(JobDraft(layout, job)), weights, timeout=180)[0]["records"]
    got, want = [r["loss"] for r in tuned], [r["loss"] for r in ref]
    diff = max_loss_rel_diff(got, want)
    print(f"--finetune (TP2) vs weights by hand (world 1): losses {got} / {want}, max relative difference {diff:.2e}")
    assert diff <= 1e-5, (got, want)
    assert [r["lr"] for r in tuned] == pytest.approx([r["lr"] for r in ref], rel=1e-12)
    # the weights mattered: a fresh model's first loss is another
    fresh = losses(run_job(WORLD1, 1, dataclasses.replace(job, train_iters=1)))
    assert abs(fresh[0] - got[0]) > 1e-3 * abs(got[0]), (fresh, got)


@pytest.mark.timeout(300)
def test_no_load_optim_resumes_the_weights_and_position_with_a_fresh_optimizer(saved):
    root, first, _ = saved
    job = dataclasses.replace(JOB, train_iters=4, load=str(root))
    resumed = run_job(TP2, 2, job)[0]["records"]
    fresh_optim = run_job(TP2, 2, dataclasses.replace(job, no_load_optim=True, no_load_rng=True))[0]["records"]
    assert [r["iteration"] for r in fresh_optim] == [3, 4] == [r["iteration"] for r in resumed]
    assert [r["consumed_samples"] for r in fresh_optim] == [24, 32]
    print("resume:", [r["loss"] for r in resumed], "--no-load-optim:", [r["loss"] for r in fresh_optim])
    assert fresh_optim[0]["loss"] == resumed[0]["loss"]  # the same weights on the same samples
    assert abs(fresh_optim[1]["loss"] - resumed[1]["loss"]) > 1e-6 * abs(resumed[1]["loss"])  # Adam afresh
    # the schedule afresh (Megatron-LM: --no-load-optim skips the scheduler too): the first run's rates
    assert [r["lr"] for r in fresh_optim] == pytest.approx([r["lr"] for r in first], rel=1e-12)
    assert [r["lr"] for r in resumed] != pytest.approx([r["lr"] for r in first], rel=1e-6)


def test_pretrained_checkpoint_finetunes_until_load_holds_a_save(saved, tmp_path):
    """Megatron-LM's --pretrained-checkpoint: with --load empty (a first job), the job is --finetune
    --load PRETRAINED (and the recorded model); once --load holds a save (a requeued job), it resumes
    that one."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args

    root, _, _ = saved
    layout = layout_from_dict(TP2, world_size=2)

    def job(load: str):
        argv = ["train", "--pretrained-checkpoint", str(root), "--load", load, "--global-batch-size", "4"]
        return job_from_args(build_parser().parse_args(argv), layout).config

    first = job(str(tmp_path / "stage2"))
    assert (first.load, first.finetune, first.spec.position_embedding_type) == (str(root), True, "rope")
    again = job(str(root))  # holds a save: a resume of it
    assert (again.load, again.finetune) == (str(root), False)
