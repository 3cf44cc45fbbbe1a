"""From stages to a step: `Side` aggregates a pipeline's stages (sums, the bottleneck, the slowest
once-per-step tail, the ranks' busy time), `peak_memory` the per-rank memory peak, and `finish` the
breakdown arrays of a step's critical path. Pure (numpy only); formulas in `planner/cost.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.cost_terms import (
    loss_reduce,
    sharing_scale,
)
from megatron_hetero.planner.stages import _PARTS, Stages


@dataclass
class Side:
    """Aggregates of a pipeline's stages (or of one side: a disjoint encoder island, an LLM chain)
    for `b` runs per step: sum and max of the stage costs, the bottleneck's components, the stage
    with the longest once-per-step tail, and the busy time of all its ranks."""

    sum: np.ndarray
    max: np.ndarray
    parts: dict  # the bottleneck stage's per-run components
    tail: np.ndarray
    tail_dp: np.ndarray
    tail_opt: np.ndarray
    busy: dict  # sum over stages of count * ranks * runs * part, and of count * ranks * dp / opt
    work: np.ndarray  # sum of `busy`

    @classmethod
    def of(cls, st: Stages) -> "Side":
        valid = st.count > 0
        rows = np.arange(st.count.shape[0])
        cost = st.cost
        top = np.argmax(np.where(valid, cost, -np.inf), axis=1)  # the first of equal maxima, as stage order
        tail = st.dp + st.opt
        tt = np.argmax(np.where(valid, tail, -np.inf), axis=1)
        w = st.count * st.ranks
        busy = {k: (w * st.runs * getattr(st, k)).sum(axis=1) for k in _PARTS}
        busy["dp"], busy["opt"] = (w * st.dp).sum(axis=1), (w * st.opt).sum(axis=1)
        return cls(
            sum=(st.count * cost).sum(axis=1),
            max=cost[rows, top],
            parts={k: getattr(st, k)[rows, top] for k in _PARTS},
            tail=tail[rows, tt],
            tail_dp=st.dp[rows, tt],
            tail_opt=st.opt[rows, tt],
            busy=busy,
            work=sum(busy.values()),
        )

    @staticmethod
    def parallel(sides: list) -> "Side":
        """Sides that run side by side and join at the next stage (disjoint encoder islands): the
        longest fill (max of the sums), the bottleneck of all (its parts: the side holding it, the
        first on ties), the longest tail, the busy time of all their ranks."""
        if len(sides) == 1:
            return sides[0]
        mx = np.stack([s.max for s in sides])
        top = np.argmax(mx, axis=0)
        tails = np.stack([s.tail for s in sides])
        tt = np.argmax(tails, axis=0)

        def pick(arrays, which):
            return np.choose(which, arrays)

        busy = {k: sum(s.busy[k] for s in sides) for k in sides[0].busy}
        return Side(
            sum=np.max(np.stack([s.sum for s in sides]), axis=0),
            max=pick([s.max for s in sides], top),
            parts={k: pick([s.parts[k] for s in sides], top) for k in sides[0].parts},
            tail=pick([s.tail for s in sides], tt),
            tail_dp=pick([s.tail_dp for s in sides], tt),
            tail_opt=pick([s.tail_opt for s in sides], tt),
            busy=busy,
            work=sum(s.work for s in sides),
        )

    def rows(self, idx, full: bool = True) -> "Side":
        """Rows `idx`; without `full`, only what the step time needs (no breakdown parts)."""
        pick = (lambda d: {k: v[idx] for k, v in d.items()}) if full else (lambda d: {})
        return Side(
            sum=self.sum[idx],
            max=self.max[idx],
            parts=pick(self.parts),
            tail=self.tail[idx],
            tail_dp=self.tail_dp[idx],
            tail_opt=self.tail_opt[idx],
            busy=pick(self.busy),
            work=self.work[idx],
        )


def peak_memory(st: Stages, n, b) -> np.ndarray:
    """Largest per-rank bytes of any stage: state + activations of min(n - i, b) in-flight runs."""
    flight = np.minimum(np.asarray(n)[..., None] - st.first, np.asarray(b)[..., None])
    return np.where(st.count > 0, st.state + st.act * flight, -np.inf).max(axis=1)


def _valid_max(st: Stages, x) -> np.ndarray:
    return np.where(st.count > 0, x, -np.inf).max(axis=1)


def finish(
    prof: Profile,
    world,
    b,
    pipe,
    parts: dict,
    tail_dp,
    tail_opt,
    busy: dict,
    step_boundary,
    offload,
    memory,
    phase: Optional[tuple] = None,
) -> dict:
    """The breakdown arrays (`CostBreakdown` fields) of a critical path: the pipeline time `pipe`
    (bottleneck components `parts`, the rest is bubble), the slowest once-per-step tail, the loss
    all-reduce and the whole-step terms; on a profile whose ranks share execution units, the step
    is `shared_step` of it and the parts are the mean rank's busy time (`busy` / world) at the
    step's sharing (`sharing_scale`).

    `phase` = (critical, busy): a part of `pipe` that runs alone, with no other work of the step
    beside it (the colocated encoder passes: every rank waits at the boundary for them), and the
    ranks' busy time in it (the `_PARTS` of `busy` it holds). On shared units it is priced as its
    own step, at the number of ranks it keeps runnable, and the rest of the step after it: a
    pipelined encoder's stages, one rank at a time, cannot use the units the language model's
    phase would fill."""
    loss = loss_reduce(prof, world)
    dp = tail_dp + loss
    crit = pipe + dp + tail_opt + step_boundary + offload
    out = {"memory_per_rank_peak": memory, "micro_batches": b, "offload": np.broadcast_to(offload, np.shape(crit))}
    if not prof.shared:
        out.update(
            compute=parts["compute"],
            tp_comm=parts["tp"],
            cp_comm=parts["cp"],
            pp_comm=parts["pp"],
            dp_comm=dp,
            boundary=parts["boundary"] + step_boundary,
            optimizer=tail_opt,
            bubble=pipe - sum(parts.values()),
            total=crit,
        )
        return out
    # the mean rank's busy time per part (and the whole-step terms), at the profile's sharing
    rest = {k: busy[k] / world for k in (*_PARTS, "dp", "opt")}
    rest.update(loss=loss, step_boundary=step_boundary, offload=offload)
    phases = []
    if phase is not None:  # priced alone, then the rest of the step after it
        crit_p, busy_p = phase
        own = {k: busy_p[k] / world for k in _PARTS}
        rest = {k: v - own.get(k, 0.0) for k, v in rest.items()}
        phases.append((own, crit_p))
        crit = crit - crit_p
    phases.append((rest, crit))
    total, mean = 0.0, {k: 0.0 for k in rest}
    for part_busy, part_crit in phases:
        work = sum(part_busy.values())
        scale = sharing_scale(prof, work, part_crit)  # busy times at the phase's sharing (fewer runnable: less)
        total = total + np.maximum(work * scale, part_crit * prof.uncontended)  # `shared_step` of the phase
        mean = {k: v + part_busy.get(k, 0.0) * scale for k, v in mean.items()}
    out.update(
        compute=mean["compute"],
        tp_comm=mean["tp"],
        cp_comm=mean["cp"],
        pp_comm=mean["pp"],
        dp_comm=mean["dp"] + mean["loss"],
        boundary=mean["boundary"] + mean["step_boundary"],
        optimizer=mean["opt"],
        offload=np.broadcast_to(mean["offload"], np.shape(total)),
        bubble=total - sum(mean.values()),
        total=total,
    )
    return out


def _scaled(parts: dict, k) -> dict:
    return {name: v * k for name, v in parts.items()}
