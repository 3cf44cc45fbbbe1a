"""Held-out evaluation (`train --eval-interval N --eval-iters K`): the schedules' step with
train=False over the held-out split, the held-out loss, and the caption accuracy of the digits.

* The held-out loss and accuracy do not depend on the layout: from the same checkpoint (30 Adam
  steps at world 1), one more step and the evaluation (`train_rank` with --eval-interval) under
  two-rank colocated and disjoint layouts give the world-1 figures (loss within 1e-5 relative; the
  same count of correct captions).
* The accuracy is the reference computation (`caption_eval.greedy_digit_accuracy`) on the same
  logits, and the held-out loss the token mean of the cross entropy of those logits.
* Evaluating does not change training: the losses of the steps after an evaluation are bitwise the
  losses of a run without it (no gradient reduction, no optimizer step; the next step zeroes the
  gradients the evaluation computed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.caption_eval import digit_hits, greedy_digit_accuracy
from megatron_hetero.models.caption_runner import caption_runner_factory
from megatron_hetero.data.digits import digit_of_caption, write_digits_dataset
from megatron_hetero.data.energon_data import CaptionDataConfig, caption_spec, resolve_config
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.data.tokenizer import load_tokenizer
from megatron_hetero.plan.rank_plan import rank_plan
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.training.setup import JobConfig, JobDraft, build_states, validate_job
from megatron_hetero.training.train_front_end import evaluate
from megatron_hetero.training.trainer import make_schedule, prepare_rank, train_rank

G = 8
EVAL_ITERS = 3  # 24 held-out samples
TRAIN_STEPS = 31  # evaluated after step 30 (the captions are half learnt), and the run goes on


def test_digit_hits_is_the_reference_accuracy():
    tok = load_tokenizer(None)
    from megatron_hetero.data.energon_data import text_sample

    caps = ["a handwritten seven", "a handwritten one", "a handwritten three", "a handwritten zero"]
    rows = [text_sample(c, tok, seq_length=16, image_tokens=4) for c in caps]
    labels = torch.stack([r["labels"] for r in rows])
    mask = torch.stack([r["loss_mask"] for r in rows])
    # predictions: right, right, wrong digit ("eight"), no digit (EOS first)
    preds = [
        text_sample(c, tok, seq_length=16, image_tokens=4)["labels"]
        for c in ("a handwritten seven", "a handwritten one", "a handwritten eight", "")
    ]
    ids = torch.stack(preds)
    ids[3] = torch.where(mask[3].bool(), torch.full_like(ids[3], tok.eos_id), ids[3])
    logits = torch.nn.functional.one_hot(ids, 384).float() + 0.01 * torch.randn(4, 16, 384)
    digits = [digit_of_caption(c) for c in caps]
    assert digit_hits(logits, labels, mask, tok) == 2
    assert digit_hits(ids, labels, mask, tok) == 2
    assert greedy_digit_accuracy(logits, mask, tok, digits) == 0.5


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    write_digits_dataset(out)
    return str(out)


@pytest.fixture(scope="module")
def setup(digits):
    cfg = resolve_config(CaptionDataConfig(digits, seed=3))
    tok = load_tokenizer(cfg.tokenizer_model)
    spec = caption_spec(LlavaSpec(seq_length=16, encoders={"vision": EncoderSpec(offset=1)}), cfg, tok)
    job = JobConfig(
        spec=spec,
        global_batch_size=G,
        micro_batch_size=1,
        train_iters=TRAIN_STEPS,
        optim=OptimConfig(optimizer="adam", lr=5e-3, adam_eps=1e-5),
    )
    return cfg, spec, job


def _eval_rank(layout, job, factory, eval_after, keep_logits):
    """Train job.train_iters steps, evaluating after step `eval_after` (None: never)."""
    prepare_rank(job)
    topo = Topology.build(layout, timeout_s=job.comm_timeout_s)
    try:
        plan = rank_plan(layout, topo.rank, job.global_batch_size, job.micro_batch_size, job.offload_encoder)
        states = build_states(plan, job, topo)
        runner = factory(plan, states)
        runner.keep_eval_logits = keep_logits
        schedule = make_schedule(plan, job, topo, states, runner=runner)
        losses, ev = [], None
        for it in range(job.train_iters):
            losses.append(schedule.step(it).loss)
            if eval_after == it + 1:
                ev = evaluate(schedule, EVAL_ITERS, topo.rank)
        out = {"losses": losses, "eval": ev}
        if keep_logits:
            out["record"] = runner.eval_record
            out["captions"] = runner.heldout()["captions"]
        return out
    finally:
        topo.destroy()


def _run(doc, world, cfg, spec, job, eval_after=TRAIN_STEPS - 1, keep_logits=False):
    layout = layout_from_dict(doc, world_size=world)
    validate_job(JobDraft(layout, job))
    return run_ranks(
        world,
        _eval_rank,
        layout,
        job,
        caption_runner_factory(cfg, spec, job.global_batch_size),
        eval_after,
        keep_logits,
        timeout=300,
    )


def _doc(vision: dict, language: dict, placement: str = "colocated") -> dict:
    return {
        "placement": placement,
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


_REF: dict = {}


def _reference(cfg, spec, job):
    if "ref" not in _REF:
        _REF["ref"] = _run(_doc({}, {}), 1, cfg, spec, job, keep_logits=True)[0]
    return _REF["ref"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_world1_eval_is_the_reference_on_the_same_logits(setup):
    cfg, spec, job = setup
    ref = _reference(cfg, spec, job)
    ev = ref["eval"]
    logits = torch.cat([r[0] for r in ref["record"]])
    labels = torch.cat([r[1] for r in ref["record"]])
    mask = torch.cat([r[2] for r in ref["record"]])
    n = EVAL_ITERS * G
    assert logits.shape[:2] == (n, spec.seq_length) and ev["eval_samples"] == n
    digits = [digit_of_caption(c) for c in ref["captions"][:n]]  # held-out samples in stored order
    assert ev["eval_accuracy"] == greedy_digit_accuracy(logits, mask, load_tokenizer(None), digits)
    ce = torch.nn.functional.cross_entropy(
        logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).reshape(labels.shape)
    want = float((ce * mask).sum() / mask.sum())
    assert abs(ev["eval_loss"] - want) <= 1e-5 * want, (ev["eval_loss"], want)
    print(
        f"\nworld 1 after {TRAIN_STEPS - 1} steps: held-out loss {ev['eval_loss']:.6f}, "
        f"accuracy {ev['eval_accuracy']:.4f}"
    )
    # evaluating changed nothing: the same losses as a run that never evaluates
    plain = _run(_doc({}, {}), 1, cfg, spec, job, eval_after=None)[0]
    assert plain["losses"] == ref["losses"]


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    """A world-1 checkpoint after TRAIN_STEPS - 1 steps: every layout evaluates from the same weights."""
    cfg, spec, job = setup
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    layout = layout_from_dict(_doc({}, {}), world_size=1)
    job = dataclasses.replace(job, train_iters=TRAIN_STEPS - 1, save=ckpt, data=cfg)
    run_ranks(1, train_rank, validate_job(JobDraft(layout, job)), timeout=300)
    return ckpt


def _resume_and_eval(doc, world, job, ckpt):
    """`train_rank` from the checkpoint: one more step, then the evaluation (--eval-interval)."""
    layout = layout_from_dict(doc, world_size=world)
    job = dataclasses.replace(job, load=ckpt, train_iters=TRAIN_STEPS, eval_interval=TRAIN_STEPS, eval_iters=EVAL_ITERS)
    return run_ranks(world, train_rank, validate_job(JobDraft(layout, job)), timeout=300)


LAYOUTS = [
    ("world 1", _doc({}, {}), 1),
    ("colocated vision DP2 + language TP2", _doc({"dp": 2}, {"tp": 2}), 2),
    ("colocated vision TP2 + language CP2", _doc({"tp": 2}, {"cp": 2}), 2),
    ("disjoint vision rank 0, language rank 1", _doc({}, {}, "disjoint"), 2),
    ("colocated vision DP2 + language PP2", _doc({"dp": 2}, {"pp": 2}), 2),
]
_EVAL: dict = {}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,doc,world", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_eval_is_the_same_under_every_layout(setup, trained, label, doc, world):
    cfg, spec, job = setup
    job = dataclasses.replace(job, data=cfg)
    per_rank = _resume_and_eval(doc, world, job, trained)
    recs = [r["records"] for r in per_rank]
    assert [r["iteration"] for r in recs[0]] == [TRAIN_STEPS]
    got = {k: recs[0][-1][k] for k in ("loss", "eval_loss", "eval_accuracy", "eval_samples")}
    for r in recs:  # one global figure on every rank
        assert {k: r[-1][k] for k in got} == got
    if world == 1:
        _EVAL["ref"] = got
        print(f"\nworld 1: held-out loss {got['eval_loss']:.6f}, accuracy {got['eval_accuracy']:.4f}")
        assert got["eval_samples"] == EVAL_ITERS * G and got["eval_accuracy"] > 0.1  # learnt something
        return
    want = _EVAL["ref"]
    rel = abs(got["eval_loss"] - want["eval_loss"]) / want["eval_loss"]
    print(
        f"\n{label}: held-out loss {got['eval_loss']:.6f} (world 1 {want['eval_loss']:.6f}, rel {rel:.1e}), "
        f"accuracy {got['eval_accuracy']:.4f} (world 1 {want['eval_accuracy']:.4f})"
    )
    assert rel <= 1e-5
    assert got["eval_samples"] == want["eval_samples"]
    assert abs(got["eval_accuracy"] - want["eval_accuracy"]) <= 1e-5
