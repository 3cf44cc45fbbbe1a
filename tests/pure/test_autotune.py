"""The pure core of `train --hetero-autotune` (planner/autotune.py): `--autotune-fix` and the fix
filter, the steps of a trace, the calibration of the cost model to a run, the switch/stay and
keep/revert decisions, and `autotune.json`. Pure: no torch.

The real traces (`tests/fixtures/autotune/`) are what
`megatron-hetero train --hetero-layout L --train-iters 3 --trace T` wrote with the sizes of
tests/e2e/test_trace.py (SIZES) on CPU ranks: `trace_colocated_dp2.json` for the colocated layout
vision dp 2, language dp 2 (2 ranks), `trace_disjoint_pp2.json` for the disjoint layout vision
dp 1, language pp 2 (3 ranks).
The calibration is checked on synthetic traces built with `runtime.trace.chrome_trace` (the
function `gather_trace` merges the ranks' spans with) from the cost model's own prediction times
known factors.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from megatron_hetero.layout import load_layout
from megatron_hetero.planner import autotune as A
from megatron_hetero.config.autotune import parse_fix
from megatron_hetero.planner.hardware import HardwareSpec, LayerModel, Profile
from megatron_hetero.planner.search_space import Ranked, SearchSpace
from megatron_hetero.planner.workload import Candidate, ModelSpec, Segment, Workload
from megatron_hetero.runtime.trace import chrome_trace

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "tests" / "fixtures" / "autotune" / "trace_colocated_dp2.json"
TRACE_DISJOINT = REPO / "tests" / "fixtures" / "autotune" / "trace_disjoint_pp2.json"
HW_FILE = REPO / "megatron_hetero" / "planner" / "hardware_presets" / "h100_80gb.json"

ENC = ModelSpec("vision", 4, 1024, 4096, 16, 256, kind="encoder")
LLM = ModelSpec("language", 8, 2048, 5632, 16, 2048, vocab=32000, gated=True)
WL = Workload(ENC, LLM, global_batch=16, micro_batch=1)


@pytest.fixture(scope="module")
def prof() -> Profile:
    return Profile.from_hardware(HardwareSpec.load(HW_FILE))


def colocated(etp=1, edp=8, tp=2, pp=1, dp=4) -> Candidate:
    return Candidate("colocated", Segment.of(tp=etp, dp=edp, layers=4), (Segment.of(tp=tp, pp=pp, dp=dp, layers=8),))


# --- --autotune-fix -----------------------------------------------------------------------------
def test_parse_fix():
    assert parse_fix("language.tp=4, vision.dp=8") == {"language": {"tp": 4}, "vision": {"dp": 8}}
    assert parse_fix("language.tp=4,language.pp=2") == {"language": {"tp": 4, "pp": 2}}
    assert parse_fix("") == {} and parse_fix(None) == {}


@pytest.mark.parametrize(
    "text, says",
    [
        ("language.tp", "'language.tp' is not MODULE.FIELD=INT"),
        ("tp=4", "'tp=4' is not MODULE.FIELD=INT"),
        ("language.heads=4", "field 'heads' is not one of"),
        ("language.tp=four", "'four' is not an integer"),
        ("vision.dp=0", "dp must be >= 1"),
        ("language.tp=2,language.tp=4", "language.tp given twice"),
    ],
)
def test_parse_fix_errors(text, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_fix(text)


def test_honours_and_space():
    c = colocated(tp=2, dp=4)
    assert A.honours(c, parse_fix("language.tp=2,vision.dp=8"))
    assert not A.honours(c, parse_fix("language.tp=4"))
    assert not A.honours(c, parse_fix("vision.tp=2"))
    chain = Candidate(
        "disjoint", Segment.of(dp=2, layers=4), (Segment.of(tp=2, dp=1, layers=4), Segment.of(tp=1, dp=2, layers=4))
    )
    assert A.honours(chain, {"language_a": {"tp": 2}}) and not A.honours(chain, {"language": {"tp": 2}})
    assert not A.honours(c, {"language_b": {"tp": 1}})  # one segment: no second one to honour it
    with pytest.raises(ValueError, match="unknown module 'audio'"):
        A.honours(c, {"audio": {"tp": 1}})
    sp = A.space_with_fixes(SearchSpace(runtime=True), parse_fix("language.tp=4,language.pp=2,vision.tp=1"))
    assert (sp.tp, sp.pp, sp.encoder_tp, sp.cp) == ((4,), (2,), (1,), SearchSpace().cp)
    with pytest.raises(ValueError, match="encoders with cp 1"):
        A.space_with_fixes(SearchSpace(runtime=True), {"vision": {"cp": 2}})


def test_rank_calibrated_honours_fixes(prof):
    calib = A.Calibration({"residual": 2.0}, {}, {}, prof)
    space = SearchSpace(tp=(1, 2, 4), cp=(1,), pp=(1, 2), encoder_tp=(1, 2), encoder_pp=(1,), runtime=True)
    free = A.rank_calibrated(calib, WL, 8, space=space, top=50)
    fixes = parse_fix("language.tp=2,vision.dp=4")
    got = A.rank_calibrated(calib, WL, 8, fixes, space=space, top=50)
    assert got and all(A.honours(c, fixes) for c, _ in got)
    assert [p for _, p in got] == sorted(p for _, p in got)
    # the same candidates, at the same (residual-scaled) predictions, as filtering the free search
    want = [(c, p) for c, p in free if A.honours(c, fixes)]
    assert got[: len(want)] == want[: len(got)]
    c, p = got[0]
    assert p == pytest.approx(calib.predict(c, WL))
    # a fix the space cannot hold (a dp) filters a ranking widened until `top` candidates honour it
    rare = A.rank_calibrated(calib, WL, 8, {"language": {"dp": 1}}, space=space, top=3)
    every = [(c, p) for c, p in A.rank_calibrated(calib, WL, 8, space=space, top=4096) if c.llm[0].dp == 1]
    assert len(rare) == min(3, len(every)) > 0 and rare == every[: len(rare)]
    assert A.rank_calibrated(calib, WL, 8, {"vision": {"dp": 3}}, space=space) == []  # none can


# --- the trace ----------------------------------------------------------------------------------
def span(kind, t0_s, dur_s, module="", **args):
    ns = lambda s: int(round(s * 1e9))  # noqa: E731
    return (kind, kind, ns(t0_s), ns(t0_s) + ns(dur_s), {"module": module, **args} if module else args)


def test_real_trace_steps():
    doc = json.loads(TRACE.read_text())
    st = A.step_times_from_trace(doc)
    assert st.ranks == (0, 1) and len(st.wall_s) == 3
    assert st.wall_s[0] > st.wall_s[1]  # the first step warms up
    steady = st.drop(1)
    assert len(steady.wall_s) == 2 and steady.step_s == pytest.approx(sum(st.wall_s[1:]) / 2)
    assert 0 <= steady.spread_s < 0.5 * steady.step_s
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for k in range(3):
        # each rank's busy time (self times: nothing twice) fits in the wall time since the trace began
        for j in range(2):
            assert sum(v[j] for v in st.busy[k].values()) <= sum(st.wall_s[: k + 1]) + 1e-9
        tot = st.totals()[k]
        assert tot["encoder-backward"]["vision"] > 0 and tot["llm-forward"]["language"] > 0
        assert st.kind_time(k, "optimizer") > 0 and st.kind_time(k, "grad-reduce") > 0
    # the boundary's backward holds the encoder's backward: rank 0's boundary self time is its
    # boundary spans less the encoder backward nested in each backward one
    raw = lambda cat: sum(e["dur"] for e in ev if e["cat"] == cat and e["pid"] == 0) / 1e6  # noqa: E731
    self_time = sum(st.busy[k][("boundary", "")][0] for k in range(3))
    assert self_time == pytest.approx(raw("boundary") - raw("encoder-backward"), rel=1e-6)


def tiny(placement: str) -> tuple[Workload, Candidate]:
    """The workload and candidate of a fixture's run (tests/e2e/test_trace.py's sizes, fp32 Adam)."""
    enc = ModelSpec("vision", 1, 16, 64, 2, 4, kind="encoder")
    llm = ModelSpec("language", 2, 32, 128, 2, 16, vocab=256)
    wl = Workload(enc, llm, global_batch=4, dtype_bytes=4, distributed_optimizer=False, sequence_parallel=False)
    if placement == "disjoint":
        return wl, Candidate("disjoint", Segment.of(layers=1), (Segment.of(pp=2, layers=2),), encoder_ranks=1)
    return wl, Candidate("colocated", Segment.of(dp=2, layers=1), (Segment.of(dp=2, layers=2),))


def test_real_disjoint_trace(prof):
    st = A.step_times_from_trace(json.loads(TRACE_DISJOINT.read_text()))
    assert st.ranks == (0, 1, 2) and len(st.wall_s) == 3
    for k in range(3):
        assert st.busy[k][("encoder-forward", "vision")][1:] == (0.0, 0.0)  # the encoder island is rank 0
        assert st.busy[k][("llm-forward", "language")][0] == 0.0
        assert min(st.busy[k][("llm-backward", "language")][1:]) > 0  # both language stages
        assert st.kind_time(k, "grad-reduce", "language") > 0 and st.kind_time(k, "comm") > 0
    wl, cand = tiny("disjoint")
    calib = A.calibrate(st.drop(1), cand, wl, prof)
    assert calib.predict(cand, wl) == pytest.approx(st.drop(1).step_s, rel=1e-9)
    assert all(calib.factors[t] > 10 for t in ("encoder", "llm", "comm"))


def test_synthetic_trace_self_times_and_walls():
    payloads = [
        {
            "rank": r,
            "host": "h",
            "spans": [
                span("encoder-forward", 0.0 + r * 0.01, 0.1, "vision"),
                span("boundary", 0.2, 0.3),  # holds the encoder's backward
                span("encoder-backward", 0.25, 0.2, "vision"),
                span("optimizer", 0.6, 0.1 + r * 0.05),
                span("encoder-forward", 1.0, 0.1, "vision"),
                span("optimizer", 1.2, 0.1),
                span("wait", 1.4, 0.1),  # after the last optimizer span: not a step
            ],
        }
        for r in (0, 1)
    ]
    st = A.step_times_from_trace(chrome_trace(payloads))
    assert st.wall_s == pytest.approx((0.75, 1.3 - 0.75))  # rank 1 closes step 0 at 0.75
    assert st.kind_time(0, "boundary") == pytest.approx(0.1)
    assert st.kind_time(0, "encoder-backward", "vision") == pytest.approx(0.2)
    assert st.kind_time(0, "optimizer") == pytest.approx(0.15) and st.kind_time(
        0, "optimizer", how="mean"
    ) == pytest.approx(0.125)
    assert ("wait", "") not in st.busy[1]
    payloads[1]["spans"].pop()  # rank 1: one optimizer span, rank 0: two
    payloads[1]["spans"].pop()
    with pytest.raises(ValueError, match="one optimizer span"):
        A.step_times_from_trace(chrome_trace(payloads))
    with pytest.raises(ValueError, match="no spans"):
        A.step_times_from_trace(chrome_trace([]))
    with pytest.raises(ValueError, match="not a trace"):
        A.step_times_from_trace({"events": []})


# --- calibration --------------------------------------------------------------------------------
def synthetic_run(cand: Candidate, wl: Workload, prof: Profile, f: dict, steps: int = 3, gap: float = 0.2) -> dict:
    """A trace document of `steps` colocated steps of `cand` (pp = 1: every rank alike) whose spans
    last the cost model's prediction times the factors `f` (encoder, llm, comm, opt), plus `gap`
    of the step unaccounted for; step k takes (1 + 0.01 k) times as long (noise)."""
    p = A.predicted_terms(cand, wl, prof)
    enc = f["encoder"] * p["encoder"].compute + f["comm"] * p["encoder"].comm
    llm = f["llm"] * p["llm"].compute + f["comm"] * p["llm"].comm
    comm = f["comm"] * (p["dp"] + p["boundary"])
    opt = f["opt"]
    B = wl.global_batch // (wl.micro_batch * cand.llm[0].dp)
    world = cand.world_size
    payloads = [{"rank": r, "host": "h", "spans": []} for r in range(world)]
    t = 0.0
    for k in range(steps):
        s = 1.0 + 0.01 * k
        for pl in payloads:
            sp, c = pl["spans"], t
            sp.append(span("encoder-forward", c, s * enc / 3, "vision"))
            c += s * enc / 3
            sp.append(span("boundary", c, s * comm / 4))
            c += s * comm / 4
            for mb in range(B):
                sp.append(span("llm-forward", c, s * llm / B / 3, "language", mb=mb))
                c += s * llm / B / 3
                sp.append(span("llm-backward", c, s * llm / B * 2 / 3, "language", mb=mb))
                c += s * llm / B * 2 / 3
            sp.append(span("boundary", c, s * (comm / 4 + enc * 2 / 3)))  # holds the encoder backward
            sp.append(span("encoder-backward", c + s * comm / 8, s * enc * 2 / 3, "vision"))
            c += s * (comm / 4 + enc * 2 / 3)
            sp.append(span("grad-reduce", c, s * comm / 2))
            c += s * comm / 2
            sp.append(span("optimizer", c, s * opt))
            c += s * opt
        t = c + s * gap
    return chrome_trace(payloads, meta={"placement": "colocated"})


@pytest.mark.parametrize("cand", [colocated(tp=1, dp=8, etp=1, edp=8), colocated(tp=2, dp=4, etp=2, edp=4)])
def test_calibration_recovers_known_factors(prof, cand):
    measured_prof = dataclasses.replace(prof, overheads={"optimizer": LayerModel(1e-3, 1e-10)})
    opt_pred = A.predicted_terms(cand, WL, measured_prof)["optimizer"]
    f = {"encoder": 2.0, "llm": 3.0, "comm": 1.5, "opt": 4.0 * opt_pred}
    st = A.step_times_from_trace(synthetic_run(cand, WL, measured_prof, f))
    calib = A.calibrate(st, cand, WL, measured_prof)
    assert calib.factors["encoder"] == pytest.approx(2.0, rel=0.02)
    assert calib.factors["llm"] == pytest.approx(3.0, rel=0.02)
    assert calib.factors["comm"] == pytest.approx(1.5, rel=0.02)
    assert calib.factors["optimizer"] == pytest.approx(4.0, rel=0.02)
    assert calib.factors["residual"] > 1.0  # the unmodelled gap between steps
    # the current layout is predicted at its measured step (the median), and the breakdown's parts at the run's speed
    assert calib.predict(cand, WL) == pytest.approx(st.step_s, rel=1e-9)
    again = A.predicted_terms(cand, WL, calib.profile)
    assert again["encoder"].total == pytest.approx(calib.measured["encoder"], rel=0.02)
    assert again["llm"].total == pytest.approx(calib.measured["llm"], rel=0.02)
    assert set(calib.to_dict()) == {"factors", "measured", "predicted", "notes"}


def synthetic_disjoint_run(cand: Candidate, wl: Workload, prof: Profile, f: dict, steps: int = 3) -> dict:
    """A disjoint run of `cand` (one stage per island): the encoder island's ranks first, each rank
    its module's micro-batches (spans: the prediction times `f`), a `wait` per micro-batch (the
    pipeline's, in no term), then its gradient reduction and the optimizer step."""
    p = A.predicted_terms(cand, wl, prof)
    b = wl.global_batch // (wl.micro_batch * max(s.dp for s in cand.llm))
    work = {
        "encoder": f["encoder"] * p["encoder"].compute + f["comm"] * p["encoder"].comm,
        "llm": f["llm"] * p["llm"].compute + f["comm"] * p["llm"].comm,
    }
    roles = ["encoder"] * cand.encoder.size + ["llm"] * cand.llm[0].size
    payloads = [{"rank": r, "host": "h", "spans": []} for r in range(len(roles))]
    t = 0.0
    for k in range(steps):
        ends = []
        for pl, role in zip(payloads, roles):
            sp, c, w, name = pl["spans"], t, work[role] / b, "vision" if role == "encoder" else "language"
            for mb in range(b):
                sp.append(span(f"{role}-forward", c, w / 3, name, mb=mb))
                sp.append(span("wait", c + w / 3, 1e-3))
                sp.append(span(f"{role}-backward", c + w / 3 + 1e-3, 2 * w / 3, name, mb=mb))
                c += w + 1e-3
            sp.append(span("grad-reduce", c, f["comm"] * p["dp"], name))
            c += f["comm"] * p["dp"]
            sp.append(span("optimizer", c, f["opt"]))
            ends.append(c + f["opt"])
        t = max(ends) + 0.01 * (k + 1)
    return chrome_trace(payloads, meta={"placement": "disjoint"})


