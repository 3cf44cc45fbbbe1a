"""The cost model calibrated to a run's own steps (`calibrate`, `Calibration`), refitted from layers
measured in-process (`fold_layer_measurements`), and the search under the run's constraints
(`rank_calibrated`). Pure; part of `planner.autotune`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.cost_terms import data_time, io_allreduce, io_flops, layer_parts
from megatron_hetero.planner.hardware import AlphaBeta, LayerModel, Profile, fit_alpha_beta, ring_factors
from megatron_hetero.planner.search import search
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.workload import Candidate, Workload, check_candidate
from megatron_hetero.config.autotune import Fixes
from megatron_hetero.planner.autotune_fix import honours, space_with_fixes
from megatron_hetero.planner.autotune_trace import StepTimes


#: the most candidates `rank_calibrated` asks the search for while filtering by the fixes
MAX_RANKED = 4096
#: the calibration's terms (`Calibration.factors` also holds "residual")
TERMS = ("encoder", "llm", "comm", "optimizer")


# --- calibration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleTerms:
    """A module's predicted busiest-stage work per step: `compute` (layer compute, `<kind>_io`,
    `data`) and `comm` (in-layer TP/CP communication and the io's TP all-reduces)."""

    compute: float
    comm: float

    @property
    def total(self) -> float:
        return self.compute + self.comm


def _stage_work(
    prof: Profile, wl: Workload, spec, seg_tp, seg_cp, ep, layers: int, samples: float, runs: float, data: bool
) -> ModuleTerms:
    c, t, q = (float(np.asarray(x).reshape(-1)[0]) for x in layer_parts(prof, wl, spec, samples, seg_tp, seg_cp, ep))
    io_c = float(np.asarray(prof.overhead_time(f"{spec.kind}_io", io_flops(wl, spec, samples, seg_tp, seg_cp))))
    io_q = 0.0
    if f"{spec.kind}_io_tp" in prof.overheads:
        io_q = float(
            np.asarray(prof.overhead_time(f"{spec.kind}_io_tp", io_allreduce(prof, wl, spec, samples, seg_tp, seg_cp)))
        )
    d = float(np.asarray(data_time(prof, wl, samples))) if data else 0.0
    return ModuleTerms(compute=runs * (layers * c + io_c + d), comm=runs * (layers * (t + q) + io_q))


def _sum_terms(terms) -> ModuleTerms:
    terms = list(terms)
    return ModuleTerms(compute=sum(t.compute for t in terms), comm=sum(t.comm for t in terms))


def predicted_terms(c: Candidate, wl: Workload, prof: Profile) -> dict[str, Any]:
    """The cost model's prediction, per step, of what the trace measures for candidate `c`:
    'encoder' and 'llm' (`ModuleTerms` of the busiest stage: its layers, the run's `<kind>_io` and
    `data`, over the step's runs), and from the breakdown (`cost.evaluate`) 'dp' (gradient and loss
    all-reduces), 'boundary', 'optimizer' (optimizer step and state snapshots) and 'total'."""
    b = check_candidate(c, wl)
    bd = evaluate(c, wl, prof)
    G, m = wl.global_batch, wl.micro_batch
    ceil = lambda a, p: -(-a // p)  # noqa: E731
    views = list(zip(c.encoders, wl.encoder_views()))
    if c.placement == "disjoint":
        M = m * max(s.dp for s in c.llm)
        # every encoder on its own island: the busiest rank is the busiest island's
        enc = max(
            (
                _stage_work(
                    prof, v, v.encoder, e.tp, e.cp, 1, ceil(e.layers, e.pp), M * v.images_per_sample / e.dp, b, True
                )
                for e, v in views
            ),
            key=lambda t: t.total,
        )
        segs = [_stage_work(prof, wl, wl.llm, s.tp, s.cp, s.ep, ceil(s.layers, s.pp), M / s.dp, b, True) for s in c.llm]
        llm = max(segs, key=lambda t: t.total)
    else:
        s = c.llm[0]
        # every encoder on the same ranks: their busiest stages' work adds up
        if c.placement == "homogeneous":
            enc = _sum_terms(
                _stage_work(prof, v, v.encoder, s.tp, s.cp, 1, e.layers, m * v.images_per_sample, b, False)
                for e, v in views
            )
            rest = ceil(s.layers - c.first_stage_layers, s.pp - 1) if s.pp > 1 else 0
            layers = max(c.first_stage_layers, rest) if s.pp > 1 else s.layers
        else:
            enc = _sum_terms(
                _stage_work(
                    prof, v, v.encoder, e.tp, e.cp, 1, ceil(e.layers, e.pp), G * v.images_per_sample / e.dp, 1, True
                )
                for e, v in views
            )
            layers = ceil(s.layers, s.pp)
        llm = _stage_work(prof, wl, wl.llm, s.tp, s.cp, s.ep, layers, m, b, True)
    return {
        "encoder": enc,
        "llm": llm,
        "dp": bd.dp_comm,
        "boundary": bd.boundary,
        "optimizer": bd.optimizer,
        "total": bd.total,
    }


@dataclass(frozen=True)
class Calibration:
    """The cost model fitted to a run: `factors` per term (`TERMS`, and 'residual'), the `measured`
    and `predicted` seconds per step they came from (busiest rank, median over steps; predicted with
    the uncalibrated profile), the calibrated `profile`, and `notes` (terms left at 1 and why)."""

    factors: dict[str, float]
    measured: dict[str, float]
    predicted: dict[str, float]
    profile: Profile
    notes: tuple[str, ...] = ()

    def predict(self, c: Candidate, wl: Workload) -> float:
        """Predicted step seconds of candidate `c` at the run's speed: the calibrated profile's
        step times the residual factor."""
        return evaluate(c, wl, self.profile).total * self.factors["residual"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "factors": dict(self.factors),
            "measured": dict(self.measured),
            "predicted": dict(self.predicted),
            "notes": list(self.notes),
        }


def _lm(m: LayerModel, s: float) -> LayerModel:
    return LayerModel(a=m.a * s, b=m.b * s)


def _ab(m: AlphaBeta, s: float) -> AlphaBeta:
    return AlphaBeta(alpha=m.alpha * s, beta=m.beta * s)


def _tables(tables: dict, s: float) -> dict:
    return {
        kind: {link: {n: _ab(ab, s) for n, ab in by_n.items()} for link, by_n in t.items()}
        for kind, t in tables.items()
    }


def scale_profile(
    prof: Profile, wl: Workload, factors: Mapping[str, float], optimizer: Optional[LayerModel] = None
) -> Profile:
    """`prof` with the calibration's factors applied (see the module docstring): 'comm' on links,
    collective tables and the `grad_sync` intercept; 'encoder' / 'llm' on the module kind's layer
    model and its `<kind>_io` (the LLM's also on `data`); the `optimizer` overhead replaced by
    `optimizer` when given. Missing factors are 1; ValueError for a factor that is not positive and
    finite, or for one module kind shared by encoder and LLM with different factors."""
    f = {t: float(factors.get(t, 1.0)) for t in ("encoder", "llm", "comm")}
    for t, v in f.items():
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"calibration factor {t!r} must be positive and finite, got {v}")
    if wl.encoder.kind == wl.llm.kind and f["encoder"] != f["llm"]:
        raise ValueError(f"encoder and LLM share the layer model {wl.llm.kind!r}; their factors must be equal")
    layers = dict(prof.layers)
    for mod, spec in (("encoder", wl.encoder), ("llm", wl.llm)):
        layers[spec.kind] = _lm(prof.layer_model(spec.kind), f[mod])
    overheads = dict(prof.overheads)
    for name, s in (("encoder_io", f["encoder"]), ("llm_io", f["llm"]), ("data", f["llm"])):
        if name in overheads:
            overheads[name] = _lm(overheads[name], s)
    if "grad_sync" in overheads:  # t = a + b * formula: the formula scales with the links
        g = overheads["grad_sync"]
        overheads["grad_sync"] = LayerModel(a=g.a * f["comm"], b=g.b)
    if optimizer is not None:
        overheads["optimizer"] = optimizer
    return dataclasses.replace(
        prof,
        layers=layers,
        links={k: _ab(v, f["comm"]) for k, v in prof.links.items()},
        collectives=_tables(prof.collectives, f["comm"]),
        layer_collectives=_tables(prof.layer_collectives, f["comm"]),
        overheads=overheads,
        source=f"{prof.source} (calibrated to the run)",
    )


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def calibrate(steps: StepTimes, current: Candidate, wl: Workload, prof: Profile) -> Calibration:
    """Fit the cost model to a run of candidate `current` (the layout the traced steps ran): the
    factors of `TERMS` and the residual (module docstring), each from the median over `steps` of
    the busiest rank. ValueError for a candidate that does not split the workload."""
    pred = predicted_terms(current, wl, prof)
    n = len(steps.wall_s)
    med = lambda kinds: _median([steps.kind_time(i, kinds) for i in range(n)])  # noqa: E731
    colocated = current.placement != "disjoint"
    measured = {
        "encoder": med(("encoder-forward", "encoder-backward")),
        "llm": med(("llm-forward", "llm-backward")),
        "comm": med(("grad-reduce", "boundary") if colocated else ("grad-reduce",)),
        "optimizer": med("optimizer"),
        "step": steps.step_s,
    }
    pred_comm = pred["dp"] + (pred["boundary"] if colocated else 0.0)
    predicted = {
        "encoder": pred["encoder"].total,
        "llm": pred["llm"].total,
        "comm": pred_comm,
        "optimizer": pred["optimizer"],
        "step": pred["total"],
    }
    notes: list[str] = []
    factors: dict[str, float] = {}

    def ratio(term: str, num: float, den: float) -> float:
        if den <= 0 or num <= 0:
            notes.append(f"{term}: measured {num:.4g} s, predicted {den:.4g} s per step: cannot tell a speed, factor 1")
            return 1.0
        return num / den

    factors["comm"] = ratio("comm", measured["comm"], pred_comm)
    for mod in ("encoder", "llm"):
        t: ModuleTerms = pred[mod]
        left = measured[mod] - factors["comm"] * t.comm
        if left <= 0.05 * measured[mod] and t.comm > 0:
            notes.append(
                f"{mod}: the in-layer communication at the comm factor explains the measured time; compute factor from the whole"
            )
            left = measured[mod] * t.compute / t.total
        factors[mod] = ratio(mod, left, t.compute)
    if wl.encoder.kind == wl.llm.kind:  # one layer model for both: one factor from both
        both = ratio(
            "encoder+llm",
            measured["encoder"] + measured["llm"] - factors["comm"] * (pred["encoder"].comm + pred["llm"].comm),
            pred["encoder"].compute + pred["llm"].compute,
        )
        factors["encoder"] = factors["llm"] = both
    opt_model, factors["optimizer"] = _optimizer_model(current, wl, prof, measured["optimizer"], notes)
    calibrated = scale_profile(prof, wl, factors, opt_model)
    step = evaluate(current, wl, calibrated).total
    factors["residual"] = ratio("residual", measured["step"], step)
    return Calibration(factors, measured, predicted, calibrated, tuple(notes))


def _optimizer_model(
    c: Candidate, wl: Workload, prof: Profile, measured: float, notes: list
) -> tuple[Optional[LayerModel], float]:
    """(the `optimizer` overhead that prices the current layout's optimizer step at `measured`
    seconds, its factor): the profile's model scaled by measured / its prediction (state snapshots
    aside: they run outside the optimizer span), or, without one, `measured` per parameter on the
    rank (a = 0; factor 1, with a note). (None, 1) (keep the profile's) when nothing was measured."""
    if measured <= 0:
        notes.append("optimizer: no optimizer time measured, the profile's is kept")
        return None, 1.0
    base = dict(prof.overheads)
    base.pop("snapshot", None)
    has = "optimizer" in base
    model = base.get("optimizer", LayerModel(0.0, 1.0))
    base["optimizer"] = model
    x = evaluate(c, wl, dataclasses.replace(prof, overheads=base)).optimizer  # at the layout's parameters
    if x <= 0:
        notes.append("optimizer: the optimizer model predicts 0 for this layout, the profile's is kept")
        return None, 1.0
    if not has:
        notes.append(
            "optimizer: the profile has no optimizer model; set to the measured time per parameter on the rank"
        )
        return _lm(model, measured / x), 1.0
    return _lm(model, measured / x), measured / x


# --- what the current layout cannot tell: layers measured in-process at other degrees ----------
@dataclass(frozen=True)
class LayerCase:
    """One transformer layer of a module measured in-process: forward + backward `seconds` of one
    layer (the module's own sizes) on `samples` samples per replica, at degrees `tp`, `cp` (one of
    them 1: a case with both above 1 cannot split TP from CP communication)."""

    tp: int
    cp: int
    samples: float
    seconds: float

    def __post_init__(self):
        for key in ("tp", "cp"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layer case: {key} must be a positive integer, got {v!r}")
        if self.tp > 1 and self.cp > 1:
            raise ValueError(f"layer case: tp {self.tp} and cp {self.cp} together cannot tell TP from CP communication")
        for key in ("samples", "seconds"):
            v = float(getattr(self, key))
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"layer case: {key} must be positive, got {v}")


def _with_layer_model(prof: Profile, kind: str, model: LayerModel) -> Profile:
    return dataclasses.replace(prof, layers={**prof.layers, kind: model})


def _scalar(x) -> float:
    return float(np.asarray(x, dtype=float).reshape(-1)[0])


def _curve(prof: Profile, kind: str, link: str, n: int) -> AlphaBeta:
    """The in-layer cost curve of collective `kind` over `n` ranks on `link` the profile applies
    (`Profile.layer_collective_time`): its in-layer table, else its collectives table, else the ring
    formula on the link, as one alpha + bytes * beta."""
    for table in (prof.layer_collectives, prof.collectives):
        for size, ab in table.get(kind, {}).get(link, {}).items():
            if int(size) == n:
                return ab
    hops, frac = ring_factors(kind, n)
    ln = prof.links[link]
    return AlphaBeta(alpha=_scalar(hops) * ln.alpha, beta=_scalar(frac) * ln.beta)


def _fit_or_scale(base: AlphaBeta, points: list[tuple[float, float]]) -> AlphaBeta:
    """alpha + x * beta through `points` (x, y), never negative at any x: least squares with two
    distinct x or more (`fit_alpha_beta`: alpha >= 0) when its beta comes out >= 0, else `base`
    scaled to the points (least squares over the scale): one size cannot split alpha from beta, and
    times that fall as the size grows are noise (timings on busy shared cores), not a cost that a
    larger layer or message would make negative; base's shape is kept."""
    ys = [max(y, 0.0) for _, y in points]
    xs = [x for x, _ in points]
    if len(set(xs)) >= 2:
        a, b = fit_alpha_beta(xs, ys)
        if b >= 0:
            return AlphaBeta(alpha=a, beta=b)
    now = [base.alpha + x * base.beta for x in xs]
    if all(n > 0 for n in now):
        s = sum(n * y for n, y in zip(now, ys)) / sum(n * n for n in now)
        return AlphaBeta(alpha=base.alpha * s, beta=base.beta * s)
    return AlphaBeta(alpha=0.0, beta=sum(ys) / sum(xs))


def fold_layer_measurements(prof: Profile, wl: Workload, module: str, cases: Sequence[LayerCase]) -> Profile:
    """`prof` with what in-process layer measurements of `module` ('encoder' or 'llm') tell:

    - TP1·CP1 cases refit the module kind's layer model t = a + b * FLOPs (least squares with two
      distinct sizes or more; one size scales the model, keeping its a/b split);
    - TP>1 cases set the in-layer all-reduce over tp ranks (`Profile.layer_collectives`): per call,
      (measured - the layer model's compute at that tp) / the layer's TP collectives (4; 6 with full
      recompute), fitted per group size against bytes (one size scales the profile's curve there);
    - CP>1 cases (modules that shard their sequence) likewise the ring's all-gather, adding back the
      attention compute the cost model overlaps with it.

    The timed layer is a GPT layer of the module's sizes (`training.autotune_layers`): a hybrid language
    model's cases are read as that layer's, and its own layers priced from the fitted model
    (`cost_terms.layer_parts`). Fold before `calibrate`, onto the profile the run is calibrated from.
    ValueError for an unknown module, no cases, or CP cases of a module that does not shard its sequence."""
    if module not in ("encoder", "llm"):
        raise ValueError(f"module must be 'encoder' or 'llm', got {module!r}")
    if not cases:
        raise ValueError("fold_layer_measurements: no layer cases")
    spec = wl.encoder if module == "encoder" else wl.llm
    if spec.layer_mix is not None:  # the timed layer: a dense GPT layer of the hybrid model's sizes
        spec = dataclasses.replace(spec, layer_mix=None, num_experts=0)
    if any(c.cp > 1 for c in cases) and not spec.shards:
        raise ValueError(f"{module} does not shard its sequence over CP (it runs replicated): CP cases tell nothing")
    # the layer model: compute = a * xa + b * xb (xa, xb: the probe models' times, recompute included)
    xab = lambda p, c: _scalar(layer_parts(p, wl, spec, c.samples, c.tp, c.cp)[0])  # noqa: E731
    solo = [c for c in cases if c.tp == 1 and c.cp == 1]
    if solo:
        pa, pb = (
            _with_layer_model(prof, spec.kind, LayerModel(1.0, 0.0)),
            _with_layer_model(prof, spec.kind, LayerModel(0.0, 1.0)),
        )
        pts = [(xab(pb, c) / xab(pa, c), c.seconds / xab(pa, c)) for c in solo]
        cur = prof.layer_model(spec.kind)
        ab = _fit_or_scale(AlphaBeta(cur.a, cur.b), pts)
        prof = _with_layer_model(prof, spec.kind, LayerModel(ab.alpha, ab.beta))
    tables = {k: {ln: dict(t) for ln, t in v.items()} for k, v in prof.layer_collectives.items()}
    groups: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    b = prof.layer_model(spec.kind).b
    for c in cases:
        if c.tp == c.cp == 1:
            continue
        compute = xab(prof, c)
        tokens = c.samples * spec.seq
        if c.tp > 1:
            calls = 6.0 if wl.recompute == "full" else 4.0
            nbytes = tokens / (c.cp if spec.shards else 1) * spec.hidden * wl.dtype_bytes
            key = ("all_reduce", "inter" if c.tp > prof.devices_per_node else "intra", c.tp)
            groups.setdefault(key, []).append((nbytes, (c.seconds - compute) / calls))
        else:
            nbytes = 2.0 * tokens * spec.hidden * wl.dtype_bytes
            overlap = b * 12.0 * tokens * spec.seq * spec.hidden / c.cp
            key = ("all_gather", "inter" if c.cp > prof.devices_per_node else "intra", c.cp)
            groups.setdefault(key, []).append((nbytes, (c.seconds - compute + overlap) / 3.0))
    for (kind, link, n), pts in groups.items():
        tables.setdefault(kind, {}).setdefault(link, {})[n] = _fit_or_scale(_curve(prof, kind, link, n), pts)
    return dataclasses.replace(prof, layer_collectives=tables)


# --- search under the run's constraints ---------------------------------------------------------
def rank_calibrated(
    calib: Calibration,
    wl: Workload,
    world_size: int,
    fixes: Optional[Fixes] = None,
    memory_limit: Optional[float] = None,
    space: SearchSpace = SearchSpace(runtime=True),
    top: int = 10,
    encoder_name: str = "vision",
    llm_name: str = "language",
    extra_names: tuple = (),
) -> list[tuple[Candidate, float]]:
    """The best candidates at the run's speed under its constraints: `search` on the calibrated
    profile with the fixed tp/cp/pp in its space (`space_with_fixes`), then the rest of the fixes
    (`honours`); [(candidate, predicted step seconds)], fastest first (`extra_names`: the module
    names of the workload's extra encoders). The search's ValueError when nothing fits."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    fixes = fixes or {}
    sp = space_with_fixes(space, fixes, encoder_name, llm_name, extra_names)
    k = top
    while True:  # the fixes the space cannot hold filter the ranking: widen it until `top` honour them
        res = search(wl, calib.profile, world_size, memory_limit=memory_limit, space=sp, top=k)
        out = [
            (r.candidate, r.breakdown.total * calib.factors["residual"])
            for r in res.ranked
            if honours(r.candidate, fixes, encoder_name, llm_name, extra_names)
        ]
        if len(out) >= top or len(res.ranked) < k or k >= MAX_RANKED:
            return out[:top]
        k = min(4 * k, MAX_RANKED)
