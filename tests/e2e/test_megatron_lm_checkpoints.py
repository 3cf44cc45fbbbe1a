"""Checkpoints of Megatron-LM's scripts with a layout (docs/megatron-lm.md, "Checkpoints"), against the
unpatched script: `--ckpt-format torch_dist`, `pretrain_gpt.py --save/--load` with segments, and
`--use-distributed-optimizer`, in one case (the suite's time budget holds one; the VLM with a
language pp 2 and the distributed optimizer in torch format was measured by hand, see the docs).

Needs a Megatron-LM tree (`MEGATRON_LM`, as `test_megatron_lm.py`, whose helpers and tree fixture this
file reuses); CPU/gloo, forked ranks, tiny models, fp32, --clip-grad 0.

The case is three runs: the unpatched script trains from scratch and saves every iteration (the
reference: Megatron's own resume of a torch_dist checkpoint reproduces its training losses and grad
norms exactly); a layout run resumes from the reference's iteration-1 checkpoint, trains on with the
reference's losses, and saves; the unpatched script resumes from the layout's iteration-2
checkpoint with the reference's losses. Compared per iteration: Megatron's "lm loss" log line with
--log-interval 1 is the iteration's own loss except for a run's second line, which averages the
run's first two iterations (its first line does not reset the accumulators; the layout driver's
lines do the same), so `per_iteration` undoes that average; grad norms to the log line's 3 decimals.
Validation lines are compared only where both runs evaluate for the first time (after a resume at
iteration 3 Megatron's own run evaluates a different validation batch than without the resume).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_megatron_lm import EDGE, GPT, GPT_SEGMENTS, GRAD_NORM, RTOL, VLM, Run, torchrun, trees  # noqa: F401
from test_megatron_lm import pytestmark as _megatron_lm_marks

pytestmark = list(_megatron_lm_marks)  # slow; skipped with the reason without MEGATRON_LM

#: Megatron's distributed optimizer in its fully reshardable torch_dist form: the layout run's reference
#: is DP4 (world 4, TP1), the unpatched runs DP2. In the default dp_reshardable form Megatron's own
#: DP4 checkpoint resumed at DP2 is off by 2.5e-3 relative one step after the resume (the unpatched
#: script alone: its Adam state does not survive the change of DP size), and so is the layout's.
DISTOPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
TORCH_DIST = ["--ckpt-format", "torch_dist"]


def per_iteration(run: Run) -> dict[int, float]:
    """Each iteration's own training loss from the run's log lines (see the module docstring)."""
    its = sorted(run.losses)
    out = {i: run.losses[i] for i in its}
    if len(its) > 1:
        out[its[1]] = 2 * run.losses[its[1]] - run.losses[its[0]]
    return out


def grad_norms(run: Run) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in GRAD_NORM.finditer(run.out)}


def assert_resumed_like(run: Run, ref: Run, iterations: list[int], what: str) -> float:
    """`run`'s own loss and grad norm at each of `iterations` equal the reference's; returns the
    largest relative loss difference."""
    assert run.rc == 0, f"{what} failed (rc {run.rc}):\n{run.tail()}"
    assert sorted(run.losses) == iterations, f"{what}: iterations {sorted(run.losses)}\n{run.tail()}"
    got, want = per_iteration(run), per_iteration(ref)
    worst = max(abs(got[i] - want[i]) / abs(want[i]) for i in iterations)
    assert worst <= RTOL, f"{what}: losses {got} vs reference {want} ({worst:.2e})"
    gn, gn_ref = grad_norms(run), grad_norms(ref)
    assert all(abs(gn[i] - gn_ref[i]) <= 2e-3 for i in iterations), (what, gn, gn_ref)
    print(f"{what}: losses {got}, reference {want}, largest relative difference {worst:.2e}; grad norms {gn}")
    return worst


def at_iteration(ckpt: Path, iteration: int, dst: Path) -> Path:
    """A copy of Megatron checkpoint folder `ckpt` holding only iteration `iteration` (Megatron's
    --load reads the latest one)."""
    name = f"iter_{iteration:07d}"
    assert (ckpt / name).is_dir(), sorted(p.name for p in ckpt.iterdir())
    dst.mkdir()
    shutil.copytree(ckpt / name, dst / name)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _distcp(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".distcp")


#: several gradient buckets per module (and in the reference model the checkpoint is saved from)
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"]


def test_gpt_segments_torch_dist_distributed_optimizer_both_ways(trees, tmp_path):  # noqa: F811
    """pretrain_gpt.py, --use-distributed-optimizer, torch_dist: the unpatched TP1·DP2 run's checkpoint
    (Adam moments sharded over DP2, one gradient bucket) resumes in the segments layout (layers 0-1 TP2
    @0-1 -> layers 2-3 DP2 @2-3, each module's own distributed optimizer, reference TP1·DP4) with
    --overlap-grad-reduce (several buckets per module) with the unpatched losses, and the segments run's
    checkpoint (saved from the reference model's several buckets:
    fix.distributed_optimizer_reshardable_buckets) resumes in the unpatched script with them too, also
    in several buckets."""
    ref = torchrun(
        trees["pristine"] / "pretrain_gpt.py",
        GPT + DISTOPT + TORCH_DIST + ["--train-iters", "4", "--save", str(tmp_path / "u"), "--save-interval", "1"],
    )
    assert ref.rc == 0 and sorted(ref.losses) == [1, 2, 3, 4], ref.tail()
    assert min(grad_norms(ref).values()) > 0, ref.tail()
    u1 = at_iteration(tmp_path / "u", 1, tmp_path / "u1")
    assert _distcp(u1 / "iter_0000001") == ["__0_0.distcp", "__1_0.distcp"]
    resume = ["--load", str(u1), "--override-opt_param-scheduler"]
    hetero = torchrun(
        trees["patched"] / "pretrain_gpt.py",
        GPT
        + DISTOPT
        + TORCH_DIST
        + ["--train-iters", "3", "--save", str(tmp_path / "h"), "--save-interval", "2"]
        + resume
        + OVERLAP
        + GPT_SEGMENTS,
        nproc=4,
    )
    assert "language_a tp2·pp1·dp1@0-1, language_b tp1·pp1·dp2@2-3, from iteration 1" in hetero.out, hetero.tail()
    there = assert_resumed_like(hetero, ref, [2, 3], "GPT segments resumed from the unpatched torch_dist checkpoint")
    assert hetero.valid["iteration 2"] == pytest.approx(ref.valid["iteration 2"], rel=RTOL), (hetero.valid, ref.valid)
    h2 = at_iteration(tmp_path / "h", 2, tmp_path / "h2")
    assert _distcp(h2 / "iter_0000002") == [f"__{r}_0.distcp" for r in range(4)]  # the reference layout: DP4
    back = torchrun(
        trees["pristine"] / "pretrain_gpt.py",
        GPT
        + DISTOPT
        + TORCH_DIST
        + OVERLAP
        + ["--train-iters", "4", "--load", str(h2), "--override-opt_param-scheduler"],
    )
    back_diff = assert_resumed_like(
        back, ref, [3, 4], "unpatched GPT resumed from the segments run's torch_dist checkpoint"
    )
    print(f"distributed optimizer, torch_dist: segments resumed {there:.1e}, unpatched resumed {back_diff:.1e} off")


#: --bf16 with Megatron's plain mixed-precision optimizer (fp32 main weights apart from the bf16 params)
BF16 = ["--bf16", "--use-cpu-initialization"]
#: disjoint on 2 ranks: vision @0 -> language @1 (the image embeddings cross the islands in bf16). In
#: bf16 this layout's step is the unpatched one's to the log line (docs/megatron-lm.md, Mixed precision);
#: a colocated layout's is not (one bf16 step of vision DP2 + language PP2 from the unpatched iteration-2
#: checkpoint: the next loss 4.7e-5 off the unpatched step's, a checkpoint of its own resumes bitwise).
VLM_DISJOINT = ["--hetero-placement", "disjoint", "--hetero-module", "vision:dp=1", "--hetero-module", "language:dp=1"]
VLM_DISJOINT += EDGE


def test_vlm_bf16_checkpoint_both_ways(trees, tmp_path):  # noqa: F811
    """pretrain_vlm.py --bf16, torch format: the unpatched TP1·DP2 run's iteration-1 checkpoint (bf16
    weights, fp32 main weights `fp32_from_fp16_params`, Adam moments keyed by them) resumes in the
    disjoint vision @0 -> language @1 with the unpatched run's losses; the layout run's iteration-2
    checkpoint (each module's fp32 main weights and moments gathered into the reference optimizer)
    resumes in the unpatched script with them too."""
    ref = torchrun(
        trees["pristine"] / "pretrain_vlm.py",
        VLM + BF16 + ["--train-iters", "4", "--save", str(tmp_path / "u"), "--save-interval", "1"],
    )
    assert ref.rc == 0 and sorted(ref.losses) == [1, 2, 3, 4], ref.tail()
    u1 = at_iteration(tmp_path / "u", 1, tmp_path / "u1")
    resume = ["--load", str(u1), "--override-opt_param-scheduler"]
    hetero = torchrun(
        trees["patched"] / "pretrain_vlm.py",
        VLM
        + BF16
        + ["--train-iters", "3", "--save", str(tmp_path / "h"), "--save-interval", "2"]
        + resume
        + VLM_DISJOINT,
    )
    assert "from iteration 1" in hetero.out, hetero.tail()
    what = "VLM bf16 vision @0 -> language @1 resumed from the unpatched checkpoint"
    assert_resumed_like(hetero, ref, [2, 3], what)
    assert hetero.valid["iteration 2"] == pytest.approx(ref.valid["iteration 2"], rel=RTOL), (hetero.valid, ref.valid)
    h2 = at_iteration(tmp_path / "h", 2, tmp_path / "h2")
    back = torchrun(
        trees["pristine"] / "pretrain_vlm.py",
        VLM + BF16 + ["--train-iters", "4", "--load", str(h2), "--override-opt_param-scheduler"],
    )
    assert_resumed_like(back, ref, [3, 4], "unpatched VLM bf16 resumed from the layout run's checkpoint")


def test_gpt_moe_expert_parallel_checkpoint_both_ways(trees, tmp_path):  # noqa: F811
    """pretrain_gpt.py MoE (4 experts, top 2; test_megatron_lm_moe's flags), torch_dist: the unpatched
    TP1·DP2 run's (EP 1) iteration-1 checkpoint resumes in one module `language:dp=2,ep=2` (EP rank r
    holds experts 2r, 2r+1 of every layer as its local experts 0, 1: weights and Adam moments) with the
    unpatched run's losses and grad norms, and the layout's iteration-2 checkpoint (each expert gathered
    from the EP rank that holds it) resumes in the unpatched script with them too."""
    from test_megatron_lm import _default_clip, _with
    from test_megatron_lm_moe import MOE

    args = _default_clip(_with(GPT, micro_batch_size="2", global_batch_size="8")) + MOE
    ref = torchrun(
        trees["pristine"] / "pretrain_gpt.py",
        args + ["--train-iters", "4", "--save", str(tmp_path / "u"), "--save-interval", "1"],
    )
    assert ref.rc == 0 and sorted(ref.losses) == [1, 2, 3, 4], ref.tail()
    u1 = at_iteration(tmp_path / "u", 1, tmp_path / "u1")
    hetero = torchrun(
        trees["patched"] / "pretrain_gpt.py",
        args
        + ["--train-iters", "3", "--save", str(tmp_path / "h"), "--save-interval", "2"]
        + ["--load", str(u1), "--override-opt_param-scheduler", "--hetero-module", "language:dp=2,ep=2"],
    )
    assert "language tp1·pp1·dp2@0-1, from iteration 1" in hetero.out, hetero.tail()
    assert_resumed_like(hetero, ref, [2, 3], "GPT MoE language DP2·EP2 resumed from the unpatched checkpoint")
    assert hetero.valid["iteration 2"] == pytest.approx(ref.valid["iteration 2"], rel=RTOL), (hetero.valid, ref.valid)
    h2 = at_iteration(tmp_path / "h", 2, tmp_path / "h2")
    back = torchrun(
        trees["pristine"] / "pretrain_gpt.py",
        args + ["--train-iters", "4", "--load", str(h2), "--override-opt_param-scheduler"],
    )
    assert_resumed_like(back, ref, [3, 4], "unpatched GPT MoE resumed from the DP2·EP2 run's checkpoint")