def test_calibration_disjoint(prof):
    cand = Candidate("disjoint", Segment.of(tp=2, dp=2, layers=4), (Segment.of(tp=2, dp=2, layers=8),), encoder_ranks=4)
    measured_prof = dataclasses.replace(prof, overheads={"optimizer": LayerModel(1e-3, 1e-10)})
    f = {"encoder": 0.5, "llm": 2.5, "comm": 3.0, "opt": 2.0 * A.predicted_terms(cand, WL, measured_prof)["optimizer"]}
    st = A.step_times_from_trace(synthetic_disjoint_run(cand, WL, measured_prof, f))
    calib = A.calibrate(st, cand, WL, measured_prof)
    for term, want in (("encoder", 0.5), ("llm", 2.5), ("comm", 3.0), ("optimizer", 2.0)):
        assert calib.factors[term] == pytest.approx(want, rel=0.02), term
    assert calib.predict(cand, WL) == pytest.approx(st.step_s, rel=1e-9)


def test_calibration_on_the_real_trace(prof):
    """The 2-rank run of the fixture, calibrated from the simulated H100 profile: a CPU is hundreds
    of times slower, every factor says so, and the current layout is predicted at its step."""
    wl, cand = tiny("colocated")
    st = A.step_times_from_trace(json.loads(TRACE.read_text())).drop(1)
    calib = A.calibrate(st, cand, wl, prof)
    assert all(calib.factors[t] > 10 for t in ("encoder", "llm", "comm"))
    assert calib.predict(cand, wl) == pytest.approx(st.step_s, rel=1e-9)
    ranked = A.rank_calibrated(calib, wl, 2, space=SearchSpace(runtime=True, tp=(1, 2), pp=(1, 2)))
    d = A.decide(st.step_s, st.spread_s, cand, ranked)
    assert d.reason.startswith(("stay:", "switch:")) and d.predicted_step_s == ranked[0][1]


