"""The Qwen2.5-VL tower (`models.qwen_encoder`) split over two pipeline stages of its own module
(`qwen_train_case`: two blocks, the second with full attention, so stage 0 runs window attention and
stage 1 full attention and the merger): losses and every parameter after two SGD steps equal the
world-1 run (fp32, 1e-5 relative, as the tower's other parity tests) on a colocated, a disjoint and a
TP2 x PP2 layout; frozen, the merger on the last stage trains and the blocks stay put; native-
resolution images with pp 2, and cp 2 on the tower, are refused at validation (`train` exits 2 with
the reason on one line); a checkpoint `train --save` writes on vision PP2 resumes at world 1 as if
the world-1 run had never stopped."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig, JobDraft, validate_job

from qwen_train_case import JOB, SPEC

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

E = ["vision -> language"]
CASES = [
    ("colocated: vision PP2, language DP2", "colocated", {"vision": {"pp": 2}, "language": {"dp": 2}}, 2),
    (
        "disjoint: vision PP2 | language TP1",
        "disjoint",
        {"vision": {"pp": 2, "ranks": "0-1"}, "language": {"ranks": "2-2"}},
        3,
    ),
    (
        "colocated: vision TP2 x PP2, language TP2 x DP2",
        "colocated",
        {"vision": {"tp": 2, "pp": 2}, "language": {"tp": 2, "dp": 2}},
        4,
    ),
]
_REF: dict = {}


def _reference(job: JobConfig, frozen: tuple[str, ...] = ()):
    key = (repr(job), frozen)
    if key not in _REF:
        per_rank = run_job(world1_doc(job, frozen), 1, job)
        _REF[key] = (losses(per_rank), full_params(per_rank, gated=True))
    return _REF[key]


def _assert_parity(label: str, per_rank: list[dict], ref) -> dict:
    ref_losses, ref_params = ref
    got = full_params(per_rank, gated=True)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(got, ref_params)
    print(f"\n{label}: loss {dl:.1e}, parameters {dp:.1e} relative ({where})")
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"
    return got


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,placement,modules,world", CASES, ids=[c[0] for c in CASES])
def test_pipelined_qwen_tower_matches_world_1(label, placement, modules, world):
    ref = _reference(JOB)
    vision = ref[1]["vision"]
    assert {
        "tower.blocks.layers.0.self_attention.linear_qkv.weight",
        "tower.blocks.layers.1.mlp.linear_fc2.weight",
    } <= set(vision)  # both blocks compared, by global index
    per_rank = run_job({"placement": placement, "modules": modules, "edges": E}, world, JOB, timeout=360)
    stages = {r["coords"]["vision"]["pp"]: set(r["params"]["vision"]) for r in per_rank if "vision" in r["params"]}
    assert any(n.startswith("tower.patch_embed.") for n in stages[0]) and not any("merger" in n for n in stages[0])
    assert any(n.startswith("tower.merger.") for n in stages[1]) and not any("patch_embed" in n for n in stages[1])
    _assert_parity(label, per_rank, ref)


FROZEN = [
    ("colocated", {"vision": {"pp": 2, "frozen": True}, "language": {"dp": 2}}, 2),
    ("disjoint", {"vision": {"pp": 2, "frozen": True, "ranks": "0-1"}, "language": {"ranks": "2-2"}}, 3),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("placement,modules,world", FROZEN, ids=[c[0] for c in FROZEN])
def test_frozen_pipelined_qwen_tower_trains_its_merger_on_the_last_stage(placement, modules, world):
    per_rank = run_job({"placement": placement, "modules": modules, "edges": E}, world, JOB, timeout=360)
    got = _assert_parity(f"{placement}: frozen vision PP2", per_rank, _reference(JOB, ("vision",)))
    still = JobConfig(spec=SPEC, global_batch_size=4, micro_batch_size=2, train_iters=1, optim=OptimConfig(lr=1e-30))
    init = full_params(run_job(world1_doc(still, ("vision",)), 1, still), gated=True)["vision"]
    merger = [n for n in got["vision"] if n.startswith(("tower.merger.", "tower.ln_q."))]
    blocks = [n for n in got["vision"] if n not in merger]
    assert merger and blocks
    assert max((got["vision"][n] - init[n]).abs().max().item() for n in blocks) < 1e-12  # frozen: did not move
    assert max((got["vision"][n] - init[n]).abs().max().item() for n in merger) > 1e-4  # the merger trained


def test_native_resolution_tower_with_pipeline_stages_is_refused():
    spec = dataclasses.replace(SPEC, encoders={"vision": dataclasses.replace(SPEC.encoders["vision"], max_tiles=2)})
    doc = {"placement": "colocated", "modules": {"vision": {"pp": 2}, "language": {"dp": 2}}, "edges": E}
    with pytest.raises(ValueError, match=r"variable image tokens .* one pipeline stage .*got pp\(2\)"):
        validate_job(JobDraft(layout_from_dict(doc, world_size=2), dataclasses.replace(JOB, spec=spec)))


QWEN_FLAGS = ["--vision-model-type", "qwen2.5-vl", "--patch-dim", "2", "--encoder-tokens", "4"]
QWEN_FLAGS += ["--position-embedding-type", "mrope", "--mrope-section", "2", "3", "3"]


@pytest.mark.parametrize(
    "vision, extra, words",
    [
        (
            "{pp: 2}",
            ["--encoder-max-tiles", "2"],
            r"variable image tokens \(--encoder-max-tiles 2\) run with the encoder on one",
        ),
        ("{cp: 2}", [], "a Qwen2.5-VL tower runs with cp 1: its windows and images are attention segments"),
    ],
    ids=["native-resolution pp2", "cp2"],
)
def test_train_refuses_what_the_tower_cannot_split_with_the_reason(tmp_path, capsys, vision, extra, words):
    import re

    from megatron_hetero.cli import main

    layout = tmp_path / "layout.yaml"
    layout.write_text(
        f"placement: colocated\nmodules:\n  vision: {vision}\n  language: {{dp: 2}}\nedges: ['vision -> language']\n"
    )
    argv = ["train", "--hetero-layout", str(layout), "--nproc-per-node", "2", *QWEN_FLAGS, "--train-iters", "1", *extra]
    assert main(argv) == 2  # refused at the door, before any rank starts
    err = capsys.readouterr().err
    assert re.search(words, err) and len(err.strip().splitlines()) == 1, err


def _train_losses(tmp_path, name: str, layout: str, ranks: int, *extra: str) -> list[float]:
    """`train` on the synthetic data with the Qwen flags (Adam); the losses of its log."""
    import json

    from megatron_hetero.cli import main

    doc, log = tmp_path / f"{name}.yaml", tmp_path / f"{name}.jsonl"
    doc.write_text(f"placement: colocated\nmodules:\n{layout}edges: ['vision -> language']\n")
    argv = ["train", "--hetero-layout", str(doc), "--nproc-per-node", str(ranks), *QWEN_FLAGS]
    argv += ["--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "0.01", "--log-jsonl", str(log), *extra]
    assert main(argv) == 0
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.timeout(300)
def test_a_checkpoint_saved_with_two_tower_stages_resumes_on_one(tmp_path):
    """`train --save` on vision PP2 writes the blocks by global index (Megatron's sharded state) with
    Adam's state: `--load` at world 1 continues as the world-1 run that never stopped."""
    one = "  vision: {}\n  language: {}\n"
    straight = _train_losses(tmp_path, "straight", one, 1, "--train-iters", "3")
    ckpt = str(tmp_path / "ckpt")
    pp2 = "  vision: {pp: 2}\n  language: {dp: 2}\n"
    first = _train_losses(tmp_path, "pp2", pp2, 2, "--train-iters", "2", "--save", ckpt, "--save-interval", "2")
    resumed = _train_losses(tmp_path, "resumed", one, 1, "--train-iters", "3", "--load", ckpt)
    assert len(straight) == 3 and len(first) == 2 and len(resumed) == 1, (straight, first, resumed)
    assert max(abs(a - b) / b for a, b in zip(first + resumed, straight)) <= 1e-6, (first, resumed, straight)
