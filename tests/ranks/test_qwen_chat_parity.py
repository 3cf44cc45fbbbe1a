"""Native-resolution conversation data through the runtime: the digits conversations read by the
Qwen2.5-VL tower through the Qwen image processor (`tests/qwen_chat_case.py`: images of 2 x 2, 3 x 3
and 2 x 4 merged tokens; up to two images a sample, text-only samples), each image its own
grid in the tower and the M-RoPE ids (`qwen_encoder.images_grid_thw`, `qwen_positions.grid_mrope_ids`),
its merged tokens through the boundaries as variable tokens: loss and parameter parity of a colocated
and a disjoint held-out layout with the world-1 run (fp32, SGD)."""

from __future__ import annotations


import pytest

from megatron_hetero import cli
from megatron_hetero.cli.train_door import data_request
from megatron_hetero.data.chat_batches import ChatBatches
from megatron_hetero.data.chat_default import chat_template_for
from megatron_hetero.data.tokenizer import load_tokenizer
from megatron_hetero.models.chat_runner import chat_job_data, native_processor
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from qwen_chat_case import GRIDS, write_case
from qwen_train_case import SPEC

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

G, STEPS = 4, 3
E = ["vision -> language"]
CASES = [
    ("colocated: vision TP2, language TP2", "colocated", {"vision": {"tp": 2}, "language": {"tp": 2}}, 2),
    (
        "disjoint: vision DP2 | language PP2",
        "disjoint",
        {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"pp": 2, "ranks": "2-3"}},
        4,
    ),
    (
        "disjoint: vision TP1 | language CP2",
        "disjoint",
        {"vision": {"ranks": "0"}, "language": {"cp": 2, "ranks": "1-2"}},
        3,
    ),
]
_REF: dict = {}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> JobConfig:
    data, proc = write_case(tmp_path_factory.mktemp("qwen-chat-parity"))
    argv = ["train", "--data-path", str(data), "--image-processor", str(proc), "--seed", "3", "--num-workers", "0"]
    spec, cfg = chat_job_data(data_request(cli.build_parser().parse_args(argv)), SPEC, G)
    return JobConfig(
        spec=spec,
        data=cfg,
        global_batch_size=G,
        micro_batch_size=2,
        train_iters=STEPS,
        optim=OptimConfig(optimizer="sgd", lr=0.5),
    )


def test_the_steps_mix_sizes_counts_and_text_only(job):
    enc = job.spec.encoders["vision"]
    tok = load_tokenizer(job.data.tokenizer_model)
    b = ChatBatches(
        job.data, tok, chat_template_for(job.data.tokenizer_model), encoder="vision",
        seq_length=job.spec.seq_length, global_batch=G, num_workers=0, native=native_processor(job.data, enc),
    )  # fmt: skip
    steps = [b.image_grids(range(s * G, (s + 1) * G))["vision"] for s in range(STEPS)]
    b.close()
    per_step = [{g for row in step for g in row} for step in steps]
    assert any(len({h for h, _ in g}) > 1 and len({w for _, w in g}) > 1 for g in per_step), steps
    assert set().union(*per_step) == set(GRIDS.values()), steps  # 2 x 2, 3 x 3 and 2 x 4 images
    assert any(len(row) == 2 for step in steps for row in step), steps  # a sample with two images
    assert any(not row for step in steps for row in step), steps  # a text-only sample


def _reference(job):
    if "ref" not in _REF:
        per_rank = run_job(world1_doc(job), 1, job)
        _REF["ref"] = (losses(per_rank), full_params(per_rank, gated=True))
    return _REF["ref"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,placement,modules,world", CASES, ids=[c[0] for c in CASES])
def test_native_resolution_chat_matches_world_1(job, label, placement, modules, world):
    ref_losses, ref_params = _reference(job)
    per_rank = run_job({"placement": placement, "modules": modules, "edges": E}, world, job, timeout=360)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank, gated=True), ref_params)
    print(f"\n{label}: loss {dl:.1e}, parameters {dp:.1e} relative ({where}); losses {losses(per_rank)}")
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"