def test_calibration_without_optimizer_model_or_boundary(prof):
    cand = colocated(tp=1, dp=8, etp=1, edp=8)  # encoder dp = LLM dp: nothing crosses the boundary
    st = A.step_times_from_trace(synthetic_run(cand, WL, prof, {"encoder": 1.0, "llm": 1.0, "comm": 1.0, "opt": 0.05}))
    calib = A.calibrate(st, cand, WL, prof)
    assert any("no optimizer model" in n for n in calib.notes)
    # the simulated profile's optimizer (none) is set to the measured time per parameter on the rank
    assert A.predicted_terms(cand, WL, calib.profile)["optimizer"] == pytest.approx(calib.measured["optimizer"])
    assert calib.factors["encoder"] == pytest.approx(1.0, rel=0.02)


def test_calibration_with_one_layer_model_for_both(prof):
    """An encoder priced by the LLM's layer model (kind 'llm'): one compute factor from both modules."""
    wl = dataclasses.replace(WL, encoder=dataclasses.replace(ENC, kind="llm", shards_sequence=False))
    cand = colocated(tp=1, dp=8, etp=1, edp=8)
    st = A.step_times_from_trace(synthetic_run(cand, wl, prof, {"encoder": 2.0, "llm": 2.0, "comm": 1.0, "opt": 0.01}))
    calib = A.calibrate(st, cand, wl, prof)
    assert calib.factors["encoder"] == calib.factors["llm"] == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError, match="share the layer model"):
        A.scale_profile(prof, wl, {"encoder": 2.0, "llm": 3.0})
    with pytest.raises(ValueError, match="positive and finite"):
        A.scale_profile(prof, WL, {"comm": 0.0})


