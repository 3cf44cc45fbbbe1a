"""Megatron-core's HybridModel as the language model (`--hybrid-layer-pattern`, `models.hybrid_lm`):
validation (pure), and fp32 parity of layouts against the world-1 run of the same pattern.

Patterns: `*-*-` (a GPT model of 2 layers as Megatron's hybrid model writes it: attention layer,
MLP layer, twice), `*-*E` (the last MLP a mixture of 4 experts, top-2, with the load-balancing loss)
and `*-|*-` (the same layers as `*-*-` cut into two pipeline stages by the pattern). Every layout
starts from the same weights (parameters are initialised from their global layer index and, for
experts, their global expert index), sees the same data, and must give the world-1 run's per-step
loss and grad norm within 1e-5 relative, and its parameters after the last step (dense layouts).
"""

from __future__ import annotations

import pytest

from megatron_hetero.layout import layout_from_dict

TOL = 1e-5
MOE_KW = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_ffn_hidden_size=64)


def _job(pattern: str, steps: int = 3, **over):
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig

    layers = len(pattern.replace("|", ""))
    spec = LlavaSpec(num_layers=layers, hybrid_layer_pattern=pattern, **over)
    return JobConfig(
        spec=spec,
        global_batch_size=8,
        micro_batch_size=1,
        train_iters=steps,
        optim=OptimConfig(optimizer="sgd", lr=0.5),
    )


def _doc(vision: dict, language: dict, placement: str = "colocated") -> dict:
    return {
        "placement": placement,
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


# -- validation (pure: no ranks) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "pattern,language,over,message",
    [
        ("*-M-", {}, {}, r"Mamba layers \('M'\) need Megatron's Mamba mixer.*CUDA kernels"),
        ("*-*E", {}, {}, r"MoE layers \('E'\) need --num-experts"),
        ("*-G-", {}, {}, r"symbols \['G'\] are not supported"),
        ("*-/*-", {}, {}, "multi-token prediction"),
        ("*-|*-|*-", {"pp": 2}, {}, r"has 3 pipeline stages, the layout's pp is 2"),
        ("*-*", {"pp": 2}, {}, r"the 3 layers .* do not split over pp\(2\)"),
        ("*-||*-", {"pp": 3}, {}, "every pipeline stage"),
        ("*-*-", {}, {"rope_scaling": True, "position_embedding_type": "rope"}, "no rope scaling option"),
    ],
)
def test_patterns_this_build_cannot_run_are_refused(pattern, language, over, message):
    from megatron_hetero.training.setup import validate_job

    world = language.get("pp", 1)
    layout = layout_from_dict(_doc({"dp": world}, language), world_size=world)
    with pytest.raises(ValueError, match=message):
        validate_job(layout, _job(pattern, **over))


def test_flag_sets_the_pattern_and_the_layer_count():
    from megatron_hetero.cli import build_parser
    from megatron_hetero.training.job import job_from_args

    layout = layout_from_dict(_doc({"dp": 2}, {"pp": 2}), world_size=2)
    base = ["train", "--hetero-module", "vision:dp=2", "--hetero-module", "language:pp=2"]
    base += ["--hetero-edge", "vision->language"]
    spec = job_from_args(build_parser().parse_args(base + ["--hybrid-layer-pattern", "*-*E|*-*-"]), layout).spec
    assert (spec.hybrid_layer_pattern, spec.num_layers) == ("*-*E|*-*-", 8)
    with pytest.raises(ValueError, match=r"--num-layers 4 contradicts --hybrid-layer-pattern '\*-\*E\|\*-\*-' \(8"):
        job_from_args(
            build_parser().parse_args(base + ["--hybrid-layer-pattern", "*-*E|*-*-", "--num-layers", "4"]), layout
        )


# -- multi-rank parity ----------------------------------------------------------------------------------
_REF: dict = {}


def _reference(job):
    from parity import full_params, losses, run_job, world1_doc

    key = repr(job)
    if key not in _REF:
        per_rank = run_job(world1_doc(job), 1, job)
        _REF[key] = (losses(per_rank), [r["grad_norm"] for r in per_rank[0]["records"]], full_params(per_rank))
    return _REF[key]


CASES = [  # (name, world-1 pattern, this layout's pattern, layout, world, model options)
    ("*-*- colocated vision DP2, language TP2", "*-*-", "*-*-", _doc({"dp": 2}, {"tp": 2}), 2, {}),
    ("*-|*- language PP2 (the pattern's stages)", "*-*-", "*-|*-", _doc({"dp": 2}, {"pp": 2}), 2, {}),
    ("*-*- disjoint vision @0, language TP2 @1-2", "*-*-", "*-*-", _doc({}, {"tp": 2}, "disjoint"), 3, {}),
    ("*-*E language DP2·EP2", "*-*E", "*-*E", _doc({"dp": 2}, {"dp": 2, "ep": 2}), 2, MOE_KW),
]


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("megatron_compat")  # this module imports no torch when collected
@pytest.mark.parametrize("name,ref_pattern,pattern,doc,world,over", CASES, ids=[c[0] for c in CASES])
def test_hybrid_layouts_match_world1(name, ref_pattern, pattern, doc, world, over):
    from parity import full_params, losses, max_param_rel_diff, run_job

    ref_loss, ref_norm, ref_params = _reference(_job(ref_pattern, **over))
    per_rank = run_job(doc, world, _job(pattern, **over))
    loss, norm = losses(per_rank), [r["grad_norm"] for r in per_rank[0]["records"]]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(loss, ref_loss))
    norm_rel = max(abs(a - b) / abs(b) for a, b in zip(norm, ref_norm))
    print(f"\nhybrid {name}: loss {loss}, max loss rel {loss_rel:.1e}, grad norm rel {norm_rel:.1e}", end="")
    assert len(loss) == len(ref_loss) and loss_rel < TOL and norm_rel < TOL, (loss, ref_loss, norm, ref_norm)
    assert ref_loss[-1] < ref_loss[0], ref_loss  # it trains
    if not over.get("num_experts"):
        diff, where = max_param_rel_diff(full_params(per_rank), ref_params)
        print(f", params rel {diff:.1e}")
        assert diff < TOL, (diff, where)
