"""Mixed precision in `train`: `--bf16` checkpoints and `--fp16` with Megatron's dynamic loss scaler
(tiny LLaVA, Adam, global batch 8, 2 ranks, 2-3 steps).

bf16: a checkpoint holds the model's bf16 weights, the optimizer's fp32 main weights
(`optimizer.state.fp32_param.*`; the distributed optimizer's `optimizer.state.param.*`) and the Adam
moments. Reference: the uninterrupted 3-step run. Resumed at step 2 under the same layout the step-3
loss is bitwise the uninterrupted one's (with the non-distributed optimizer and with the distributed
one, which reads the main weights the other saved: taking them from the bf16 model weights instead
would not be bitwise); resumed under a disjoint layout it is within bf16 noise of it.

fp16 (`--fp16 --initial-loss-scale 4096 --hysteresis 1`): reference, the fp32 run; the first two
losses agree within fp16 noise (a loss scale that were not applied, or not undone, would change the
second loss by ~1e-2 relative: the first step lowers it by 1.7%). An inf written into the vision
module's gradients on rank 0 alone at step 2 skips step 2 on every rank and module (every
parameter after it is what it was before it) and halves the loss scale on every rank (rank 1's vision
replica and both language replicas saw no inf themselves: the flag is agreed over the world); the
checkpoint saved after step 3 holds the halved scale, and a checkpoint saved before any step
succeeded (no Adam state yet) resumes with its scale.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_hetero.training.setup import JobConfig

from parity import losses, max_loss_rel_diff, run_job

# vision DP2 + language DP2 on 2 ranks (the distributed optimizer shards both); disjoint: vision on
# rank 0, language on rank 1
COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"dp": 2}},
    "edges": ["vision -> language"],
}
DISJOINT = {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
_FP32 = JobConfig(train_iters=3)
BF16 = dataclasses.replace(
    _FP32, spec=dataclasses.replace(_FP32.spec, bf16=True), optim=dataclasses.replace(_FP32.optim, bf16=True)
)
# Measured (megatron-core 0.19.2): an uninterrupted disjoint run differs from a colocated language-TP2
# one by up to 5.9e-5 relative after 3 bf16 steps (bf16 rounding of another reduction order); resumed
# from this checkpoint the disjoint step-3 loss is bitwise, from a language-TP2 one 1.1e-5 off.
BF16_LAYOUT_TOL = 1e-4
FP16 = dataclasses.replace(
    _FP32,
    spec=dataclasses.replace(_FP32.spec, fp16=True),
    optim=dataclasses.replace(_FP32.optim, fp16=True, initial_loss_scale=4096.0, hysteresis=1),
)
# Measured: fp16 losses within 6e-5 relative of fp32 over 3 steps (colocated and disjoint)
FP16_TOL = 5e-4


def _same_params(a: list[dict], b: list[dict]) -> bool:
    """Every rank's parameters after the last step are bitwise equal in the two runs (same layout). The
    step's loss is computed from the bf16 weights before the update; the update shows whether the fp32
    main weights it started from were the saved ones (bf16 weights cast up would differ here)."""
    import torch

    return all(
        pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
        for ra, rb in zip(a, b)
        for pa, pb in ((ra["params"][m], rb["params"][m]) for m in ra["params"])
    )


@pytest.mark.timeout(300)
def test_bf16_checkpoint_resumes_bitwise_and_under_another_layout(tmp_path):
    full_run = run_job(COLOC, 2, BF16)
    full = losses(full_run)
    root = str(tmp_path / "run")
    first = losses(run_job(COLOC, 2, dataclasses.replace(BF16, train_iters=2, save=root, save_interval=2)))
    assert first == full[:2]
    same_run = run_job(COLOC, 2, dataclasses.replace(BF16, load=root))
    same = losses(same_run)
    print(f"bf16 uninterrupted {full}; resumed, same layout {same}")
    assert same == full[2:]  # bitwise
    assert _same_params(same_run, full_run), "parameters after the resumed step differ"
    dist = dataclasses.replace(BF16.optim, use_distributed_optimizer=True)
    dist_run = run_job(COLOC, 2, dataclasses.replace(BF16, optim=dist, load=root))
    print(f"resumed with the distributed optimizer {losses(dist_run)}")
    assert losses(dist_run) == full[2:]
    assert _same_params(dist_run, full_run), "distributed optimizer"  # its fp32 main weights came from the checkpoint
    disjoint = losses(run_job(DISJOINT, 2, dataclasses.replace(BF16, load=root)))
    diff = max_loss_rel_diff(disjoint, full[2:])
    print(f"resumed disjoint {disjoint}: rel. diff {diff:.1e}")
    assert diff <= BF16_LAYOUT_TOL, (disjoint, full[2:])


def _inject_inf_and_watch(monkeypatch, out_dir, module: str, rank: int, step: int) -> None:
    """In the ranks forked after this: after each module's gradient reduction (one per step), write
    the module's parameter checksum and its optimizer's loss scale(r) to `out_dir/<rank>.jsonl`; on
    `rank`, at `step`, put an inf into `module`'s reduced gradients first."""
    import torch.distributed as dist

    from megatron_hetero.runtime.module_state import ModuleState

    original = ModuleState.finalize_grads
    calls: dict[str, int] = {}

    def finalize_grads(self) -> None:
        original(self)
        calls[self.name] = calls.get(self.name, 0) + 1
        if self.ddp is None:
            return
        if self.name == module and dist.get_rank() == rank and calls[self.name] == step:
            self.ddp.buffers[0].grad_data[0] = float("inf")
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        line = {
            "module": self.name,
            "step": calls[self.name],
            "checksum": float(sum(p.detach().double().sum() for p in self.module.parameters())),
            "shares_scaler": all(o.grad_scaler is self.loss_scaler for o in inner),
            "scales": [float(o.get_loss_scale().item()) for o in inner],  # what this step unscales by
        }
        with open(out_dir / f"{dist.get_rank()}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    monkeypatch.setattr(ModuleState, "finalize_grads", finalize_grads)


@pytest.mark.timeout(300)
def test_fp16_losses_and_one_loss_scale_skipped_everywhere(tmp_path, monkeypatch):
    ref = losses(run_job(COLOC, 2, dataclasses.replace(_FP32, train_iters=2)))
    watch = tmp_path / "watch"
    watch.mkdir()
    _inject_inf_and_watch(monkeypatch, watch, "vision", rank=0, step=2)
    root = tmp_path / "run"
    per_rank = run_job(COLOC, 2, dataclasses.replace(FP16, save=str(root)))
    got = losses(per_rank)
    diff = max_loss_rel_diff(got[:2], ref)
    print(f"fp16 {got} vs fp32 {ref}: rel. diff {diff:.1e}")
    assert diff <= FP16_TOL, (got, ref)
    for r, result in enumerate(per_rank):
        recs = result["records"]
        scales = [x["loss_scale"] for x in recs]
        print(f"rank {r}: skipped {[x['skipped'] for x in recs]}, loss scale after each step {scales}")
        assert [x["skipped"] for x in recs] == [False, True, False]
        assert scales == [4096.0, 2048.0, 2048.0]  # window 1000: no growth; hysteresis 1: halved at once
        lines = [json.loads(t) for t in (watch / f"{r}.jsonl").read_text().splitlines()]
        assert {x["module"] for x in lines} == {"vision", "language"}
        for name in ("vision", "language"):
            sums = [x["checksum"] for x in lines if x["module"] == name]
            assert len(sums) == 3 and sums[0] != sums[1], (r, name, sums)  # step 1 updated it
            assert sums[1] == sums[2], (r, name, sums)  # step 2 did not
        assert all(x["shares_scaler"] for x in lines)
        # every module's optimizer unscaled step 3 by the halved scale, on every rank
        assert [x["scales"] for x in lines if x["step"] == 3] == [[2048.0], [2048.0]], lines
    saved = json.loads(next(root.glob("iter_*/train_state.json")).read_text())
    assert saved["loss_scaler"] == {"scale": 2048.0, "growth_tracker": 1, "hysteresis_tracker": 0}


@pytest.mark.timeout(300)
def test_fp16_resumes_a_checkpoint_saved_before_any_step_succeeded(tmp_path):
    """Megatron's default --initial-loss-scale 2**32 overflows the first steps (the CLI run in
    docs/training.md skips 15): a checkpoint saved then holds no Adam state (Adam builds it at its
    first step) and must still resume, with the saved loss scale (a fresh scaler: 2**32 again)."""
    job = dataclasses.replace(
        FP16, train_iters=1, optim=dataclasses.replace(FP16.optim, initial_loss_scale=2.0**32), save=str(tmp_path)
    )
    # saved by the distributed optimizer (whose state_dict cannot describe a fresh state), resumed without
    dist = dataclasses.replace(job.optim, use_distributed_optimizer=True)
    first = run_job(COLOC, 2, dataclasses.replace(job, optim=dist))
    assert [(x["skipped"], x["loss_scale"]) for x in first[0]["records"]] == [(True, 2.0**31)]
    state = json.loads(next(tmp_path.glob("iter_*/train_state.json")).read_text())
    assert all(m["optimizer_stateless"] for m in state["modules"].values())
    resumed = run_job(COLOC, 2, dataclasses.replace(job, train_iters=2, save=None, load=str(tmp_path)))
    for r in resumed:
        assert [(x["skipped"], x["loss_scale"]) for x in r["records"]] == [(True, 2.0**30)]