# --- layers measured in-process at other degrees ----------------------------------------------------
def test_fold_layer_measurements_recovers_the_true_profile(prof):
    from megatron_hetero.planner.cost_terms import layer_parts
    from megatron_hetero.planner.hardware import AlphaBeta

    true = dataclasses.replace(
        prof,
        layers={"default": prof.layers["default"], "llm": LayerModel(2e-4, 3 * prof.layers["default"].b)},
        layer_collectives={
            "all_reduce": {"intra": {2: AlphaBeta(5e-5, 4e-11)}},
            "all_gather": {"intra": {2: AlphaBeta(1e-4, 5e-11)}},
        },
    )
    layer = lambda p, samples, tp, cp: float(sum(layer_parts(p, WL, LLM, samples, tp, cp)))  # noqa: E731
    cases = [A.LayerCase(tp, cp, n, layer(true, n, tp, cp)) for tp, cp in ((1, 1), (2, 1), (1, 2)) for n in (1, 4)]
    folded = A.fold_layer_measurements(prof, WL, "llm", cases)
    for tp, cp in ((1, 1), (2, 1), (1, 2)):
        for n in (2, 8):  # other sizes than measured: the fitted lines
            assert layer(folded, n, tp, cp) == pytest.approx(layer(true, n, tp, cp), rel=1e-6)
    # one size: the profile's curve scaled to it (the measured point exactly)
    one = A.fold_layer_measurements(
        prof, WL, "llm", [A.LayerCase(1, 1, 2, layer(true, 2, 1, 1)), A.LayerCase(4, 1, 2, 0.05)]
    )
    assert layer(one, 2, 1, 1) == pytest.approx(layer(true, 2, 1, 1)) and layer(one, 2, 4, 1) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="does not shard"):
        A.fold_layer_measurements(prof, WL, "encoder", [A.LayerCase(1, 2, 1, 1.0)])
    with pytest.raises(ValueError, match="cannot tell TP from CP"):
        A.LayerCase(2, 2, 1, 1.0)
    with pytest.raises(ValueError, match="module must be"):
        A.fold_layer_measurements(prof, WL, "audio", cases)


