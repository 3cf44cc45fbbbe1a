"""The pure core of `train --hetero-autotune`: read a run's own trace, fit the cost model to it, search
under the run's constraints, decide whether to switch layout and whether to keep the switch, and
record the decisions. Pure (numpy only; no torch.distributed): the trainer measures, this decides.

The trainer's order (one autotune round; only rank 0 needs to decide, and then tells the others):

1. train `--autotune-steps` K steps with a fresh recording tracer; `gather_trace` gives rank 0 the
   document (`runtime/trace.py`);
2. `steps = step_times_from_trace(doc).drop(1)`: the wall time of each step and every rank's busy
   time per (span kind, module); the first step (warm-up) is dropped;
3. optionally, `profile = fold_layer_measurements(profile, workload, "llm", [LayerCase(...)])` with
   layers measured in-process at other TP/CP degrees (what the current layout cannot tell);
4. `calib = calibrate(steps, current, workload, profile)`: the profile at the run's own speed;
5. `ranked = rank_calibrated(calib, workload, world, parse_fix(...), memory_limit=...)`;
6. `d = decide(steps.step_s, steps.spread_s, current, ranked, min_gain)`; log `d.reason`;
   `rec = record_of(iteration, current, d, steps.step_s)`;
7. on `d.switch`: checkpoint, rebuild under `d.target.to_layout()`, resume, trace K more steps
   (steps 1-2); `rec = rec.settle(after.step_s, max(steps.spread_s, after.spread_s))`, log
   `rec.line()`, and revert (rebuild under the old layout from that checkpoint) when not `rec.kept`;
8. `write_autotune(out_dir, records, chosen_layout)`: `autotune.json` and the chosen layout's YAML.

Steps in a trace: every training step of either schedule ends, on every rank, with one `optimizer`
span (`runtime/colocated.py`, `runtime/disjoint.py`); the k-th optimizer span of each rank closes
step k there. A step's wall time runs from the end of the previous step on its slowest rank (the
first step: from the earliest span) to the end of this step on its slowest rank, so it holds what
runs between steps (the loss all-reduce, logging) and is the step the run's throughput sees (it
can exceed the iteration log's time of rank 0's step call). Evaluation steps
have no optimizer span: trace only training steps (an evaluation inside the window is counted
into the next training step). Busy times are self times: a span's duration less the spans of the
same rank nested in it (a colocated boundary's backward contains the encoder's backward, the
language `schedule` span contains its micro-batches), so kinds never count the same time twice.

Calibration (`calibrate`): four terms, each the median over the traced steps of the busiest rank's
busy time, against the cost model's prediction for the current layout with the uncalibrated profile
(`predicted_terms`):

- `comm`: `grad-reduce` (+ colocated `boundary`) spans against the breakdown's `dp_comm`
  (+ `boundary`): every collective and link of the profile (alpha and beta, the in-layer tables,
  the `grad_sync` overhead's intercept) is scaled by measured / predicted;
- `encoder`, `llm`: the module's forward + backward spans against its busiest stage's layer compute,
  in-layer TP/CP communication and work outside the layers (`<kind>_io`, `data`). The in-layer
  communication is priced by the profile at the `comm` factor; the rest of the measured time is
  compute, and the module's layer model (a and b) and its overheads are scaled by it;
- `optimizer`: the `optimizer` spans against the breakdown's optimizer step: the profile's
  `optimizer` overhead is scaled, or (simulated profiles have none) set to the measured time per
  parameter on the rank.

What one layout cannot tell, and how it is handled: how compute and communication inside a layer
split (TP all-reduces, CP ring) and how they would change at another TP or CP degree, how a
layer's time splits into its fixed part `a` and its per-FLOP part `b`, and costs of what the layout
does not run (a boundary where nothing moves, pipeline p2p without pipeline stages). The factors
scale the profile's models as a whole, so the profile keeps its relative TP/CP costs, its a/b split
and its collective shapes; a term the current layout does not exercise (predicted 0) keeps factor
1 (a note says so). What no term explains (pipeline bubbles, waits, per-step overhead outside the
modelled work) is the `residual` factor, measured step / calibrated prediction of the current
layout, which multiplies every prediction: the current layout is predicted at its measured step,
and candidates are compared with it on the same footing.

Decisions (`decide`, `after_switch`): switch when the best candidate's predicted step beats the
measured step by more than `min_gain` (gain = measured / predicted - 1, as `SearchResult.gain`) and
by more than the step noise `spread_s` (slowest - fastest traced step, as `bench planner`'s spread
of rounds); keep a switch unless the new layout measures slower than the old by more than the noise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.layout.yaml_io import dump_layout
from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.cost_terms import data_time, io_allreduce, io_flops, layer_parts
from megatron_hetero.planner.hardware import AlphaBeta, LayerModel, Profile, fit_alpha_beta, ring_factors
from megatron_hetero.planner.search import search
from megatron_hetero.planner.search_space import Ranked, SearchSpace
from megatron_hetero.planner.workload import Candidate, Segment, Workload, check_candidate

#: `--autotune-min-gain`'s default: switch only for a predicted step more than 5% faster
MIN_GAIN = 0.05
#: the degrees `--autotune-fix` may pin
FIX_FIELDS = ("tp", "cp", "pp", "dp", "ep")
#: the keys of one decision in `autotune.json`, in order
RECORD_KEYS = (
    "iteration",
    "from_layout",
    "to_layout",
    "measured_step_s",
    "predicted_step_s",
    "measured_after_s",
    "kept",
)
#: the most candidates `rank_calibrated` asks the search for while filtering by the fixes
MAX_RANKED = 4096
#: the calibration's terms (`Calibration.factors` also holds "residual")
TERMS = ("encoder", "llm", "comm", "optimizer")

Fixes = dict[str, dict[str, int]]


# --- --autotune-fix -----------------------------------------------------------------------------
def parse_fix(text: Optional[str]) -> Fixes:
    """`--autotune-fix` "language.tp=4,vision.dp=8" -> {"language": {"tp": 4}, "vision": {"dp": 8}}.

    Items are MODULE.FIELD=INT, comma-separated, FIELD one of `FIX_FIELDS`, INT >= 1; empty text:
    no fixes. ValueError naming the bad item otherwise (or a field given twice)."""
    fixes: Fixes = {}
    if text is None:
        return fixes
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        key, eq, value = item.partition("=")
        module, dot, fld = key.strip().rpartition(".")
        module, fld = module.strip(), fld.strip()
        if not eq or not dot or not module:
            raise ValueError(f"--autotune-fix {text!r}: {item!r} is not MODULE.FIELD=INT (e.g. language.tp=4)")
        if fld not in FIX_FIELDS:
            raise ValueError(f"--autotune-fix {text!r}: {item!r}: field {fld!r} is not one of {list(FIX_FIELDS)}")
        try:
            n = int(value.strip())
        except ValueError:
            raise ValueError(f"--autotune-fix {text!r}: {item!r}: {value.strip()!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"--autotune-fix {text!r}: {item!r}: {fld} must be >= 1, got {n}")
        if fld in fixes.get(module, {}):
            raise ValueError(f"--autotune-fix {text!r}: {module}.{fld} given twice")
        fixes.setdefault(module, {})[fld] = n
    return fixes


def _segments(c: Candidate, encoder_name: str, llm_name: str) -> dict[str, list[Segment]]:
    """The candidate's segments by the module names a fix may use: the encoder, the language model
    (all its segments) and, for a chain, each segment as `Candidate.to_layout` names it (`language_a`)."""
    out: dict[str, list[Segment]] = {encoder_name: [c.encoder], llm_name: list(c.llm)}
    if len(c.llm) > 1:
        for i, s in enumerate(c.llm):
            out[f"{llm_name}_{chr(ord('a') + i)}"] = [s]
    return out


def _check_names(fixes: Fixes, encoder_name: str, llm_name: str) -> None:
    for name in fixes:
        base = name[: -len("_a")] if len(name) > 2 and name[-2] == "_" and name[-1].isalpha() else name
        if name not in (encoder_name, llm_name) and base != llm_name:
            raise ValueError(
                f"--autotune-fix: unknown module {name!r}; the modules are {encoder_name!r} and {llm_name!r}"
            )


def honours(c: Candidate, fixes: Fixes, encoder_name: str = "vision", llm_name: str = "language") -> bool:
    """Whether candidate `c` has every fixed degree: a fix on the language model holds for each of
    its segments; one on `language_a` only for the chain's first segment (a candidate without
    that segment does not honour it). ValueError for a module name that is neither."""
    _check_names(fixes, encoder_name, llm_name)
    segs = _segments(c, encoder_name, llm_name)
    for name, want in fixes.items():
        if name not in segs:
            return False
        for s in segs[name]:
            if any(getattr(s, k) != v for k, v in want.items()):
                return False
    return True


def space_with_fixes(
    space: SearchSpace, fixes: Fixes, encoder_name: str = "vision", llm_name: str = "language"
) -> SearchSpace:
    """`space` with the degrees the search enumerates (tp, cp, pp per module) pinned to the fixed
    values, so the search itself honours them; dp and ep (derived by the search) and per-segment
    fixes are left to `honours`. ValueError for a fix the space cannot hold (an encoder CP > 1 in
    a runtime space: the runtime's encoders do not take CP)."""
    _check_names(fixes, encoder_name, llm_name)
    changes: dict[str, Any] = {}  # SearchSpace fields -> the one value tried
    for name, want in fixes.items():
        prefix = "encoder_" if name == encoder_name else "" if name == llm_name else None
        if prefix is None:
            continue
        for k in ("tp", "cp", "pp"):
            if k in want:
                changes[prefix + k] = (want[k],)
    if space.runtime and changes.get("encoder_cp", (1,)) != (1,):
        raise ValueError(
            f"--autotune-fix {encoder_name}.cp={changes['encoder_cp'][0]}: the runtime runs encoders with cp 1"
        )
    return dataclasses.replace(space, **changes)


# --- the trace --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimes:
    """What a trace measured, per training step: `wall_s[k]` the step's wall time; `busy[k]`
    {(span kind, module): per-rank busy seconds (self time), in the order of `ranks`} (module '' for
    spans without one: colocated gradient reduction, the optimizer step, waits)."""

    wall_s: tuple[float, ...]
    ranks: tuple[int, ...]
    busy: tuple[dict[tuple[str, str], tuple[float, ...]], ...]

    def drop(self, n: int) -> "StepTimes":
        """Without the first `n` steps (warm-up); keeps at least one step."""
        if n < 0:
            raise ValueError(f"drop: n must be >= 0, got {n}")
        n = min(n, len(self.wall_s) - 1)
        return StepTimes(self.wall_s[n:], self.ranks, self.busy[n:])

    @property
    def step_s(self) -> float:
        """The measured step: the median of the steps' wall times."""
        return float(statistics.median(self.wall_s))

    @property
    def spread_s(self) -> float:
        """The steps' noise: slowest - fastest step (0 with one step)."""
        return float(max(self.wall_s) - min(self.wall_s))

    def kind_time(
        self, step: int, kinds: Union[str, Iterable[str]], module: Optional[str] = None, how: str = "max"
    ) -> float:
        """Busy seconds of span kind(s) `kinds` (of `module`, or of every module) in step `step`,
        summed per rank, then the max (`how='max'`) or the mean over ranks."""
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        per_rank = np.zeros(len(self.ranks))
        for (k, m), times in self.busy[step].items():
            if k in kinds and (module is None or m == module):
                per_rank += np.asarray(times)
        if how == "max":
            return float(per_rank.max(initial=0.0))
        if how == "mean":
            return float(per_rank.mean()) if len(per_rank) else 0.0
        raise ValueError(f"how must be 'max' or 'mean', got {how!r}")

    def totals(self, how: str = "max") -> list[dict[str, dict[str, float]]]:
        """Per step: {span kind: {module: busy seconds, max (or mean) over ranks}}."""
        out = []
        for k, busy in enumerate(self.busy):
            step: dict[str, dict[str, float]] = {}
            for kind, module in busy:
                step.setdefault(kind, {})[module] = self.kind_time(k, kind, module, how)
            out.append(step)
        return out


def _self_times(spans: list[tuple[float, float, str, str]]) -> list[float]:
    """Self time of each (start, end, kind, module) span of one rank: its duration less the
    durations of the spans directly nested in it (same rank, fully inside)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    own = [s[1] - s[0] for s in spans]
    stack: list[int] = []
    eps = 1e-9
    for i in order:
        t0, t1 = spans[i][0], spans[i][1]
        while stack and spans[stack[-1]][1] <= t0 + eps:
            stack.pop()
        if stack and t1 <= spans[stack[-1]][1] + eps:
            own[stack[-1]] -= t1 - t0
        stack.append(i)
    return [max(x, 0.0) for x in own]


def step_times_from_trace(doc: Mapping[str, Any]) -> StepTimes:
    """The steps of a trace document (`runtime.trace.chrome_trace` / `gather_trace`): per step, its
    wall time and every rank's busy time per (span kind, module) (see the module docstring).
    ValueError for a document that is not a trace, or with a rank without optimizer spans or with a
    number of them other ranks do not have."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("not a trace document: expected a JSON object with a 'traceEvents' list")
    per_rank: dict[int, list[tuple[float, float, str, str]]] = {}
    for e in doc["traceEvents"]:
        if not isinstance(e, Mapping) or e.get("ph") != "X":
            continue
        try:
            t0, dur, rank = float(e["ts"]) / 1e6, float(e["dur"]) / 1e6, int(e["pid"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"trace event without numeric ts/dur/pid: {dict(e)!r}") from None
        module = e.get("args", {}).get("module", "") if isinstance(e.get("args"), Mapping) else ""
        per_rank.setdefault(rank, []).append((t0, t0 + dur, str(e.get("cat", "")), str(module)))
    if not per_rank:
        raise ValueError("the trace has no spans (was the tracer on?)")
    ranks = tuple(sorted(per_rank))
    ends: dict[int, list[float]] = {r: sorted(s[1] for s in per_rank[r] if s[2] == "optimizer") for r in ranks}
    counts = {r: len(v) for r, v in ends.items()}
    if min(counts.values()) == 0 or len(set(counts.values())) != 1:
        raise ValueError(
            f"every rank must close each traced training step with one optimizer span; optimizer spans per rank: {counts}"
        )
    n = counts[ranks[0]]
    start = min(s[0] for r in ranks for s in per_rank[r])
    closes = [max(ends[r][k] for r in ranks) for k in range(n)]
    wall = tuple(closes[k] - (closes[k - 1] if k else start) for k in range(n))
    busy: list[dict[tuple[str, str], list[float]]] = [{} for _ in range(n)]
    for j, r in enumerate(ranks):
        spans = per_rank[r]
        for (t0, _t1, kind, module), own in zip(spans, _self_times(spans)):
            k = int(np.searchsorted(np.asarray(ends[r]), t0, side="left"))
            if k >= n:
                continue  # after the last traced step
            times = busy[k].setdefault((kind, module), [0.0] * len(ranks))
            times[j] += own
    return StepTimes(wall, ranks, tuple({key: tuple(v) for key, v in b.items()} for b in busy))


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


def predicted_terms(c: Candidate, wl: Workload, prof: Profile) -> dict[str, Any]:
    """The cost model's prediction, per step, of what the trace measures for candidate `c`:
    'encoder' and 'llm' (`ModuleTerms` of the busiest stage: its layers, the run's `<kind>_io` and
    `data`, over the step's runs), and from the breakdown (`cost.evaluate`) 'dp' (gradient and loss
    all-reduces), 'boundary', 'optimizer' (optimizer step and state snapshots) and 'total'."""
    b = check_candidate(c, wl)
    bd = evaluate(c, wl, prof)
    e, G, k, m = c.encoder, wl.global_batch, wl.images_per_sample, wl.micro_batch
    ceil = lambda a, p: -(-a // p)  # noqa: E731
    if c.placement == "disjoint":
        M = m * max(s.dp for s in c.llm)
        enc = _stage_work(prof, wl, wl.encoder, e.tp, e.cp, 1, ceil(e.layers, e.pp), M * k / e.dp, b, True)
        segs = [_stage_work(prof, wl, wl.llm, s.tp, s.cp, s.ep, ceil(s.layers, s.pp), M / s.dp, b, True) for s in c.llm]
        llm = max(segs, key=lambda t: t.total)
    else:
        s = c.llm[0]
        if c.placement == "homogeneous":
            enc = _stage_work(prof, wl, wl.encoder, s.tp, s.cp, 1, e.layers, m * k, b, False)
            rest = ceil(s.layers - c.first_stage_layers, s.pp - 1) if s.pp > 1 else 0
            layers = max(c.first_stage_layers, rest) if s.pp > 1 else s.layers
        else:
            enc = _stage_work(prof, wl, wl.encoder, e.tp, e.cp, 1, ceil(e.layers, e.pp), G * k / e.dp, 1, True)
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
    """alpha + x * beta through `points` (x, y): least squares with two distinct x or more, else
    `base` scaled to the (mean) point: one size cannot split alpha from beta, so keep base's shape."""
    ys = [max(y, 0.0) for _, y in points]
    if len({x for x, _ in points}) >= 2:
        a, b = fit_alpha_beta([x for x, _ in points], ys)
        return AlphaBeta(alpha=a, beta=b)
    x, y = points[0][0], sum(ys) / len(ys)
    now = base.alpha + x * base.beta
    s = y / now if now > 0 else 0.0
    return AlphaBeta(alpha=base.alpha * s, beta=base.beta * s) if now > 0 else AlphaBeta(alpha=0.0, beta=y / x)


def fold_layer_measurements(prof: Profile, wl: Workload, module: str, cases: Sequence[LayerCase]) -> Profile:
    """`prof` with what in-process layer measurements of `module` ('encoder' or 'llm') tell:

    - TP1·CP1 cases refit the module kind's layer model t = a + b * FLOPs (least squares with two
      distinct sizes or more; one size scales the model, keeping its a/b split);
    - TP>1 cases set the in-layer all-reduce over tp ranks (`Profile.layer_collectives`): per call,
      (measured - the layer model's compute at that tp) / the layer's TP collectives (4; 6 with full
      recompute), fitted per group size against bytes (one size scales the profile's curve there);
    - CP>1 cases (modules that shard their sequence) likewise the ring's all-gather, adding back the
      attention compute the cost model overlaps with it.

    Fold before `calibrate`, onto the profile the run is calibrated from. ValueError for an unknown
    module, no cases, or CP cases of a module that does not shard its sequence."""
    if module not in ("encoder", "llm"):
        raise ValueError(f"module must be 'encoder' or 'llm', got {module!r}")
    if not cases:
        raise ValueError("fold_layer_measurements: no layer cases")
    spec = wl.encoder if module == "encoder" else wl.llm
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
) -> list[tuple[Candidate, float]]:
    """The best candidates at the run's speed under its constraints: `search` on the calibrated
    profile with the fixed tp/cp/pp in its space (`space_with_fixes`), then the rest of the fixes
    (`honours`); [(candidate, predicted step seconds)], fastest first. The search's ValueError when
    nothing fits."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    fixes = fixes or {}
    sp = space_with_fixes(space, fixes, encoder_name, llm_name)
    k = top
    while True:  # the fixes the space cannot hold filter the ranking: widen it until `top` honour them
        res = search(wl, calib.profile, world_size, memory_limit=memory_limit, space=sp, top=k)
        out = [
            (r.candidate, r.breakdown.total * calib.factors["residual"])
            for r in res.ranked
            if honours(r.candidate, fixes, encoder_name, llm_name)
        ]
        if len(out) >= top or len(res.ranked) < k or k >= MAX_RANKED:
            return out[:top]
        k = min(4 * k, MAX_RANKED)


# --- decisions ----------------------------------------------------------------------------------
def same_layout(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates run the same layout (a homogeneous candidate runs as the colocated one
    with equal layouts)."""
    kind = lambda c: "colocated" if c.placement == "homogeneous" else c.placement  # noqa: E731
    key = lambda c: (kind(c), c.encoder.par, c.encoder.layers, tuple((s.par, s.layers) for s in c.llm), c.offload)  # noqa: E731
    return key(a) == key(b)


@dataclass(frozen=True)
class Decision:
    """`switch` to `target` (predicted `predicted_step_s`) or stay; `reason` is the one log line."""

    switch: bool
    reason: str
    target: Optional[Candidate] = None
    predicted_step_s: Optional[float] = None
    gain: Optional[float] = None


def _positive(name: str, v: float) -> float:
    v = float(v)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {v}")
    return v


def _spread(v: float) -> float:
    v = float(v)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"spread_s must be >= 0 seconds, got {v}")
    return v


def decide(
    measured_step_s: float,
    spread_s: float,
    current: Candidate,
    ranked_candidates: Sequence[Union[tuple[Candidate, float], Ranked]],
    min_gain: float = MIN_GAIN,
) -> Decision:
    """Switch or stay. Switch to the fastest predicted candidate when it is not the current layout,
    its gain measured / predicted - 1 exceeds `min_gain`, and the step it saves exceeds the noise
    `spread_s`; otherwise stay, saying why. `ranked_candidates`: (candidate, predicted seconds) pairs
    or `Ranked` (breakdown.total), in any order."""
    m, spread = _positive("measured_step_s", measured_step_s), _spread(spread_s)
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    pairs = [
        (r.candidate, r.breakdown.total) if isinstance(r, Ranked) else (r[0], float(r[1])) for r in ranked_candidates
    ]
    if not pairs:
        return Decision(False, "stay: no candidate layout fits the run's constraints")
    best, p = min(pairs, key=lambda cp: cp[1])
    _positive("a candidate's predicted step", p)
    gain = m / p - 1.0
    where = f"best {best.describe()} predicted {p:.4g} s vs measured {m:.4g} s ({gain:+.1%})"
    if same_layout(best, current):
        return Decision(False, f"stay: the current layout is already the best predicted ({where})", best, p, gain)
    if gain <= min_gain:
        return Decision(False, f"stay: {where}, not more than --autotune-min-gain {min_gain:.0%}", best, p, gain)
    if m - p <= spread:
        return Decision(
            False, f"stay: {where}, saving {m - p:.4g} s is within the step noise {spread:.4g} s", best, p, gain
        )
    return Decision(
        True,
        f"switch: {where}, over --autotune-min-gain {min_gain:.0%} and the step noise {spread:.4g} s",
        best,
        p,
        gain,
    )


def after_switch(measured_before_s: float, measured_after_s: float, spread_s: float) -> bool:
    """Whether to keep a switch: False (revert) when the new layout's measured step is slower than
    the old one's by more than the noise `spread_s`."""
    before, after = _positive("measured_before_s", measured_before_s), _positive("measured_after_s", measured_after_s)
    return after <= before + _spread(spread_s)


# --- autotune.json ------------------------------------------------------------------------------
@dataclass(frozen=True)
class AutotuneRecord:
    """One decision of `autotune.json` (`RECORD_KEYS`). A stay has to_layout = from_layout,
    measured_after_s None and kept True; a switch gets measured_after_s and kept from `settle`;
    `kept` says whether training goes on on `to_layout` (False: reverted to from_layout)."""

    iteration: int
    from_layout: Any
    to_layout: Any
    measured_step_s: float
    predicted_step_s: Optional[float]
    measured_after_s: Optional[float] = None
    kept: bool = True

    def settle(self, measured_after_s: float, spread_s: float) -> "AutotuneRecord":
        """This switch once the new layout is measured: `kept` = `after_switch(measured_step_s,
        measured_after_s, spread_s)`."""
        kept = after_switch(self.measured_step_s, measured_after_s, spread_s)
        return dataclasses.replace(self, measured_after_s=float(measured_after_s), kept=kept)

    def line(self) -> str:
        """The outcome as one log line."""
        head = f"autotune at iteration {self.iteration}: "
        if self.from_layout == self.to_layout:
            return head + f"stayed on {self.from_layout} (measured {self.measured_step_s:.4g} s)"
        text = f"{self.from_layout} -> {self.to_layout}: measured {self.measured_step_s:.4g} s, predicted "
        text += f"{self.predicted_step_s:.4g} s" if self.predicted_step_s is not None else "n/a"
        if self.measured_after_s is None:
            return head + text + ", not measured yet"
        return head + text + f", measured after {self.measured_after_s:.4g} s: " + ("kept" if self.kept else "reverted")

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RECORD_KEYS}


