"""Loss and parameter parity of the three-phase colocated schedule against homogeneous runs (fp32).

Reference: the same model, data and seed with every module TP1 on one rank (and, where the language
model has pp=1, the homogeneous layout with the encoders on the LLM's own layout). Differences come
only from reduction order (TP all-reduces of partial matmuls, CP K/V gathers, DP sums in a
different order): per-step loss <= 1e-5 relative, every parameter after the last step <= 1e-5
relative (max abs difference over max abs value, per tensor).
"""

from __future__ import annotations

import pytest

from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.training.setup import JobConfig

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, run_job, world1_doc

STEPS = 5
SGD = OptimConfig(optimizer="sgd", lr=0.5)
JOB = JobConfig(spec=LlavaSpec(), global_batch_size=8, micro_batch_size=1, train_iters=STEPS, optim=SGD)
TWO = LlavaSpec(
    encoders={"vision": EncoderSpec(offset=1), "audio": EncoderSpec(num_layers=1, tokens=4, feature_dim=12, offset=10)}
)
JOB2 = JobConfig(spec=TWO, global_batch_size=8, micro_batch_size=1, train_iters=STEPS, optim=SGD)
# 64 tokens over CP2 = 4 chunks of 16: the 8 image placeholders (1-8) lie in chunk 0 only, so CP rank 1
# (chunks 1 and 2) holds none of them and receives an empty boundary payload
LONG = JobConfig(spec=LlavaSpec(seq_length=64), global_batch_size=8, micro_batch_size=1, train_iters=STEPS, optim=SGD)


def _doc(enc: dict, lang: dict, **more) -> dict:
    mods = {"vision": enc, **more, "language": lang}
    return {"placement": "colocated", "modules": mods, "edges": [f"{n} -> language" for n in mods if n != "language"]}


_REFERENCES: dict = {}


def _reference(job: JobConfig, frozen: tuple[str, ...] = ()):
    """The world-1 run of `job` (cached per job and frozen set within the test session)."""
    key = (repr(job), frozen)
    if key not in _REFERENCES:
        per_rank = run_job(world1_doc(job, frozen), 1, job)
        _REFERENCES[key] = (losses(per_rank), full_params(per_rank))
    return _REFERENCES[key]


def _assert_parity(per_rank, ref, label: str):
    ref_losses, ref_params = ref
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    dp, where = max_param_rel_diff(full_params(per_rank), ref_params)
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e} relative: {losses(per_rank)} vs {ref_losses}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e} relative"
    return dl, dp