def test_layer_timings_that_fall_with_size_never_price_a_layer_below_zero(prof):
    """CI (2 busy cores) timed a larger layer faster than a smaller one: the least-squares slope came
    out negative and the model priced a candidate at -0.36 s. Such points scale the profile's curve."""
    from megatron_hetero.planner.autotune_calibrate import _fit_or_scale
    from megatron_hetero.planner.cost_terms import layer_parts
    from megatron_hetero.planner.hardware import AlphaBeta

    base = AlphaBeta(1e-3, 2e-9)
    fit = _fit_or_scale(base, [(1e6, 0.010), (4e6, 0.004)])  # the larger one measured faster
    assert fit.beta >= 0 and fit.alpha >= 0
    assert fit.alpha / fit.beta == pytest.approx(base.alpha / base.beta)  # base's shape, scaled
    assert _fit_or_scale(base, [(1e6, 0.002), (4e6, 0.008)]) == AlphaBeta(0.0, 2e-9)  # a clean line: fitted
    assert _fit_or_scale(base, [(1e6, 0.003)]).alpha + 1e6 * _fit_or_scale(base, [(1e6, 0.003)]).beta == (
        pytest.approx(0.003)
    )
    layer = lambda p, samples, tp, cp: float(sum(layer_parts(p, WL, LLM, samples, tp, cp)))  # noqa: E731
    t1 = layer(prof, 1, 1, 1)
    cases = [
        A.LayerCase(1, 1, 1, 3 * t1),
        A.LayerCase(1, 1, 8, t1),
        A.LayerCase(2, 1, 1, 1e-9),
        A.LayerCase(2, 1, 8, 1e-9),
    ]
    folded = A.fold_layer_measurements(prof, WL, "llm", cases)
    assert all(layer(folded, n, tp, 1) > 0 for n in (1, 8, 64, 512) for tp in (1, 2))


