"""The pure core of `train --hetero-autotune`: read a run's own trace, fit the cost model to it, search
under the run's constraints, decide whether to switch layout and whether to keep the switch, and
record the decisions. Pure (numpy only; no torch.distributed): the trainer measures, this decides.
The parts live in `autotune_fix` (--autotune-fix), `autotune_trace` (the trace's step times) and
`autotune_calibrate` (calibration and the constrained search); this module holds the decisions and
`autotune.json`, and re-exports the rest, so a caller imports `planner.autotune` alone.

The trainer's order (one autotune round; only rank 0 needs to decide, and then tells the others):

1. train `--autotune-steps` K steps with a fresh recording tracer; `gather_trace` gives rank 0 the
   document (`runtime/trace.py`);
2. `steps = step_times_from_trace(doc).drop(1)`: the wall time of each step and every rank's busy
   time per (span kind, module); the first step (warm-up) is dropped;
3. optionally, `profile = fold_layer_measurements(profile, workload, "llm", [LayerCase(...)])` with
   layers measured in-process at other TP/CP degrees (what the current layout cannot tell);
4. `calib = calibrate(steps, current, workload, profile)`: the profile at the run's own speed;
5. `ranked = rank_calibrated(calib, workload, world, parse_fix(...), memory_limit=...)`;
6. `d = decide(steps.step_s, steps.noise_s, current, ranked, min_gain)`; log `d.reason`;
   `rec = record_of(iteration, current, d, steps.step_s)`;
7. on `d.switch`: checkpoint, rebuild under `d.target.to_layout()`, resume, trace K more steps
   (steps 1-2); `rec = rec.settle(after.step_s, hypot(steps.noise_s, after.noise_s))`, log
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
by more than the step noise `spread_s` (the trainer passes `StepTimes.noise_s`, the standard error
of the measured median step; `StepTimes.spread_s`, slowest - fastest step, is the cautious
alternative); keep a switch only when the new layout measures faster than the old (its median step).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.layout.yaml_io import dump_layout
from megatron_hetero.planner.search_space import Ranked
from megatron_hetero.planner.workload import Candidate
from megatron_hetero.planner.autotune_calibrate import (  # noqa: F401 (re-exported: the trainer's one import)
    MAX_RANKED,
    TERMS,
    Calibration,
    LayerCase,
    ModuleTerms,
    calibrate,
    fold_layer_measurements,
    predicted_terms,
    rank_calibrated,
    scale_profile,
)
from megatron_hetero.config.autotune import MIN_GAIN
from megatron_hetero.planner.autotune_fix import honours, space_with_fixes  # noqa: F401
from megatron_hetero.planner.autotune_trace import StepTimes, step_times_from_trace  # noqa: F401

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


# --- decisions ----------------------------------------------------------------------------------
def same_layout(a: Candidate, b: Candidate) -> bool:
    """Whether two candidates run the same layout (a homogeneous candidate runs as the colocated one
    with equal layouts)."""
    kind = lambda c: "colocated" if c.placement == "homogeneous" else c.placement  # noqa: E731
    key = lambda c: (  # noqa: E731
        kind(c),
        tuple((e.par, e.layers) for e in c.encoders),
        tuple((s.par, s.layers) for s in c.llm),
        c.offload,
    )
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


def after_switch(measured_before_s: float, measured_after_s: float, noise_s: float = 0.0) -> bool:
    """Whether to keep a switch: only when the new layout's measured step is faster than the old
    one's by more than `noise_s` (the noise of the two medians' difference: the root of the sum of
    their squared noises). A layout that measures the same, within the noise, or slower is gone back
    from: the switch was taken for a gain the model predicted, and a layout the noise cannot tell
    from the old one has not shown it; the run then tries the next layout it has rounds for (bench
    autotune on 2026-12-06 kept encoder TP2·PP2 at 273 ms against 274 ms, noise 6 ms, and never
    tried PP2·DP2, which e2e measures 1.2x faster)."""
    before, after = _positive("measured_before_s", measured_before_s), _positive("measured_after_s", measured_after_s)
    if not (math.isfinite(noise_s) and noise_s >= 0):
        raise ValueError(f"noise_s must be a finite number >= 0, got {noise_s}")
    return after < before - noise_s


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

    def settle(self, measured_after_s: float, noise_s: float = 0.0) -> "AutotuneRecord":
        """This switch once the new layout is measured: `kept` = `after_switch(measured_step_s,
        measured_after_s, noise_s)`."""
        kept = after_switch(self.measured_step_s, measured_after_s, noise_s)
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


def autotune_document(
    records: Sequence[AutotuneRecord], calibration: Optional[Sequence[dict[str, Any]]] = None
) -> dict[str, Any]:
    """The `autotune.json` object: {"decisions": [{RECORD_KEYS...}, ...]} and, given, "calibration":
    one entry per decision (the factors, the measured step and its noise, and after a switch the
    chosen layout's predicted against measured step)."""
    doc: dict[str, Any] = {"decisions": [r.to_dict() for r in records]}
    if calibration is not None:
        doc["calibration"] = list(calibration)
    return doc


def write_autotune(
    out_dir: Union[str, Path],
    records: Sequence[AutotuneRecord],
    chosen_layout: Optional[HeteroLayout] = None,
    calibration: Optional[Sequence[dict[str, Any]]] = None,
) -> dict[str, Path]:
    """Write `autotune.json` (`autotune_document`) and, given the layout training goes on with,
    `autotune-layout.yaml` (the layout file's own writer, `layout.yaml_io.dump_layout`) under
    `out_dir`; returns their paths ('json', 'layout')."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "autotune.json"}
    paths["json"].write_text(json.dumps(autotune_document(records, calibration), indent=2) + "\n")
    if chosen_layout is not None:
        paths["layout"] = out / "autotune-layout.yaml"
        paths["layout"].write_text(dump_layout(chosen_layout))
    return paths


__all__ = [
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
    "predicted_terms",
    "rank_calibrated",
    "record_of",
    "same_layout",
    "scale_profile",
    "space_with_fixes",
    "step_times_from_trace",
    "write_autotune",
]