def record_of(iteration: int, current: Candidate, decision: Decision, measured_step_s: float) -> AutotuneRecord:
    """The record of `decision` taken at `iteration` with the current layout measured at
    `measured_step_s` (a switch: `settle` it once the new layout is measured). Layouts are named by
    `Candidate.describe()`."""
    to = decision.target if decision.switch and decision.target is not None else current
    return AutotuneRecord(
        iteration=int(iteration),
        from_layout=current.describe(),
        to_layout=to.describe(),
        measured_step_s=_positive("measured_step_s", measured_step_s),
        predicted_step_s=decision.predicted_step_s,
    )


def autotune_document(records: Sequence[AutotuneRecord]) -> dict[str, Any]:
    """The `autotune.json` object: {"decisions": [{RECORD_KEYS...}, ...]}."""
    return {"decisions": [r.to_dict() for r in records]}


def write_autotune(
    out_dir: Union[str, Path], records: Sequence[AutotuneRecord], chosen_layout: Optional[HeteroLayout] = None
) -> dict[str, Path]:
    """Write `autotune.json` and, given the layout training goes on with, `autotune-layout.yaml`
    (the layout file's own writer, `layout.yaml_io.dump_layout`) under `out_dir`; returns their
    paths ('json', 'layout')."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "autotune.json"}
    paths["json"].write_text(json.dumps(autotune_document(records), indent=2) + "\n")
    if chosen_layout is not None:
        paths["layout"] = out / "autotune-layout.yaml"
        paths["layout"].write_text(dump_layout(chosen_layout))
    return paths


__all__ = [
    "FIX_FIELDS",
    "MIN_GAIN",
    "LayerCase",
    "fold_layer_measurements",
    "RECORD_KEYS",
    "TERMS",
    "AutotuneRecord",
    "Calibration",
    "Decision",
    "ModuleTerms",
    "StepTimes",
    "after_switch",
    "autotune_document",
    "calibrate",
    "decide",
    "honours",
    "parse_fix",
    "predicted_terms",
    "rank_calibrated",
    "record_of",
    "same_layout",
    "scale_profile",
    "space_with_fixes",
    "step_times_from_trace",
    "write_autotune",
]
