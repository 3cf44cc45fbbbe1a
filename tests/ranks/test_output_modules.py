"""Output modules: the module graph continues after the language model (`image + audio -> language
-> generator`). The generator head maps the language model's final hidden states of some text
positions to an output with its own loss; the step's loss is the language loss plus each output
module's loss (reported separately in `loss_parts`).

Roles (pure): the language model is the module named `language` or declaring `role: language`;
modules after it are output modules. Parity (fp32, 3 SGD steps: the multi-rank cases of this file
run 4-8 ranks on a shared 2-core machine): colocated (phase 2a forward-only pass, the heads' phase,
then the 1F1B with the heads' gradient) and disjoint (the graph-aware 1F1B with the language model's
last stage both a loss stage and a producer) against the world-1 run: per-step loss and its parts
and every parameter within 1e-5 relative.
"""

from __future__ import annotations

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.roles import roles


def _two_enc_doc(placement: str, vision: dict, audio: dict, language: dict, generator: dict) -> dict:
    return {
        "placement": placement,
        "modules": {"vision": vision, "audio": audio, "language": language, "generator": generator},
        "edges": ["vision -> language", "audio -> language", "language -> generator"],
    }


# -- roles (pure) --------------------------------------------------------------------------------------
def test_roles_language_by_name_and_outputs_after_it():
    layout = layout_from_dict(_two_enc_doc("disjoint", {}, {}, {"tp": 2, "pp": 2}, {"dp": 2}))
    r = roles(layout)
    assert r.language == ("language",) and r.encoders == ("vision", "audio") and r.outputs == ("generator",)
    assert r.loss_modules == ("language", "generator")


def test_roles_language_by_role_key():
    doc = {
        "placement": "disjoint",
        "modules": {"img": {}, "llm": {"role": "language", "pp": 2}, "head": {}},
        "edges": ["img -> llm", "llm -> head"],
    }
    r = roles(layout_from_dict(doc))
    assert r.language == ("llm",) and r.encoders == ("img",) and r.outputs == ("head",)


def test_roles_errors():
    with pytest.raises(ValueError, match=r"role must be one of \['language'\]"):
        layout_from_dict({"placement": "colocated", "modules": {"a": {"role": "decoder"}}, "edges": []})
    doc = {"placement": "disjoint", "modules": {"a": {"role": "language"}, "b": {"role": "language"}}, "edges": []}
    with pytest.raises(ValueError, match=r"2 modules declare role: language"):
        roles(layout_from_dict(doc))
    # no language module named, and two sinks: say how to name it
    doc = {
        "placement": "disjoint",
        "modules": {"img": {}, "llm": {}, "head": {}, "other": {}},
        "edges": ["img -> llm", "llm -> head", "llm -> other"],
    }
    with pytest.raises(ValueError, match=r"name it `language`, or give it `role: language`"):
        roles(layout_from_dict(doc))


def test_colocated_tables_have_the_output_phase():
    from megatron_hetero.plan.colocated import (
        BoundaryCall,
        LanguagePhase,
        OutputStep,
        check_colocated_tables,
        colocated_tables,
    )

    layout = layout_from_dict(
        _two_enc_doc("colocated", {"dp": 4}, {"tp": 2, "dp": 2}, {"tp": 2, "pp": 2}, {"tp": 2, "dp": 2})
    )
    tables = colocated_tables(layout, 8, 1)
    check_colocated_tables(tables)
    phase2 = dict(tables[0].phases)["phase 2"]
    kinds = [type(a).__name__ for a in phase2]
    assert kinds == ["LanguagePhase", "BoundaryCall", "OutputStep", "BoundaryCall", "LanguagePhase"]
    assert phase2[0].forward_only and not phase2[-1].forward_only
    assert isinstance(phase2[1], BoundaryCall) and phase2[1].edge == "language->generator"
    assert isinstance(phase2[2], OutputStep) and phase2[2].rows == range(0, 4)
    # the last LLM stage is the source of the generator's edge, the first is not
    last = [r for r, t in tables.items() if dict(t.phases)["phase 2"][-1].stage == 1]
    assert all(dict(tables[r].phases)["phase 2"][1].src for r in last)
    assert isinstance(phase2[-1], LanguagePhase)


def test_output_module_validation():
    from megatron_hetero.models.llava import LlavaSpec, OutputSpec
    from megatron_hetero.models.llava_checks import validate_model

    spec = LlavaSpec(outputs={"generator": OutputSpec()})
    layout = layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {"vision": {}, "language": {"cp": 2}, "generator": {}},
            "edges": ["vision -> language", "language -> generator"],
        }
    )
    with pytest.raises(ValueError, match=r"module language: cp\(2\) > 1 with output module generator"):
        validate_model(layout, spec)
    layout = layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {"vision": {}, "language": {}, "generator": {"pp": 2}},
            "edges": ["vision -> language", "language -> generator"],
        }
    )
    with pytest.raises(ValueError, match=r"module generator: an output head runs with pp 1 and cp 1"):
        validate_model(layout, spec)
    layout = layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {"vision": {}, "language": {}, "head": {}},
            "edges": ["vision -> language", "language -> head"],
        }
    )
    with pytest.raises(
        ValueError,
        match=r"module head comes after the language model but the model has no output "
        r"head named head",
    ):
        validate_model(layout, spec)


# -- multi-rank parity ----------------------------------------------------------------------------------
STEPS = 5


def _job():
    from megatron_hetero.models.llava import EncoderSpec, LlavaSpec, OutputSpec
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig

    spec = LlavaSpec(
        encoders={
            "vision": EncoderSpec(offset=1),
            "audio": EncoderSpec(num_layers=1, tokens=4, feature_dim=12, offset=10),
        },
        outputs={"generator": OutputSpec(tokens=4, offset=24, hidden_size=32, out_dim=16)},
    )
    return JobConfig(
        spec=spec,
        global_batch_size=8,
        micro_batch_size=1,
        train_iters=STEPS,
        optim=OptimConfig(optimizer="sgd", lr=0.5),
    )


