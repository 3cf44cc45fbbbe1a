"""The tiny LLaVA model trains on REAL image-caption data (the digits, energon shards) through the
existing schedules, and the per-step losses do not depend on the layout.

Every rank addresses the same global sample stream by global sample index and decodes only the rows
its stages read (images of its encoder DP rank's rows, captions of its language DP rank's rows: each
rank's decodes are counted and checked against the plan); `loss_tokens(step)` counts the caption
tokens of the whole step from the caption text. So a 2-rank colocated run (vision DP2 + language TP2,
or vision TP2 + language DP2) sees the same samples at every step as the world-1 run, and the losses
agree within 1e-5 relative (the differences are reduction order: TP all-reduces of partial matmuls, DP
gradient sums).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hetero.cli.train_door import data_request
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.caption_runner import CaptionStageRunner, caption_runner_factory
from megatron_hetero.data.digits import write_digits_dataset
from megatron_hetero.data.energon_data import CaptionDataConfig, caption_spec, resolve_config
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.data.tokenizer import load_tokenizer
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.rank_plan import rank_plan
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.runtime.stage_runner import StageRunner
from megatron_hetero.runtime.topology import Topology
from megatron_hetero.training.setup import JobConfig, JobDraft, build_states, validate_job
from megatron_hetero.training.trainer import make_schedule, prepare_rank

pytestmark = pytest.mark.slow

STEPS = 4
G = 8


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    write_digits_dataset(out)
    return str(out)


@pytest.fixture(scope="module")
def setup(digits):
    cfg = resolve_config(CaptionDataConfig(digits, seed=7))
    tok = load_tokenizer(cfg.tokenizer_model)
    base = LlavaSpec(seq_length=16, encoders={"vision": EncoderSpec(offset=1)})
    spec = caption_spec(base, cfg, tok)
    job = JobConfig(
        spec=spec,
        global_batch_size=G,
        micro_batch_size=1,
        train_iters=STEPS,
        optim=OptimConfig(optimizer="sgd", lr=0.1),
    )
    return cfg, spec, job


def _caption_rank(layout, job, factory):
    """`training.trainer.train_rank` with the caption runner (the trainer's hook, inlined)."""
    prepare_rank(job)
    topo = Topology.build(layout, timeout_s=job.comm_timeout_s)
    try:
        plan = rank_plan(layout, topo.rank, job.global_batch_size, job.micro_batch_size, job.offload_encoder)
        states = build_states(plan, job, topo)
        runner = factory(plan, states)
        assert isinstance(runner, StageRunner) and isinstance(runner, CaptionStageRunner)
        schedule = make_schedule(plan, job, topo, states, runner=runner)
        losses, keys, tokens = [], [], []
        for it in range(job.train_iters):
            losses.append(schedule.step(it).loss)
            keys.append(runner.data.keys(it))  # the keys only: nothing more is decoded
            tokens.append(runner.loss_tokens(it))
        # the rows this rank's stages read, from its plan: images of its vision DP rank's rows on the
        # vision's first stage, captions of its language DP rank's rows
        end = job.train_iters * job.global_batch_size
        want = {}
        for name, kind in (("vision", "image"), ("language", "text")):
            me = plan.modules.get(name)
            rows = dp_rows(job.global_batch_size, me.dp, me.coord.dp) if me else range(0)
            want[kind] = sorted(s * job.global_batch_size + r for s in range(job.train_iters) for r in rows)
        runner.data.close()
        got = {
            "image": sorted(i for i in runner.data.image_reads if i < end),  # workers also decode step STEPS
            "text": sorted(runner.data.text_reads),
        }
        ahead = [i for i in runner.data.image_reads if i >= end]
        assert all(i < end + job.global_batch_size for i in ahead), ahead
        return {
            "losses": losses,
            "keys": keys,
            "loss_tokens": tokens,
            "position": runner.data.state_dict(),
            "reads": got,
            "want": want,
        }
    finally:
        topo.destroy()


def _run(doc, world, cfg, spec, job):
    layout = layout_from_dict(doc, world_size=world)
    validate_job(JobDraft(layout, job))
    return run_ranks(
        world, _caption_rank, layout, job, caption_runner_factory(cfg, spec, job.global_batch_size), timeout=240
    )


def _doc(vision: dict, language: dict) -> dict:
    return {
        "placement": "colocated",
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


_REF: dict = {}


def _reference(cfg, spec, job):
    if "ref" not in _REF:
        _REF["ref"] = _run(_doc({}, {}), 1, cfg, spec, job)[0]
    return _REF["ref"]


def test_spec_comes_from_the_data(setup):
    cfg, spec, _ = setup
    assert spec.encoders["vision"].tokens == 4 and spec.encoders["vision"].feature_dim == 16  # 8x8 grey, 4x4 patches
    assert spec.vocab_size == 384  # the shipped tokenizer's 306 tokens padded to a multiple of 128


@pytest.mark.timeout(400)
def test_world1_trains_on_digits(setup):
    cfg, spec, job = setup
    ref = _reference(cfg, spec, job)
    losses = ref["losses"]
    assert all(x == x and 0 < x < 10 for x in losses), losses
    assert losses[-1] < losses[0], f"SGD on real captions should lower the loss: {losses}"
    # every step is a different set of real samples; loss tokens = 3 caption tokens + EOS per sample
    assert len({tuple(k) for k in ref["keys"]}) == STEPS
    assert ref["loss_tokens"] == [G * 4] * STEPS
    assert ref["position"]["consumed"] == STEPS * G and ref["position"]["samples_per_epoch"] == 1597
    assert ref["reads"] == ref["want"] == {"image": list(range(STEPS * G)), "text": list(range(STEPS * G))}


LAYOUTS = [
    ("colocated vision DP2 + language TP2", _doc({"dp": 2}, {"tp": 2})),
    ("colocated vision TP2 + language DP2", _doc({"tp": 2}, {"dp": 2})),
    ("disjoint vision rank 0, language rank 1", {**_doc({}, {}), "placement": "disjoint"}),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,doc", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_layouts_see_the_same_samples_and_losses(setup, label, doc):
    cfg, spec, job = setup
    ref = _reference(cfg, spec, job)
    per_rank = _run(doc, 2, cfg, spec, job)
    for rank, r in enumerate(per_rank):
        assert r["keys"] == ref["keys"]  # the same global samples at every step, on every rank
        assert r["loss_tokens"] == ref["loss_tokens"]
        assert r["reads"] == r["want"], f"rank {rank} decoded other rows than its stages read"
        print(f"rank {rank}: decoded {len(r['reads']['image'])} images, {len(r['reads']['text'])} captions")
    got = per_rank[0]["losses"]
    assert all(r["losses"] == got for r in per_rank)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref["losses"]))
    print(f"\n{label}: losses {got}, reference {ref['losses']}, max rel {rel:.2e}")
    assert rel <= 1e-5, f"losses differ by {rel:.2e} relative: {got} vs {ref['losses']}"


def _train_args(*argv: str):
    import argparse

    from megatron_hetero.cli.data import add_train_data_flags
    from megatron_hetero.cli.model_flags import add_model_flags

    p = argparse.ArgumentParser()
    add_model_flags(p)
    add_train_data_flags(p)
    p.add_argument("--seed", type=int, default=1234)
    return data_request(p.parse_args(list(argv)))


def test_train_flags_to_caption_job_data(digits):
    from megatron_hetero.models.caption_runner import caption_job_data

    base = LlavaSpec()
    assert caption_job_data(_train_args(), base) == (base, None)  # synthetic data
    assert caption_job_data(_train_args("--mock-data"), base) == (base, None)
    spec, cfg = caption_job_data(_train_args("--data-path", digits, "--seed", "5"), base)
    assert cfg.resolved() and cfg.seed == 5 and cfg.path == digits and cfg.tokenizer_model is None
    assert cfg.num_workers == 2  # Megatron's default
    assert caption_job_data(_train_args("--data-path", digits, "--num-workers", "0"), base)[1].num_workers == 0
    assert (spec.encoders["vision"].tokens, spec.encoders["vision"].feature_dim, spec.vocab_size) == (4, 16, 384)
    spec, cfg = caption_job_data(
        _train_args("--data-path", digits, "--patch-size", "2", "--vocab-size", "512", "--encoder-tokens", "16"), base
    )
    assert (spec.encoders["vision"].tokens, spec.encoders["vision"].feature_dim, spec.vocab_size) == (16, 4, 512)
    proc = Path(digits).parent / "siglip16.json"  # the tower's own preprocessing fixes the image format
    proc.write_text('{"image_processor_type": "SiglipImageProcessor", "size": {"height": 16, "width": 16}}')
    spec, cfg = caption_job_data(_train_args("--data-path", digits, "--image-processor", str(proc)), base)
    assert (cfg.image_processor, cfg.image_size, cfg.channels) == (str(proc), (16, 16), 3)
    assert (spec.encoders["vision"].tokens, spec.encoders["vision"].feature_dim) == (16, 48)
    for argv, match in (
        (("--data-path", digits, "--mock-data"), "give one"),
        (("--tokenizer-model", "t.json"), "applies to --data-path"),
        (("--data-path", digits, "--encoder-tokens", "8"), "tokens = \\(H/p\\)"),
        (("--data-path", digits, "--vocab-size", "100"), "smaller than the tokenizer"),
        (("--data-path", digits, "--patch-size", "3"), "not divisible by --patch-size 3"),
        (("--data-path", digits + "/nowhere"), "cannot open split 'train'"),
        (("--data-path", digits, "--num-workers", "-1"), "--num-workers -1: must be >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            caption_job_data(_train_args(*argv), base)
