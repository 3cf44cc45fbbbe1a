"""Variable image tokens per sample (0..3 tiles of 4 tokens, text-only samples mixed in): loss and
parameter parity of colocated and disjoint layouts (fan-in, Equal-DP, CP on the language model,
pipeline stages) with the world-1 run of the same model and data (fp32, SGD)."""

from __future__ import annotations

import pytest

from megatron_hetero.data import samples as data_mod
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec, data_config
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

SPEC = LlavaSpec(seq_length=32, encoders={"vision": EncoderSpec(tokens=4, max_tiles=3, offset=1)})
JOB = JobConfig(
    spec=SPEC, global_batch_size=8, micro_batch_size=2, train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5)
)
EDGE = ["vision -> language"]
CASES = [
    (
        "colocated: vision DP4 -> language TP2·DP2 (fan-in)",
        "colocated",
        {"vision": {"dp": 4}, "language": {"tp": 2, "dp": 2}},
        4,
    ),
    ("colocated: vision DP2 -> language CP2", "colocated", {"vision": {"dp": 2}, "language": {"cp": 2}}, 2),
    (
        "disjoint: vision DP2 | language PP2",
        "disjoint",
        {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"pp": 2, "ranks": "2-3"}},
        4,
    ),
    ("colocated: vision CP2 -> language TP2", "colocated", {"vision": {"cp": 2}, "language": {"tp": 2}}, 2),
    (
        "disjoint: vision CP2 | language CP2",
        "disjoint",
        {"vision": {"cp": 2, "ranks": "0-1"}, "language": {"cp": 2, "ranks": "2-3"}},
        4,
    ),
    (
        "disjoint: vision DP1 | language CP2",
        "disjoint",
        {"vision": {"ranks": "0-0"}, "language": {"cp": 2, "ranks": "1-2"}},
        3,
    ),
]
# a variable vision encoder beside a fixed-token audio encoder, both fanned out to language DP2
TWO = LlavaSpec(
    seq_length=40,
    encoders={
        "vision": EncoderSpec(tokens=4, max_tiles=3, offset=1),
        "audio": EncoderSpec(num_layers=1, tokens=4, feature_dim=12, offset=20),
    },
)
JOB_TWO = JobConfig(
    spec=TWO, global_batch_size=8, micro_batch_size=2, train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5)
)
_REF: dict = {}


def _reference(job: JobConfig = JOB):
    key = repr(job)
    if key not in _REF:
        per_rank = run_job(world1_doc(job), 1, job)
        _REF[key] = (losses(per_rank), full_params(per_rank))
    return _REF[key]


def test_the_data_mixes_text_only_samples_and_tile_counts():
    tiles = data_mod.image_tiles(data_config(SPEC), 0, JOB.global_batch_size * JOB.train_iters)["vision"]
    assert set(tiles) == {0, 1, 2, 3}, tiles
    # the disjoint micro-batches (2 samples) differ in their longest run, so their messages differ in size
    assert len({max(tiles[i : i + 2]) for i in range(0, len(tiles), 2)}) > 1


@pytest.mark.parametrize("label,placement,modules,world", CASES, ids=[c[0] for c in CASES])
def test_variable_image_tokens_match_world_1(label, placement, modules, world):
    ref_losses, ref_params = _reference()
    per_rank = run_job({"placement": placement, "modules": modules, "edges": EDGE}, world, JOB)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank), ref_params)
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"


def test_a_variable_and_a_fixed_encoder_fanned_out_in_disjoint_placement():
    ref_losses, ref_params = _reference(JOB_TWO)
    modules = {"vision": {"ranks": "0-0"}, "audio": {"ranks": "1-1"}, "language": {"dp": 2, "ranks": "2-3"}}
    doc = {"placement": "disjoint", "modules": modules, "edges": ["vision -> language", "audio -> language"]}
    per_rank = run_job(doc, 4, JOB_TWO)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank), ref_params)
    assert dl <= 1e-5 and dp <= 1e-5, (dl, dp, where)


def test_encoders_with_cp_beside_each_other_colocated():
    """A variable and a fixed-token encoder, each on CP2, fanned in to language DP2."""
    ref_losses, ref_params = _reference(JOB_TWO)
    modules = {"vision": {"cp": 2}, "audio": {"cp": 2}, "language": {"dp": 2}}
    doc = {"placement": "colocated", "modules": modules, "edges": ["vision -> language", "audio -> language"]}
    per_rank = run_job(doc, 2, JOB_TWO)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank), ref_params)
    assert dl <= 1e-5 and dp <= 1e-5, (dl, dp, where)


def test_encoder_cp_refusals_name_the_reason():
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava_checks import check_encoder_cp

    def module(**m):
        world = m.get("cp", 1) * m.get("pp", 1)
        doc = {"placement": "colocated", "modules": {"vision": m, "language": {"dp": world}}, "edges": EDGE}
        return layout_from_dict(doc, world_size=world).module("vision")

    check_encoder_cp("vision", EncoderSpec(tokens=4), module(cp=2))  # 4 tokens over 2*2 chunks
    with pytest.raises(ValueError, match=r"6 tokens \(per tile\) are not divisible by 2\*cp = 4"):
        check_encoder_cp("vision", EncoderSpec(tokens=6), module(cp=2))
    with pytest.raises(ValueError, match="a clip tower runs with cp 1"):
        check_encoder_cp("vision", EncoderSpec(tokens=4, kind="clip", patch_size=2), module(cp=2))
    with pytest.raises(ValueError, match="one pipeline stage"):
        check_encoder_cp("vision", EncoderSpec(tokens=4, num_layers=2), module(cp=2, pp=2))


def test_a_variable_encoder_on_two_pipeline_stages_is_refused():
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.training.setup import JobDraft, validate_job

    layout = layout_from_dict(
        {"placement": "colocated", "modules": {"vision": {"pp": 2}, "language": {"pp": 2}}, "edges": EDGE}, world_size=2
    )
    with pytest.raises(ValueError, match=r"vision: variable image tokens .* use pp 1"):
        validate_job(JobDraft(layout, JOB))


def test_variable_tokens_with_the_hierarchical_boundary_mode_are_refused():
    """The leader route needs a fixed sequence length per edge: refused at validation (exit 2)."""
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.training.setup import JobDraft, validate_job

    doc = {"placement": "disjoint", "boundary_mode": "hierarchical", "modules": {"vision": {}, "language": {}}}
    layout = layout_from_dict({**doc, "edges": EDGE}, world_size=2)
    with pytest.raises(ValueError, match=r"hierarchical needs a fixed sequence length .* \['vision'\] .* direct"):
        validate_job(JobDraft(layout, JOB))
    validate_job(JobDraft(layout_from_dict({**doc, "boundary_mode": "direct", "edges": EDGE}, world_size=2), JOB))
