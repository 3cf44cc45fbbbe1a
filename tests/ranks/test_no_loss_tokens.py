"""A step whose global batch holds no loss token (every loss mask 0: text-only or very long samples)
among steps that have some. It does not crash: its loss is NaN and the record says
`no_loss_tokens`, its loss sums are divided by 1 instead of 0 (Megatron-core clamps its per-token
divisor the same way), so its gradients are 0 and the optimizer steps as on any other step. The
reference run has the same step's masks at 0 but divides by the step's usual token count (a finite
divisor: the path a zero-gradient step took before); every other step's loss and the final weights
are the same in both, in either schedule. The iteration line averages the loss over the other
steps and counts the step."""

from __future__ import annotations

import math

import pytest
import torch

from parity import full_params, run_job
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.iteration_log import format_line
from megatron_hetero.training.setup import JobConfig

EMPTY = 2  # the step (0-based) whose samples hold no loss token
DOCS = {
    "colocated": {
        "placement": "colocated",
        "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
        "edges": ["vision -> language"],
    },
    "disjoint": {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]},
}


def _mask_step(mp: pytest.MonkeyPatch, divisor) -> None:
    """Step EMPTY's training samples get loss masks of 0; `divisor(n)`: its loss tokens, from the
    count n it has otherwise. Patched on the class in this process: the forked ranks inherit it."""
    from megatron_hetero.models.llava_runner import LlavaStageRunner

    batch, loss_tokens = LlavaStageRunner.batch, LlavaStageRunner.loss_tokens

    def masked_batch(self, samples: range) -> dict:
        b = batch(self, samples)
        if not self.evaluating and samples.start // self.plan.global_batch == EMPTY:
            b = dict(b, loss_mask=torch.zeros_like(b["loss_mask"]))
        return b

    def masked_tokens(self, step: int) -> int:
        n = loss_tokens(self, step)
        return divisor(n) if not self.evaluating and step == EMPTY else n

    mp.setattr(LlavaStageRunner, "batch", masked_batch)
    mp.setattr(LlavaStageRunner, "loss_tokens", masked_tokens)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", sorted(DOCS))
def test_a_step_without_loss_tokens_contributes_nothing(placement, megatron_compat):
    job = JobConfig(train_iters=5, optim=OptimConfig(optimizer="adam", lr=1e-3))
    with pytest.MonkeyPatch.context() as mp:
        _mask_step(mp, lambda n: n)  # the reference: masks 0 over the step's usual count
        ref = run_job(DOCS[placement], 2, job)
    with pytest.MonkeyPatch.context() as mp:
        _mask_step(mp, lambda n: 0)  # the same samples, as the data counts them: no loss token
        got = run_job(DOCS[placement], 2, job)
    want, recs = ref[0]["records"], got[0]["records"]
    assert len(recs) == len(want) == 5
    assert want[EMPTY]["loss"] == 0.0 and not want[EMPTY]["no_loss_tokens"]
    assert math.isnan(recs[EMPTY]["loss"]) and recs[EMPTY]["no_loss_tokens"]
    assert recs[EMPTY]["grad_norm"] == want[EMPTY]["grad_norm"] == 0.0 and not recs[EMPTY]["skipped"]
    for i, (r, w) in enumerate(zip(recs, want)):
        if i != EMPTY:
            assert r["loss"] == w["loss"] and math.isfinite(r["loss"]) and not r["no_loss_tokens"], i
            assert r["grad_norm"] == w["grad_norm"] > 0, i
    p, q = full_params(got), full_params(ref)
    assert p.keys() == q.keys()
    for module in p:
        for name, t in p[module].items():
            assert torch.equal(t, q[module][name]), (module, name)
    # the line of an interval holding the step: the mean over the others, and the count
    line = format_line(5, recs, 8)
    mean = sum(r["loss"] for i, r in enumerate(recs) if i != EMPTY) / 4
    assert line.startswith(f" iteration    5/5 | lm loss {mean:.6f} |"), line
    assert "| number of iterations without loss tokens:   1 |" in line
    assert "lm loss nan" in format_line(5, [recs[EMPTY]], 8)