CASES = [
    ("enc TP1·DP8, LLM TP2·PP2·DP2", _doc({"dp": 8}, {"tp": 2, "pp": 2, "dp": 2}), 8, JOB),
    ("enc TP1·DP4, LLM TP4", _doc({"dp": 4}, {"tp": 4}), 4, JOB),
    ("enc TP2·DP2, LLM TP1·CP2·DP2", _doc({"tp": 2, "dp": 2}, {"cp": 2, "dp": 2}), 4, JOB),
    ("enc DP2, LLM CP2 (a CP rank without placeholders)", _doc({"dp": 2}, {"cp": 2}), 2, LONG),
    ("fan-out enc TP2·DP2, LLM DP4", _doc({"tp": 2, "dp": 2}, {"dp": 4}), 4, JOB),
    (
        "two encoders vision DP8, audio TP2·DP4, LLM TP4·DP2",
        _doc({"dp": 8}, {"tp": 4, "dp": 2}, audio={"tp": 2, "dp": 4}),
        8,
        JOB2,
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_colocated_parity_with_world1(case):
    label, doc, world, job = case
    _assert_parity(run_job(doc, world, job), _reference(job), label)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "homogeneous,heterogeneous,world",
    [({"tp": 4}, {"dp": 4}, 4), ({"tp": 2, "pp": 2, "dp": 2}, {"dp": 8}, 8)],
    ids=["LLM TP4", "LLM TP2·PP2·DP2"],
)
def test_colocated_parity_with_homogeneous_layout(homogeneous, heterogeneous, world):
    """The homogeneous layout puts the encoder on the LLM's own layout (a pipelined encoder when the
    LLM has pp > 1); the heterogeneous one gives the encoder pure DP."""
    homo = run_job(_doc(homogeneous, homogeneous), world, JOB)
    _assert_parity(homo, _reference(JOB), f"homogeneous {homogeneous}")
    hetero = run_job(_doc(heterogeneous, homogeneous), world, JOB)
    _assert_parity(hetero, (losses(homo), full_params(homo)), f"{heterogeneous} vs homogeneous {homogeneous}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "frozen", [("vision",), ("vision", "language")], ids=["stage2-frozen-encoder", "stage1-projector-only"]
)
def test_frozen_modules_parity(frozen):
    doc = _doc({"dp": 4, "frozen": "vision" in frozen}, {"tp": 2, "dp": 2, "frozen": "language" in frozen})
    per_rank = run_job(doc, 4, JOB)
    _assert_parity(per_rank, _reference(JOB, frozen), f"frozen {frozen}")
    ref_params = _reference(JOB, ())[1]
    got = full_params(per_rank)
    # frozen parts did not move (the trunk of a frozen encoder; all of a frozen LLM) ...
    init = full_params(
        run_job(doc, 4, JobConfig(spec=JOB.spec, train_iters=1, optim=OptimConfig(optimizer="sgd", lr=1e-30)))
    )
    for module in frozen:
        for name, t in got[module].items():
            if module == "vision" and name.startswith("projector."):
                continue
            assert (t - init[module][name]).abs().max().item() < 1e-12, f"{module}.{name} moved although frozen"
    # ... while the projector trained
    moved = max(
        (got["vision"][n] - init["vision"][n]).abs().max().item() for n in got["vision"] if n.startswith("projector.")
    )
    assert moved > 1e-4
    # The unfrozen reference holds every module's parameters under the same names as this run (so
    # the parity comparisons cover each of them), and its trunks trained where this run's froze.
    modules = set(JOB.spec.encoders) | {"language"}
    assert set(ref_params) == set(got) == set(init) == modules, (set(ref_params), set(got), modules)
    for module in modules:
        assert ref_params[module], f"reference has no parameters for {module}"
        assert set(ref_params[module]) == set(got[module]) == set(init[module]), module
    for module in frozen:
        trunk = [n for n in got[module] if not (module == "vision" and n.startswith("projector."))]
        assert trunk, f"{module}: no frozen parameters to compare"
        trained = max((ref_params[module][n] - got[module][n]).abs().max().item() for n in trunk)
        assert trained > 1e-6, f"{module}: the unfrozen reference did not move the trunk either"
    # frozen modules hold no optimizer state and no gradient buffer: memory of a frozen LLM is params only
    mem = per_rank[0]["records"][-1]["memory"]["phase3"]
    if "language" in frozen:
        n_params = sum(t.numel() for t in per_rank[0]["params"]["language"].values())
        assert mem["language"] == 4 * n_params


@pytest.mark.timeout(300)
def test_offload_same_losses_and_encoder_not_resident_in_phase2():
    doc = _doc({"dp": 4}, {"tp": 2, "dp": 2})
    adam = OptimConfig(optimizer="adam", lr=1e-3)
    off = run_job(doc, 4, JobConfig(spec=JOB.spec, train_iters=3, optim=adam, offload_encoder=True))
    on = run_job(doc, 4, JobConfig(spec=JOB.spec, train_iters=3, optim=adam, offload_encoder=False))
    assert losses(off) == losses(on)  # bitwise: the same computation, only storage moved
    dp, where = max_param_rel_diff(full_params(off), full_params(on))
    assert dp == 0.0, where
    for rank, r in enumerate(off):
        for rec in r["records"][1:]:  # from step 2 on Adam state exists too
            mem = rec["memory"]
            assert mem["phase2"]["vision"] == 0, (rank, mem)
            assert mem["phase1"]["vision"] > 0 and mem["phase3"]["vision"] == mem["phase1"]["vision"]
            assert mem["phase2"]["language"] == mem["phase1"]["language"]
    for r in on:
        mem = r["records"][-1]["memory"]
        assert mem["phase2"]["vision"] == mem["phase1"]["vision"] > 0