# --- decisions ----------------------------------------------------------------------------------
CUR = colocated(tp=2, dp=4)
OTHER = colocated(tp=4, dp=2)


def test_switch_when_the_gain_exceeds_min_gain_and_noise():
    d = A.decide(1.0, 0.02, CUR, [(CUR, 1.0), (OTHER, 0.8)], min_gain=0.05)
    assert d.switch and d.target == OTHER and d.predicted_step_s == 0.8 and d.gain == pytest.approx(0.25)
    assert d.reason.startswith("switch:") and "\n" not in d.reason


def test_stay_within_min_gain():
    d = A.decide(1.0, 0.0, CUR, [(OTHER, 0.97)], min_gain=0.05)
    assert not d.switch and "not more than --autotune-min-gain 5%" in d.reason


def test_stay_when_already_best():
    d = A.decide(1.0, 0.0, CUR, [(OTHER, 0.9), (colocated(tp=2, dp=4), 0.5)], min_gain=0.05)
    assert not d.switch and "already the best" in d.reason


def test_stay_within_noise():
    d = A.decide(1.0, 0.15, CUR, [(OTHER, 0.9)], min_gain=0.05)  # 11% faster predicted, 0.1 s < noise 0.15 s
    assert not d.switch and "within the step noise" in d.reason
    assert A.decide(1.0, 0.05, CUR, [(OTHER, 0.9)], min_gain=0.05).switch


