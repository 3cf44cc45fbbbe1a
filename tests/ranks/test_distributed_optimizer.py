"""`--use-distributed-optimizer` per module: Megatron's DistributedOptimizer over each module's own DP x CP
group (fp32, Adam, tiny LLaVA, 4 steps, `--clip-grad` engaged: the logged norms are ~2).

Reference: the same layout, data and seed with Megatron's non-distributed optimizer. The two differ only
in how each module's gradients are summed over its DP x CP group (reduce-scatter + all-gather instead of
one all-reduce) and in which rank updates which element: per-step loss and the global gradient norm
within 1e-6 relative. The optimizer state bytes per rank fall by the module's DP size (Adam's moments
of this rank's shard). A checkpoint saved with the distributed optimizer under one layout resumes under
another (and without the distributed optimizer) with the uninterrupted run's losses.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.training.setup import JobConfig

from parity import losses, max_loss_rel_diff, run_job

# vision DP2 (sharded over 2) with language PP2 (the distributed optimizer's norm group spans both
# stages) on 2 ranks; disjoint: vision on rank 0, language DP2 on ranks 1-2
COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"pp": 2}},
    "edges": ["vision -> language"],
}
DISJOINT = {
    "placement": "disjoint",
    "modules": {"vision": {"ranks": "0-0"}, "language": {"dp": 2, "ranks": "1-2"}},
    "edges": ["vision -> language"],
}
CASES = {"colocated": (COLOC, 2, "vision"), "disjoint": (DISJOINT, 3, "language")}
# eps 1e-5: the exactly-zero gradients (attention key biases) are reduction-order noise in any run,
# which Adam with eps 1e-8 would blow up to full-size updates (see test_disjoint_parity.py)
PLAIN = OptimConfig(adam_eps=1e-5, clip_grad=1.0)
DIST = dataclasses.replace(PLAIN, use_distributed_optimizer=True)
JOB = JobConfig(train_iters=4, optim=PLAIN)  # Adam, lr 1e-3, global batch 8, micro-batch 1
TOL = 1e-6

_RUNS: dict = {}


def _run(case: str, optim: OptimConfig) -> list[dict]:
    """The 4-step run of `case` with `optim` (cached within the session)."""
    key = (case, optim.use_distributed_optimizer)
    if key not in _RUNS:
        doc, world, _ = CASES[case]
        _RUNS[key] = run_job(doc, world, dataclasses.replace(JOB, optim=optim))
    return _RUNS[key]


def _norms(per_rank: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in per_rank[0]["records"]]


def _opt_bytes(per_rank: list[dict], module: str) -> list[int]:
    """Each rank's optimizer state bytes of `module` after the last step (ranks that serve it)."""
    last = [r["records"][-1]["optimizer_state_bytes"] for r in per_rank]
    return [b[module] for b in last if module in b]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_norms_and_state_bytes_match_the_non_distributed_optimizer(case):
    plain, dist = _run(case, PLAIN), _run(case, DIST)
    dl = max_loss_rel_diff(losses(dist), losses(plain))
    dn = max_loss_rel_diff(_norms(dist), _norms(plain))
    print(f"{case}: losses {losses(dist)}, rel. diff {dl:.1e}; grad norms {_norms(dist)}, rel. diff {dn:.1e}")
    assert dl <= TOL, (losses(dist), losses(plain))
    assert dn <= TOL, (_norms(dist), _norms(plain))
    assert min(_norms(plain)) > PLAIN.clip_grad  # clipping by the global norm engaged every step
    _, _, module = CASES[case]
    full, shards = _opt_bytes(plain, module), _opt_bytes(dist, module)
    print(f"{case}: {module} (DP2) optimizer state bytes per rank {full} -> {shards}")
    assert len(full) == len(shards) == 2 and full[0] == full[1] > 0
    assert sum(shards) == full[0]  # every element's moments on exactly one DP rank
    assert all(abs(b - full[0] / 2) <= 0.02 * full[0] for b in shards), (shards, full)
    # a module with DP1 keeps its whole state
    other = "language" if module == "vision" else "vision"
    assert _opt_bytes(dist, other) == _opt_bytes(plain, other)


@pytest.mark.timeout(300)
def test_checkpoint_of_the_distributed_optimizer_resumes_under_other_layouts(tmp_path):
    """Saved at iteration 2 under COLOC with the distributed optimizer; resumed under DISJOINT (the
    distributed optimizer sharding another module) and under a colocated TP2 layout without it."""
    full = losses(_run("colocated", DIST))
    root = tmp_path / "run"
    first = losses(
        run_job(COLOC, 2, dataclasses.replace(JOB, optim=DIST, train_iters=2, save=str(root), save_interval=2))
    )
    assert first == full[:2]
    tp2 = {"placement": "colocated", "modules": {"vision": {"dp": 2}, "language": {"tp": 2}}, "edges": COLOC["edges"]}
    for label, doc, world, optim in (
        ("disjoint, distributed", DISJOINT, 3, DIST),
        ("language TP2, plain", tp2, 2, PLAIN),
    ):
        resumed = losses(run_job(doc, world, dataclasses.replace(JOB, optim=optim, load=str(root))))
        diff = max_loss_rel_diff(resumed, full[2:])
        print(f"resume {label}: {resumed} vs {full[2:]}: rel. diff {diff:.1e}")
        assert diff <= 1e-5, (label, resumed, full[2:])
