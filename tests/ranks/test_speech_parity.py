"""A vision encoder and a Whisper speech encoder (`audio`, `models.whisper_encoder`) joining the
language model, the speech tokens variable per sample (0..3 chunks of 4 tokens: clip length, speech-
less samples mixed in) beside variable image tokens: loss and parameter parity of colocated and
disjoint held-out layouts with the world-1 run of the same model and data (fp32, SGD)."""

from __future__ import annotations

import pytest

from megatron_hetero.data import samples as data_mod
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec, data_config
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

SPEECH = EncoderSpec(kind="whisper", num_layers=1, tokens=4, feature_dim=16, max_tiles=3, offset=16, activation="gelu")
SPEC = LlavaSpec(seq_length=40, encoders={"vision": EncoderSpec(tokens=4, max_tiles=2, offset=1), "audio": SPEECH})
JOB = JobConfig(
    spec=SPEC, global_batch_size=4, micro_batch_size=2, train_iters=2, optim=OptimConfig(optimizer="sgd", lr=0.5)
)
EDGES = ["vision -> language", "audio -> language"]
CASES = [
    (
        "colocated: vision DP2, audio TP2, language TP2",
        "colocated",
        {"vision": {"dp": 2}, "audio": {"tp": 2}, "language": {"tp": 2}},
        2,
    ),
    (
        "disjoint: vision DP1 | audio TP2 | language PP2",
        "disjoint",
        {"vision": {"ranks": "0-0"}, "audio": {"tp": 2, "ranks": "1-2"}, "language": {"pp": 2, "ranks": "3-4"}},
        5,
    ),
]
_REF: dict = {}


def _reference():
    if "ref" not in _REF:
        per_rank = run_job(world1_doc(JOB), 1, JOB)
        _REF["ref"] = (losses(per_rank), full_params(per_rank))
    return _REF["ref"]


def test_the_speech_token_counts_vary_and_include_none():
    tiles = data_mod.image_tiles(data_config(SPEC), 0, JOB.global_batch_size * JOB.train_iters)["audio"]
    assert 0 in tiles and len(set(tiles)) > 1, tiles


@pytest.mark.timeout(400)
@pytest.mark.parametrize("label,placement,modules,world", CASES, ids=[c[0] for c in CASES])
def test_vision_and_speech_encoders_match_world_1(label, placement, modules, world):
    ref_losses, ref_params = _reference()
    assert any(n.startswith("conv1.") for n in ref_params["audio"])  # the Whisper trunk trained
    per_rank = run_job({"placement": placement, "modules": modules, "edges": EDGES}, world, JOB, timeout=360)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank), ref_params)
    print(f"\n{label}: loss {dl:.1e}, parameters {dp:.1e} relative ({where})")
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"