def test_decide_inputs(prof):
    from megatron_hetero.planner.cost import evaluate

    bd = evaluate(OTHER, WL, prof)
    d = A.decide(10 * bd.total, 0.0, CUR, [Ranked(OTHER, bd)])
    assert d.switch and d.predicted_step_s == bd.total
    assert "no candidate" in A.decide(1.0, 0.0, CUR, []).reason
    for bad in ((0.0, 0.0), (1.0, -0.1), (float("nan"), 0.0)):
        with pytest.raises(ValueError):
            A.decide(*bad, CUR, [(OTHER, 0.5)])
    with pytest.raises(ValueError, match="min_gain"):
        A.decide(1.0, 0.0, CUR, [(OTHER, 0.5)], min_gain=-0.1)


def test_after_switch():
    assert not A.after_switch(1.0, 1.2)  # slower: revert
    assert not A.after_switch(1.0, 1.0)  # the same: the predicted gain did not show, revert
    assert not A.after_switch(0.714, 0.752)  # bench autotune 2026-12-04, inherited TP: 5% slower, reverted now
    assert A.after_switch(1.0, 0.8)  # faster: keep
    # faster only within the noise of the two medians: the gain did not show, revert (and try the next)
    assert not A.after_switch(0.2744, 0.2732, noise_s=0.0066)  # bench autotune 2026-12-06, inherited TP
    assert A.after_switch(0.2813, 0.2144, noise_s=0.0090)  # the same run, long context: kept
    assert A.after_switch(1.0, 0.8, noise_s=0.19) and not A.after_switch(1.0, 0.8, noise_s=0.2)
    with pytest.raises(ValueError):
        A.after_switch(1.0, 0.0)
    with pytest.raises(ValueError, match="noise_s"):
        A.after_switch(1.0, 0.8, noise_s=-0.1)