_REF: dict = {}


def _reference(job):
    from parity import full_params, losses, run_job

    if "ref" not in _REF:
        per_rank = run_job(_two_enc_doc("colocated", {}, {}, {}, {}), 1, job)
        _REF["ref"] = (losses(per_rank), [r["loss_parts"] for r in per_rank[0]["records"]], full_params(per_rank))
    return _REF["ref"]


CASES = [
    (
        "colocated vision DP4, audio TP2·DP2, LLM TP2·PP2, generator TP2·DP2",
        _two_enc_doc("colocated", {"dp": 4}, {"tp": 2, "dp": 2}, {"tp": 2, "pp": 2}, {"tp": 2, "dp": 2}),
        4,
    ),
    (
        "colocated vision DP4, audio DP4, LLM PP2·DP2, generator DP4",
        _two_enc_doc("colocated", {"dp": 4}, {"dp": 4}, {"pp": 2, "dp": 2}, {"dp": 4}),
        4,
    ),
    (
        "disjoint vision @0, audio @1, LLM TP2·PP2 @2-5, generator DP2 @6-7",
        _two_enc_doc("disjoint", {}, {}, {"tp": 2, "pp": 2}, {"dp": 2}),
        8,
    ),
    (
        "disjoint vision DP2 @0-1, audio TP2 @2-3, LLM PP2 @4-5, generator TP2 @6-7",
        _two_enc_doc("disjoint", {"dp": 2}, {"tp": 2}, {"pp": 2}, {"tp": 2}),
        8,
    ),
]


def _id(label: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9@-]+", "_", label.replace("·", "."))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("megatron_compat")  # this module imports no torch when collected
@pytest.mark.parametrize("case", CASES, ids=[_id(c[0]) for c in CASES])
def test_output_module_parity_with_world1(case):
    from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job

    label, doc, world = case
    job = _job()
    ref_losses, ref_parts, ref_params = _reference(job)
    if doc["placement"] == "disjoint":  # a micro-batch must split over every module's DP (2 here; the LLM has dp 1)
        import dataclasses

        job = dataclasses.replace(job, micro_batch_size=2)
    per_rank = run_job(doc, world, job, timeout=300)
    parts = [r["loss_parts"] for r in per_rank[0]["records"]]
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dparts = max(max_loss_rel_diff([p[m] for p in parts], [p[m] for p in ref_parts]) for m in ("language", "generator"))
    dp, where = max_param_rel_diff(full_params(per_rank), ref_params)
    print(f"\n{label} (world {world}): loss {dl:.1e}, parts {dparts:.1e}, params {dp:.1e} ({where})")
    for p, total in zip(parts, losses(per_rank)):
        assert set(p) == {"language", "generator"} and abs(p["language"] + p["generator"] - total) <= 1e-9 * total
        assert p["generator"] > 0
    assert set(ref_params) == {"vision", "audio", "language", "generator"}
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert dparts <= 1e-5, f"{label}: loss parts differ by {dparts:.2e}: {parts} vs {ref_parts}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("megatron_compat")
def test_generator_gradient_reaches_the_language_model():
    """Without the generator the language model ends elsewhere: its head's gradient does move it."""
    import dataclasses

    from parity import full_params, run_job

    job = _job()
    _, _, with_head = _reference(job)
    dense = dataclasses.replace(job, spec=dataclasses.replace(job.spec, outputs={}))
    doc = _two_enc_doc("colocated", {}, {}, {}, {})
    del doc["modules"]["generator"]
    doc["edges"] = doc["edges"][:2]
    without = full_params(run_job(doc, 1, dense))
    moved = max((with_head["language"][n] - without["language"][n]).abs().max().item() for n in without["language"])
    assert moved > 1e-5
    # the encoders see it too (through the language model)
    assert max((with_head["vision"][n] - without["vision"][n]).abs().max().item() for n in without["vision"]) > 1e-7


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.usefixtures("megatron_compat")
def test_moe_language_model_with_a_generator(placement):
    """Both features together: an MoE language model (EP2) between the encoders and the generator.
    Per-step loss, its parts and the load-balancing loss match the world-1 run (5 steps)."""
    import dataclasses

    from parity import losses, max_loss_rel_diff, run_job

    job = _job()
    job = dataclasses.replace(
        job,
        spec=dataclasses.replace(
            job.spec, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_ffn_hidden_size=64
        ),
    )
    ref = run_job(_two_enc_doc("colocated", {}, {}, {}, {}), 1, job)
    if placement == "colocated":
        doc, world = _two_enc_doc("colocated", {"dp": 4}, {"dp": 4}, {"dp": 4, "ep": 2}, {"tp": 2, "dp": 2}), 4
    else:  # one sample per LLM micro-batch on each DP rank, as in the world-1 run (the aux loss sees it)
        doc, world = _two_enc_doc("disjoint", {}, {}, {"dp": 2, "ep": 2}, {"dp": 2}), 6
    got = run_job(doc, world, job)
    recs, ref_recs = got[0]["records"], ref[0]["records"]
    assert max_loss_rel_diff(losses(got), losses(ref)) <= 1e-5, (losses(got), losses(ref))
    assert max_loss_rel_diff([r["aux_loss"] for r in recs], [r["aux_loss"] for r in ref_recs]) <= 1e-5
    for m in ("language", "generator"):
        assert max_loss_rel_diff([r["loss_parts"][m] for r in recs], [r["loss_parts"][m] for r in ref_recs]) <= 1e-5
