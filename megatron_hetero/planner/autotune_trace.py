"""A run's own trace -> its step times and per-module busy times (`step_times_from_trace`,
`StepTimes`). Pure; part of `planner.autotune`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

import numpy as np


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
        """The steps' range: slowest - fastest step (0 with one step)."""
        return float(max(self.wall_s) - min(self.wall_s))

    @property
    def noise_s(self) -> float:
        """The noise of the measured step (`step_s`, a median): its standard error, 1.2533 sigma /
        sqrt(n) with sigma estimated robustly as 1.4826 x the median absolute deviation; with fewer
        than 3 steps, the range (`spread_s`). A comparison of two medians is within the noise when
        their difference is below it."""
        n = len(self.wall_s)
        if n < 3:
            return self.spread_s
        med = statistics.median(self.wall_s)
        mad = statistics.median(abs(t - med) for t in self.wall_s)
        return float(1.2533 * 1.4826 * mad / math.sqrt(n))

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