# --- autotune.json ------------------------------------------------------------------------------
def test_autotune_json_and_layout(tmp_path):
    d = A.decide(1.0, 0.02, CUR, [(OTHER, 0.8)])
    switched = A.record_of(10, CUR, d, 1.0).settle(1.3)
    assert switched.line().endswith("measured after 1.3 s: reverted") and "\n" not in switched.line()
    stay = A.record_of(20, CUR, A.decide(1.0, 0.0, CUR, [(CUR, 1.0)]), 1.0)
    paths = A.write_autotune(tmp_path, [switched, stay], CUR.to_layout())
    doc = json.loads(paths["json"].read_text())
    assert [list(r) for r in doc["decisions"]] == [list(A.RECORD_KEYS)] * 2
    first, second = doc["decisions"]
    assert first["to_layout"] == OTHER.describe() and first["kept"] is False and first["measured_after_s"] == 1.3
    assert second["from_layout"] == second["to_layout"] == CUR.describe() and second["measured_after_s"] is None
    assert list(doc) == ["decisions"] and paths["layout"].name == "autotune-layout.yaml"
    assert "stayed on" in stay.line() and A.record_of(5, CUR, d, 1.0).settle(0.7).kept
    assert load_layout(paths["layout"], 8) == CUR.to_layout()


# --- the step noise and bench autotune's comparisons ---------------------------------------------
def test_noise_is_the_standard_error_of_the_median_step():
    st = A.StepTimes(wall_s=(1.0, 1.1, 0.9, 1.0, 1.3), ranks=(0,), busy=({},) * 5)
    # median 1.0, absolute deviations 0, .1, .1, 0, .3 -> MAD 0.1
    assert st.noise_s == pytest.approx(1.2533 * 1.4826 * 0.1 / 5**0.5)
    assert st.spread_s == pytest.approx(0.4) and st.noise_s < st.spread_s
    two = A.StepTimes(wall_s=(1.0, 1.2), ranks=(0,), busy=({},) * 2)
    assert two.noise_s == pytest.approx(0.2)  # fewer than 3 steps: the range


def test_bench_autotune_compares_with_the_e2e_figure_of_the_same_layout():
    from megatron_hetero.bench import autotune as BA

    e2e = {
        "cases": [
            {"workload": "w", "layout": "L1", "speedup_vs_homogeneous": 1.26, "speedup_per_round": [1.30, 1.15, 1.28]},
            {"workload": "w", "layout": "L2", "speedup_vs_homogeneous": 1.07},
        ]
    }
    ref = BA.e2e_reference(e2e, "w", "L1")
    assert ref == {"speedup": 1.26, "per_round": [1.30, 1.15, 1.28], "range": [1.15, 1.30]}
    assert BA.e2e_reference(e2e, "w", "L2")["range"] == [1.07, 1.07]
    assert BA.e2e_reference(e2e, "other", "L1") is None and BA.e2e_reference(None, "w", "L1") is None
    assert BA.within_noise(1.20, 0.0, ref) and BA.within_noise(1.12, 0.04, ref)
    assert not BA.within_noise(1.05, 0.04, ref) and BA.within_noise(1.0, 0.1, None) is None
    r, noise = BA._median_ratio([1.9, 2.0, 2.0, 2.1], [0.95, 1.0, 1.0, 1.05])
    assert r == pytest.approx(2.0) and noise > 0
