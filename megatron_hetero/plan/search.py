"""Configuration search. Pure (numpy only).

(a) `heteropipe_search`: one model of L layers cut into S pipeline stages; each stage gets a
contiguous layer range and a strategy (TP/DP[/CP], hence a device count); minimise
    sum_k c_k + (B-1) * max_k c_k            (1F1B with B micro-batches)
Exact: for every candidate bottleneck threshold T (the distinct finite stage costs, ascending), a
dynamic program over (stages, layers covered, devices used) gives g(T) = the least sum of stage
costs with every stage <= T; the answer is the plan behind min_T g(T) + (B-1)*T. (The optimum's own
max M* is a threshold and g(M*) <= its sum, and a plan found at T has max <= T, so this is exact.)
The scan starts at the least feasible threshold (bisection: feasibility is monotone in T), runs
all thresholds of a chunk at once in numpy, and stops once g(inf) + (B-1)*T reaches the best value
found (a lower bound for every larger T).

(b) `search`: the multimodal space (see `SearchSpace`): homogeneous (encoder on the LLM's layout in
pipeline stage 0; the LLM layers of stage 0 chosen optimally), colocated heterogeneous (three-phase,
with or without encoder offload) and disjoint islands (encoder island size, encoder layout, LLM as
one segment or two segments with their own TP/DP and a layer split). Every candidate's step time
is computed in closed form on numpy arrays with the primitives of `plan/cost.py`; results are
cross-checked against the scalar `cost.evaluate` for the reported candidates.
Disjoint candidates pair an encoder configuration e with an LLM chain c; with
K(c) = C_sum + (B-1) C_max + C_dp, total(e, c) >= E_sum + K(c) (a lower bound), so after a probe
gives tau (the K-th best exact value seen), only pairs with E_sum + K(c) <= tau are evaluated:
the returned top-K equals the top-K of exhaustive evaluation (`prune=False` evaluates every pair).
`SearchSpace(runtime=True)` keeps only layouts `megatron-hetero train` runs (the `search --out` CLI
default). A measured profile's extra terms (`Profile.overheads`, shared execution units) exist in
the scalar `cost.evaluate` only, so with such a profile every candidate is scored one by one
(`brute_force`; measured profiles describe the machine at hand, whose spaces are small).
"""
from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from megatron_hetero.plan import cost as C
from megatron_hetero.plan.cost import (Candidate, CostBreakdown, ModelSpec, Profile, Segment, Workload,
                                       act_bytes, colocated_boundary, disjoint_boundary, dp_time, evaluate,
                                       layer_parts, loss_reduce, p2p_time, state_bytes)
from megatron_hetero.plan.schedule import MAX_MICRO_BATCHES  # the disjoint schedule's stage tables

INF = float("inf")


# =============================================================================================
# (a) heteropipe: layer partition x per-stage strategy, exact DP over bottleneck thresholds
# =============================================================================================
@dataclass(frozen=True)
class Strategy:
    """A stage's parallel strategy; it occupies tp*cp*dp devices."""

    tp: int = 1
    dp: int = 1
    cp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}·" + (f"CP{self.cp}·" if self.cp > 1 else "") + f"DP{self.dp}"


@dataclass(frozen=True)
class StagePlan:
    start: int  # first layer
    end: int  # one past the last layer
    strategy: Strategy
    cost: float


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple
    num_microbatches: int

    @property
    def sum_cost(self) -> float:
        return float(sum(s.cost for s in self.stages))

    @property
    def max_cost(self) -> float:
        return float(max(s.cost for s in self.stages))

    @property
    def objective(self) -> float:
        """sum(stage costs) + (B-1) * max(stage cost)."""
        return self.sum_cost + (self.num_microbatches - 1) * self.max_cost

    def describe(self) -> str:
        return " | ".join(f"layers {s.start}-{s.end - 1} {s.strategy}" for s in self.stages)


StageCost = Callable[[int, int, Strategy, int], float]


def stage_cost_table(num_layers: int, num_stages: int, strategies: Sequence[Strategy], stage_cost: StageCost) -> np.ndarray:
    """C[k, i, j, s] = stage_cost(i, j, strategies[s], k) for layers [i, j), inf where j <= i."""
    L = num_layers
    table = np.full((num_stages, L + 1, L + 1, len(strategies)), INF)
    for k in range(num_stages):
        for i in range(L):
            for j in range(i + 1, L + 1):
                for s, strat in enumerate(strategies):
                    table[k, i, j, s] = float(stage_cost(i, j, strat, k))
    table[np.isnan(table)] = INF
    return table


def _check_pipeline_args(num_layers, num_devices, num_stages, strategies, num_microbatches):
    for name, v in (("num_layers", num_layers), ("num_devices", num_devices), ("num_stages", num_stages),
                    ("num_microbatches", num_microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages need at least {num_stages} layers, got {num_layers}")
    if not strategies:
        raise ValueError("at least one strategy is needed")


def _units(strategies, num_devices):
    g = math.gcd(*(s.devices for s in strategies))
    return [s.devices // g for s in strategies], num_devices // g, g


def _dp_values(table, dev, D, thresholds, use_all):
    """g(T) for every T in `thresholds`: least sum of stage costs with every stage <= T."""
    S, L1, _, nS = table.shape
    nT = len(thresholds)
    T = np.asarray(thresholds, dtype=float)[:, None, None]
    f = np.full((nT, L1, D + 1), INF)
    f[:, 0, 0] = 0.0
    for k in range(S):
        g = np.full_like(f, INF)
        for s in range(nS):
            ds = dev[s]
            if ds > D:
                continue
            ck = table[k, :, :, s][None]
            cm = np.where(ck <= T, ck, INF)  # (nT, i, j)
            cand = np.min(f[:, :, None, :D + 1 - ds] + cm[:, :, :, None], axis=1)  # (nT, j, d)
            np.minimum(g[:, :, ds:], cand, out=g[:, :, ds:])
        f = g
    return f[:, L1 - 1, D] if use_all else f[:, L1 - 1, :].min(axis=1)


def _plan_at(table, dev, D, threshold, use_all, strategies, b) -> Optional[PipelinePlan]:
    """The least-sum plan with every stage <= threshold (backtracked), or None."""
    S, L1, _, nS = table.shape
    f = np.full((S + 1, L1, D + 1), INF)
    f[0, 0, 0] = 0.0
    par_i = np.full((S + 1, L1, D + 1), -1)
    par_s = np.full((S + 1, L1, D + 1), -1)
    for k in range(S):
        for s in range(nS):
            ds = dev[s]
            if ds > D:
                continue
            ck = table[k, :, :, s]
            cm = np.where(ck <= threshold, ck, INF)
            tot = f[k][:, None, :D + 1 - ds] + cm[:, :, None]  # (i, j, d)
            bi = np.argmin(tot, axis=0)
            val = np.take_along_axis(tot, bi[None], axis=0)[0]
            cur = f[k + 1][:, ds:]
            upd = val < cur
            f[k + 1][:, ds:] = np.where(upd, val, cur)
            par_i[k + 1][:, ds:] = np.where(upd, bi, par_i[k + 1][:, ds:])
            par_s[k + 1][:, ds:] = np.where(upd, s, par_s[k + 1][:, ds:])
    d = D if use_all else int(np.argmin(f[S, L1 - 1]))
    if not np.isfinite(f[S, L1 - 1, d]):
        return None
    stages, j = [], L1 - 1
    for k in range(S, 0, -1):
        i, s = int(par_i[k, j, d]), int(par_s[k, j, d])
        stages.append(StagePlan(i, j, strategies[s], float(table[k - 1, i, j, s])))
        j, d = i, d - dev[s]
    return PipelinePlan(stages=tuple(reversed(stages)), num_microbatches=b)


def heteropipe_search(num_layers: int, num_devices: int, num_stages: int, strategies: Sequence[Strategy],
                      stage_cost: StageCost, num_microbatches: int, use_all_devices: bool = True,
                      table: Optional[np.ndarray] = None) -> PipelinePlan:
    """Exact minimum of sum + (B-1)*max over layer partitions and per-stage strategies.

    stage_cost(start, end, strategy, stage_index) -> seconds per micro-batch (inf: infeasible, e.g.
    out of memory). Stages use exactly `num_devices` devices in total (or at most, with
    use_all_devices=False). Raises ValueError if no plan is feasible.
    """
    _check_pipeline_args(num_layers, num_devices, num_stages, strategies, num_microbatches)
    if table is None:
        table = stage_cost_table(num_layers, num_stages, strategies, stage_cost)
    dev, D, g = _units(strategies, num_devices)
    b = num_microbatches
    finite = table[np.isfinite(table)]
    if (use_all_devices and num_devices % g) or finite.size == 0:
        raise ValueError(f"no feasible pipeline: {num_stages} stages of {[str(s) for s in strategies]} "
                         f"cannot cover {num_layers} layers on {num_devices} devices")
    thresholds = np.unique(finite)
    g_inf = _dp_values(table, dev, D, [INF], use_all_devices)[0]
    if not np.isfinite(g_inf):
        raise ValueError(f"no feasible pipeline: {num_stages} stages of {[str(s) for s in strategies]} "
                         f"cannot cover {num_layers} layers using {'exactly' if use_all_devices else 'at most'} "
                         f"{num_devices} devices")
    # feasibility is monotone in T: bisect for the least feasible threshold (the min-max bottleneck)
    lo, hi = 0, len(thresholds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(_dp_values(table, dev, D, thresholds[mid:mid + 1], use_all_devices)[0]):
            hi = mid
        else:
            lo = mid + 1
    thresholds = thresholds[lo:]
    L1 = num_layers + 1
    chunk = max(1, int(4e6 // (L1 * L1 * (D + 1))))
    best_val, best_t = INF, None
    for lo in range(0, len(thresholds), chunk):
        ts = thresholds[lo:lo + chunk]
        if g_inf + (b - 1) * ts[0] >= best_val:
            break
        vals = _dp_values(table, dev, D, ts, use_all_devices) + (b - 1) * ts
        i = int(np.argmin(vals))
        if vals[i] < best_val:
            best_val, best_t = float(vals[i]), float(ts[i])
    plan = _plan_at(table, dev, D, best_t, use_all_devices, list(strategies), b)
    assert plan is not None and plan.objective <= best_val * (1 + 1e-12) + 1e-300
    return plan


def enumerate_pipelines(num_layers: int, num_devices: int, num_stages: int, strategies: Sequence[Strategy],
                        use_all_devices: bool = True) -> Iterator[tuple]:
    """Every (layer cuts x strategies) configuration: tuples of (start, end, strategy) per stage."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0,) + cuts + (num_layers,)
        for strats in itertools.product(strategies, repeat=num_stages):
            used = sum(s.devices for s in strats)
            if used == num_devices or (not use_all_devices and used <= num_devices):
                yield tuple((bounds[k], bounds[k + 1], strats[k]) for k in range(num_stages))


def heteropipe_brute_force(num_layers: int, num_devices: int, num_stages: int, strategies: Sequence[Strategy],
                           stage_cost: StageCost, num_microbatches: int, use_all_devices: bool = True) -> PipelinePlan:
    """Reference: evaluate every configuration of `enumerate_pipelines` (small problems only)."""
    best = None
    for conf in enumerate_pipelines(num_layers, num_devices, num_stages, strategies, use_all_devices):
        plan = PipelinePlan(tuple(StagePlan(i, j, s, float(stage_cost(i, j, s, k))) for k, (i, j, s) in enumerate(conf)),
                            num_microbatches)
        if np.isfinite(plan.objective) and (best is None or plan.objective < best.objective):
            best = plan
    if best is None:
        raise ValueError("no feasible pipeline")
    return best


def transformer_stage_cost(prof: Profile, wl: Workload, spec: ModelSpec, microbatch_samples: int, num_stages: int,
                           memory_limit: Optional[float] = None) -> StageCost:
    """Stage cost of layers [start, end) of `spec` for the heteropipe DP, from the cost model:
    (end-start) * (compute + TP + CP per layer) for microbatch_samples/dp samples per replica, plus
    the pipeline exchange when num_stages > 1; inf when the stage's parameters, gradients, optimizer
    state and min(S - k, B) in-flight micro-batches of activations exceed `memory_limit`."""
    b = wl.global_batch // microbatch_samples

    @functools.lru_cache(maxsize=None)
    def by_size(n: int, s: Strategy, k: int) -> float:  # the cost depends on the layer count only
        if microbatch_samples % s.dp:
            return INF
        samples = microbatch_samples // s.dp
        c, t, p = layer_parts(prof, wl, spec, samples, s.tp, s.cp)
        val = n * float(c + t + p)
        if num_stages > 1:
            val += float(p2p_time(prof, wl, spec, samples, s.cp, True))
        if memory_limit is not None:
            params = n * spec.layer_params / s.tp
            mem = state_bytes(wl, params, s.dp * s.cp) + act_bytes(wl, spec, samples, s.tp, s.cp, n) * min(num_stages - k, b)
            if mem > memory_limit:
                return INF
        return val

    def cost(start: int, end: int, s: Strategy, k: int) -> float:
        return by_size(end - start, s, k)

    return cost


# =============================================================================================
# (b) multimodal search
# =============================================================================================
@dataclass(frozen=True)
class SearchSpace:
    """The degrees the search tries. island_sizes: encoder island sizes for disjoint (default:
    2^k and 3*2^k up to world/2). max_segments: 1 or 2 LLM segments on disjoint islands.

    runtime: only layouts `megatron-hetero train` runs (what `Candidate.to_layout` writes for it):
    every pipeline stage holds the same number of layers (layers % pp == 0, per module and per LLM
    segment), encoders run with cp = 1, the two LLM segments of a disjoint chain may differ in TP,
    PP and DP (not only in TP/DP at equal PP), a disjoint step has at most MAX_MICRO_BATCHES
    micro-batches, and no 'homogeneous' candidate: the runtime runs a layout whose modules share
    one layout on the colocated schedule, so those are the colocated candidates with equal layouts
    (the baseline). Train a disjoint pick with --micro-batch-size = micro_batch * max segment dp /
    first segment dp (the search's micro-batch carries micro_batch samples per replica of the
    largest DP; `train`'s is per rank of the first language module)."""

    placements: tuple = ("homogeneous", "colocated", "disjoint")
    tp: tuple = (1, 2, 4, 8)
    cp: tuple = (1, 2, 4, 8, 16)
    pp: tuple = tuple(range(1, 17))
    encoder_tp: tuple = (1, 2, 4, 8)
    encoder_cp: tuple = (1,)
    encoder_pp: tuple = (1, 2, 4)
    island_sizes: Optional[tuple] = None
    max_segments: int = 2
    offload: tuple = (False, True)
    runtime: bool = False

    def effective(self) -> "SearchSpace":
        """The space after the runtime's restrictions (see the class docstring)."""
        if not self.runtime:
            return self
        import dataclasses

        return dataclasses.replace(self, placements=tuple(p for p in self.placements if p != "homogeneous"),
                                   encoder_cp=(1,))

    def islands(self, world: int) -> list[int]:
        if self.island_sizes is not None:
            return sorted({int(x) for x in self.island_sizes if 0 < int(x) < world})
        out = set()
        k = 1
        while k <= world // 2:
            out.add(k)
            if 3 * k // 2 <= world // 2 and k >= 2:
                out.add(3 * k // 2)
            k *= 2
        return sorted(out)


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    breakdown: CostBreakdown


@dataclass
class SearchResult:
    """ranked: the best `top` candidates (ascending step time); baseline: the best homogeneous one;
    space_size: valid candidates in the space (homogeneous: one per stage-0 layer count);
    evaluated: candidate step times computed in full (the rest were excluded by a per-module memory
    check or by the lower bound); by_placement: the best candidate of each placement kind."""

    ranked: list
    baseline: Optional[Ranked]
    evaluated: int
    space_size: int
    seconds: float
    world_size: int
    memory_limit: float
    by_placement: dict = field(default_factory=dict)  # best Ranked per placement kind

    @property
    def best(self) -> Ranked:
        return self.ranked[0]

    @property
    def gain(self) -> Optional[float]:
        """Predicted throughput gain of the best over the best homogeneous: t_homog / t_best - 1."""
        if self.baseline is None:
            return None
        return self.baseline.breakdown.total / self.best.breakdown.total - 1.0

    def best_layout(self):
        return self.best.candidate.to_layout()

    def to_dict(self) -> dict:
        def one(r):
            return None if r is None else {"candidate": r.candidate.to_dict(), "describe": r.candidate.describe(),
                                           "breakdown": r.breakdown.to_dict()}
        return {"world_size": self.world_size, "memory_limit": self.memory_limit, "evaluated": self.evaluated,
                "space_size": self.space_size, "seconds": self.seconds, "gain_over_homogeneous": self.gain,
                "ranked": [one(r) for r in self.ranked], "baseline": one(self.baseline),
                "best_per_placement": {k: one(v) for k, v in self.by_placement.items()}}


def train_micro_batch_size(cand: Candidate, wl: Workload) -> int:
    """`megatron-hetero train --micro-batch-size` that runs `cand` with the micro-batches the cost
    model assumed: per rank of the first language module (disjoint: micro_batch * max dp / dp_first)."""
    if cand.placement != "disjoint":
        return wl.micro_batch
    return wl.micro_batch * max(s.dp for s in cand.llm) // cand.llm[0].dp


def _layouts(n: int, tps, cps, pps, spec: ModelSpec, llm: bool, even: bool = False) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) with tp*cp*pp*dp = n that the module can take (even: layers % pp == 0)."""
    out = []
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if n % (tp * cp * pp) or spec.heads % tp or spec.num_layers < pp:
                    continue
                if even and spec.num_layers % pp:
                    continue
                if llm and cp > 1 and spec.seq % (2 * cp):
                    continue
                out.append((tp, cp, pp, n // (tp * cp * pp)))
    return out


def _arr(rows, k):
    return np.array([r[k] for r in rows], dtype=np.int64)


def _ceil(a, b):
    return -(-a // b)


class _Pool:
    """Exact totals collected during the search, with how to rebuild each candidate."""

    def __init__(self):
        self.totals: list[np.ndarray] = []
        self.builders: list[Callable[[int], Candidate]] = []
        self.placement: list[str] = []

    def add(self, totals: np.ndarray, builder: Callable[[int], Candidate], placement: str) -> None:
        self.totals.append(np.asarray(totals, dtype=float))
        self.builders.append(builder)
        self.placement.append(placement)


def _homogeneous(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, pool: _Pool) -> int:
    rows = [r for r in _layouts(world, space.tp, space.cp, space.pp, wl.llm, True)
            if wl.global_batch % (wl.micro_batch * r[3]) == 0 and wl.encoder.heads % r[0] == 0
            and wl.global_batch % r[3] == 0 and wl.encoder.num_layers >= r[2]]
    if not rows:
        return 0
    tp, cp, pp, dp = (_arr(rows, k)[:, None] for k in range(4))
    llm, enc, m, k = wl.llm, wl.encoder, wl.micro_batch, wl.images_per_sample
    L, Le, lp, emb = llm.num_layers, enc.num_layers, llm.layer_params, llm.embedding_params
    b = wl.global_batch // (m * dp)
    lay = sum(layer_parts(prof, wl, llm, m, tp, cp))
    E = Le * sum(layer_parts(prof, wl, enc, m * k, tp, cp))
    P = np.where(pp > 1, p2p_time(prof, wl, llm, m, cp, tp * cp * pp * dp > prof.devices_per_node), 0.0)
    l0 = np.arange(1, L + 1)[None, :]
    valid = np.where(pp == 1, l0 == L, l0 <= L - (pp - 1))
    ppm = np.maximum(pp - 1, 1)
    rest = L - l0
    rc, rf = _ceil(rest, ppm), rest // ppm
    mx = np.where(pp == 1, L * lay + E, np.maximum(l0 * lay + E, rc * lay) + P)
    pipe = (L * lay + E + pp * P) + (b - 1) * mx
    g = dp * cp
    p0 = (l0 * lp + emb * (1 + (pp == 1)) + enc.total_params) / tp
    a0 = (act_bytes(wl, llm, m, tp, cp, l0) + act_bytes(wl, enc, m * k, tp, cp, Le)) * np.minimum(pp, b)
    p1, a1 = rc * lp / tp, act_bytes(wl, llm, m, tp, cp, rc) * np.minimum(pp - 1, b)
    pl, al = (rf * lp + emb) / tp, act_bytes(wl, llm, m, tp, cp, rf)
    multi = pp > 1
    mem = np.maximum(state_bytes(wl, p0, g) + a0,
                     np.where(multi, np.maximum(state_bytes(wl, p1, g) + a1, state_bytes(wl, pl, g) + al), 0.0))
    dpt = np.maximum(dp_time(prof, wl, p0, tp, cp, dp),
                     np.where(multi, np.maximum(dp_time(prof, wl, p1, tp, cp, dp), dp_time(prof, wl, pl, tp, cp, dp)), 0.0))
    total = np.where(valid & (mem <= limit), pipe + dpt + loss_reduce(prof, world), INF)
    best_l0 = np.argmin(total, axis=1)
    totals = total[np.arange(len(rows)), best_l0]

    def build(i: int) -> Candidate:
        t_, c_, p_, d_ = rows[i]
        seg = Segment(t_, c_, p_, d_, L)
        return Candidate("homogeneous", Segment(t_, c_, p_, d_, Le), (seg,),
                         first_stage_layers=int(best_l0[i]) + 1 if p_ > 1 else 0)

    pool.add(totals, build, "homogeneous")
    return int(valid.sum())


def _llm_uniform(wl, prof, tp, cp, pp, dp, world, b):
    """Arrays for an LLM on one evenly split layout (colocated): pipeline time, state, peak, dp time."""
    llm, m = wl.llm, wl.micro_batch
    L, lp, emb = llm.num_layers, llm.layer_params, llm.embedding_params
    lay = sum(layer_parts(prof, wl, llm, m, tp, cp))
    P = np.where(pp > 1, p2p_time(prof, wl, llm, m, cp, world > prof.devices_per_node), 0.0)
    ce, fl = _ceil(L, pp), L // pp
    pipe = (L * lay + pp * P) + (b - 1) * (ce * lay + P)
    g = dp * cp
    pf = (ce * lp + emb * (1 + (pp == 1))) / tp
    pl = (fl * lp + emb) / tp
    multi = pp > 1
    state = np.maximum(state_bytes(wl, pf, g), np.where(multi, state_bytes(wl, pl, g), 0.0))
    peak = np.maximum(state_bytes(wl, pf, g) + act_bytes(wl, llm, m, tp, cp, ce) * np.minimum(pp, b),
                      np.where(multi, state_bytes(wl, pl, g) + act_bytes(wl, llm, m, tp, cp, fl), 0.0))
    dpt = np.maximum(dp_time(prof, wl, pf, tp, cp, dp), np.where(multi, dp_time(prof, wl, pl, tp, cp, dp), 0.0))
    return pipe, state, peak, dpt


def _colocated(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, pool: _Pool) -> int:
    llm_rows = [r for r in _layouts(world, space.tp, space.cp, space.pp, wl.llm, True, space.runtime)
                if wl.global_batch % (wl.micro_batch * r[3]) == 0]
    enc_rows = [r for r in _layouts(world, space.encoder_tp, space.encoder_cp, space.encoder_pp, wl.encoder, False,
                                    space.runtime)
                if wl.global_batch % r[3] == 0]
    combos = [(a, e, o) for a in llm_rows for e in enc_rows for o in space.offload
              if max(a[3], e[3]) % min(a[3], e[3]) == 0]
    if not combos:
        return 0
    la = [c[0] for c in combos]
    ea = [c[1] for c in combos]
    tp, cp, pp, dp = (_arr(la, k) for k in range(4))
    etp, ecp, epp, edp = (_arr(ea, k) for k in range(4))
    off = np.array([c[2] for c in combos], dtype=bool)
    enc, Le, k = wl.encoder, wl.encoder.num_layers, wl.images_per_sample
    b = wl.global_batch // (wl.micro_batch * dp)
    pipe, llm_state, llm_peak, llm_dp = _llm_uniform(wl, prof, tp, cp, pp, dp, world, b)
    be = wl.global_batch * k / edp  # one pass over the rank's encoder-DP share
    lay_e = sum(layer_parts(prof, wl, enc, be, etp, ecp))
    Pe = np.where(epp > 1, p2p_time(prof, wl, enc, be, ecp, world > prof.devices_per_node), 0.0)
    ce = _ceil(Le, epp)
    pipe_e = Le * lay_e + epp * Pe
    pe = ce * enc.layer_params / etp
    enc_state = state_bytes(wl, pe, edp * ecp)
    enc_acts = act_bytes(wl, enc, be, etp, ecp, ce)
    bnd = colocated_boundary(prof, wl, etp, ecp, epp, edp, tp, cp, pp, dp)
    offt = np.where(off, 2.0 * enc_state / prof.host_bandwidth, 0.0)
    mem = np.maximum(llm_state + enc_state + enc_acts, llm_peak + enc_acts + np.where(off, 0.0, enc_state))
    total = pipe + pipe_e + bnd + offt + llm_dp + dp_time(prof, wl, pe, etp, ecp, edp) + loss_reduce(prof, world)
    total = np.where(mem <= limit, total, INF)
    L = wl.llm.num_layers

    def build(i: int) -> Candidate:
        a, e, o = combos[i]
        return Candidate("colocated", Segment(*e, Le), (Segment(*a, L),), offload=o)

    pool.add(total, build, "colocated")
    return len(combos)


def _chains(wl: Workload, world_llm: int, space: SearchSpace) -> list[tuple]:
    """LLM chains on an island: (tp_a, cp, pp_a, dp_a, n_a, tp_b, pp_b, dp_b, n_b); n_b = 0: one segment."""
    llm, L, G, m = wl.llm, wl.llm.num_layers, wl.global_batch, wl.micro_batch
    rows = [(t, c, p, d, L, 0, 0, 0, 0)
            for t, c, p, d in _layouts(world_llm, space.tp, space.cp, space.pp, llm, True, space.runtime)
            if G % (m * d) == 0 and (not space.runtime or G // (m * d) <= MAX_MICRO_BATCHES)]
    if space.max_segments >= 2 and world_llm % 2 == 0:
        half = _layouts(world_llm // 2, space.tp, space.cp, space.pp, llm, True)
        if space.runtime:
            # the runtime's segments: any two different TP/PP/DP (one DP dividing the other), every
            # stage of a segment holding the same number of layers, at most MAX_MICRO_BATCHES
            # micro-batches (the disjoint schedule's tables)
            by_cp = {}
            for t, c, p, d in half:
                by_cp.setdefault(c, []).append((t, p, d))
            for c, opts in by_cp.items():
                for (ta, pa, da), (tb, pb, db) in itertools.permutations(opts, 2):
                    hi, lo = max(da, db), min(da, db)
                    if hi % lo or G % (m * hi) or G // (m * hi) > MAX_MICRO_BATCHES:
                        continue
                    for na in range(pa, L - pb + 1):
                        if na % pa == 0 and (L - na) % pb == 0:
                            rows.append((ta, c, pa, da, na, tb, pb, db, L - na))
            return rows
        by = {}
        for t, c, p, d in half:
            by.setdefault((c, p), []).append((t, d))
        for (c, p), opts in by.items():
            for (ta, da), (tb, db) in itertools.permutations(opts, 2):  # two different strategies
                hi, lo = max(da, db), min(da, db)
                if hi % lo or G % (m * hi):
                    continue
                for na in range(p, L - p + 1):
                    rows.append((ta, c, p, da, na, tb, p, db, L - na))
    return rows


def _disjoint(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float,
              groups: list) -> int:
    """Prepare the disjoint groups (encoder arrays x chain arrays sharing M, P_llm, dp_a): each
    side's sum/max/dp-time/memory; parts over the memory limit are dropped. Returns the number of
    valid (encoder, chain) pairs."""
    enc, llm = wl.encoder, wl.llm
    Le, L, k, G, m = enc.num_layers, llm.num_layers, wl.images_per_sample, wl.global_batch, wl.micro_batch
    lp, emb, dpn = llm.layer_params, llm.embedding_params, prof.devices_per_node
    size = 0
    for we in space.islands(world):
        wlm = world - we
        enc_rows = _layouts(we, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime)
        rows = _chains(wl, wlm, space)
        if not enc_rows or not rows:
            continue
        ch = np.array(rows, dtype=np.int64)
        ta, cp, pa, da, na, tb, pb, db, nb = (ch[:, i] for i in range(9))
        two = nb > 0
        M = m * np.maximum(da, np.where(two, db, 1))
        b = G // M
        P_llm = pa + pb
        sa = M // da
        lay_a = sum(layer_parts(prof, wl, llm, sa, ta, cp))
        Pa = np.where(P_llm > 1, p2p_time(prof, wl, llm, sa, cp, wlm > dpn), 0.0)
        Bd = disjoint_boundary(prof, wl, sa, cp, world)
        cea, fla = _ceil(na, pa), na // pa
        max_a = cea * lay_a + Pa + Bd
        sum_a = na * lay_a + pa * Pa + Bd
        dbs, tbs, pbs = np.maximum(db, 1), np.maximum(tb, 1), np.maximum(pb, 1)
        sb = M // dbs
        lay_b = sum(layer_parts(prof, wl, llm, sb, tbs, cp))
        Pb = np.where(P_llm > 1, p2p_time(prof, wl, llm, sb, cp, wlm > dpn), 0.0)
        ceb, flb = _ceil(nb, pbs), nb // pbs
        max_b = np.where(two, ceb * lay_b + Pb, 0.0)
        sum_b = np.where(two, nb * lay_b + pb * Pb, 0.0)
        c_sum, c_max = sum_a + sum_b, np.maximum(max_a, max_b)
        # representative stages: first of a, first of b, last of the chain
        last_a_only = ~two & (pa == 1)
        pfa = (cea * lp + emb * (1 + last_a_only)) / ta
        mfa = state_bytes(wl, pfa, da * cp) + act_bytes(wl, llm, sa, ta, cp, cea) * np.minimum(P_llm, b)
        pfb = (ceb * lp + emb * (pbs == 1)) / tbs
        mfb = state_bytes(wl, pfb, dbs * cp) + act_bytes(wl, llm, sb, tbs, cp, ceb) * np.minimum(P_llm - pa, b)
        lt, ld, lfl = np.where(two, tbs, ta), np.where(two, dbs, da), np.where(two, flb, fla)
        ls = np.where(two, sb, sa)
        pl = (lfl * lp + emb) / lt
        ml = state_bytes(wl, pl, ld * cp) + act_bytes(wl, llm, ls, lt, cp, lfl)
        has_last = two | (pa > 1)
        c_mem = np.maximum(mfa, np.maximum(np.where(two, mfb, 0.0), np.where(has_last, ml, 0.0)))
        c_dp = np.maximum(dp_time(prof, wl, pfa, ta, cp, da),
                          np.maximum(np.where(two, dp_time(prof, wl, pfb, tbs, cp, dbs), 0.0),
                                     np.where(has_last, dp_time(prof, wl, pl, lt, cp, ld), 0.0)))
        ok = c_mem <= limit
        key = c_sum + (b - 1) * c_max + c_dp
        er = np.array(enc_rows, dtype=np.int64)
        etp, ecp, epp, edp = (er[:, i] for i in range(4))
        ce = _ceil(Le, epp)
        pe = ce * enc.layer_params / etp
        e_state = state_bytes(wl, pe, edp * ecp)
        e_dp = dp_time(prof, wl, pe, etp, ecp, edp)
        gkeys = np.stack([M, P_llm, da], axis=1)
        uniq, inv = np.unique(gkeys, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for gi, (Mg, Pg, dag) in enumerate(uniq):
            sel = np.nonzero(inv == gi)[0]
            esel = np.nonzero((Mg % edp == 0) & ((np.maximum(edp, dag) % np.minimum(edp, dag)) == 0))[0]
            if not len(esel):
                continue
            size += len(sel) * len(esel)
            bg = G // Mg
            be = Mg * k / edp[esel]
            lay_e = sum(layer_parts(prof, wl, enc, be, etp[esel], ecp[esel]))
            Pe = np.where(epp[esel] > 1, p2p_time(prof, wl, enc, be, ecp[esel], we > dpn), 0.0)
            e_sum = Le * lay_e + epp[esel] * Pe
            e_max = ce[esel] * lay_e + Pe
            e_mem = e_state[esel] + act_bytes(wl, enc, be, etp[esel], ecp[esel], ce[esel]) * np.minimum(epp[esel] + Pg, bg)
            eok = e_mem <= limit
            csel = sel[ok[sel]]
            esel, e_sum, e_max = esel[eok], e_sum[eok], e_max[eok]
            if not len(csel) or not len(esel):
                continue
            order = np.argsort(key[csel], kind="stable")
            csel = csel[order]
            groups.append(dict(we=we, b=bg, rows=rows, loss=float(loss_reduce(prof, world)), enc_rows=enc_rows, cidx=csel, ckey=key[csel],
                               c_sum=c_sum[csel], c_max=c_max[csel], c_dp=c_dp[csel],
                               eidx=esel, e_sum=e_sum, e_max=e_max, e_dp=e_dp[esel]))
    return size


def _pairs(gr: dict, tau: float, probe: Optional[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(encoder positions, chain positions, totals) of the pairs to evaluate in group `gr`: the
    first `probe` chains per encoder, or every chain with E_sum + K(c) <= tau."""
    nE, nC = len(gr["eidx"]), len(gr["cidx"])
    if probe is not None:
        cnt = np.full(nE, min(probe, nC))
    else:
        # slack: when the bound is tight (E_max <= C_max, E_dp <= C_dp) it equals the total up to rounding
        cnt = np.searchsorted(gr["ckey"], tau * (1 + 1e-9) - gr["e_sum"], side="right")
    ei = np.repeat(np.arange(nE), cnt)
    starts = np.cumsum(cnt) - cnt
    ci = np.arange(int(cnt.sum())) - np.repeat(starts, cnt)
    b = gr["b"]
    tot = (gr["e_sum"][ei] + gr["c_sum"][ci] + (b - 1) * np.maximum(gr["e_max"][ei], gr["c_max"][ci])
           + np.maximum(gr["e_dp"][ei], gr["c_dp"][ci]) + gr["loss"])
    return ei, ci, tot


def _chain_candidate(gr: dict, e: int, c: int, wl: Workload) -> Candidate:
    et, ec, ep, ed = gr["enc_rows"][gr["eidx"][e]]
    ta, cp, pa, da, na, tb, pb, db, nb = gr["rows"][gr["cidx"][c]]
    segs = (Segment(ta, cp, pa, da, na),) + ((Segment(tb, cp, pb, db, nb),) if nb else ())
    return Candidate("disjoint", Segment(et, ec, ep, ed, wl.encoder.num_layers), segs, encoder_ranks=gr["we"])


def search(wl: Workload, prof: Profile, world_size: int, memory_limit: Optional[float] = None,
           space: SearchSpace = SearchSpace(), top: int = 10, prune: bool = True) -> SearchResult:
    """Rank the configurations of `space` on `world_size` ranks by predicted step time.

    memory_limit: bytes per rank (default: 90% of the profile's device memory). Returns the `top`
    best with their `CostBreakdown`, the best homogeneous one (baseline) and the best per placement.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    unknown = sorted(set(space.placements) - set(C.PLACEMENT_KINDS))
    if unknown:
        raise ValueError(f"unknown placements {unknown}; choose from {list(C.PLACEMENT_KINDS)}")
    limit = 0.9 * prof.memory_bytes if memory_limit is None else float(memory_limit)
    space = space.effective()
    t0 = time.perf_counter()
    if prof.overheads or prof.shared:
        # a measured profile's extra terms (overheads, shared execution units) are in the scalar
        # `cost.evaluate` only: score every candidate one by one (measured profiles are for the
        # machine at hand, so spaces are small)
        return _scalar_search(wl, prof, world_size, limit, space, top, t0)
    pool, evaluated, size = _Pool(), 0, 0
    if "homogeneous" in space.placements:
        n = _homogeneous(wl, prof, world_size, space, limit, pool)
        evaluated += n
        size += n
    if "colocated" in space.placements:
        n = _colocated(wl, prof, world_size, space, limit, pool)
        evaluated += n
        size += n
    groups: list = []
    if "disjoint" in space.placements and world_size > 1:
        size += _disjoint(wl, prof, world_size, space, limit, groups)
    exact = [t[np.isfinite(t)] for t in pool.totals]
    tau = INF
    if prune and groups:
        best_disjoint = INF
        for gr in groups:
            _, _, tot = _pairs(gr, INF, top)
            evaluated += len(tot)
            exact.append(tot[np.isfinite(tot)])
            best_disjoint = min(best_disjoint, float(tot.min()))
        allv = np.concatenate(exact)
        if len(allv) >= top:
            # the K-th best value seen bounds the true K-th best; the best disjoint value seen
            # bounds the best disjoint candidate (reported per placement)
            tau = max(float(np.partition(allv, top - 1)[top - 1]), best_disjoint)
    for gi, gr in enumerate(groups):
        ei, ci, tot = _pairs(gr, tau, None)
        evaluated += len(tot)
        keep = tot <= tau if np.isfinite(tau) else np.isfinite(tot)
        if prune:
            ei, ci, tot = ei[keep], ci[keep], tot[keep]
        else:  # keep the group's best `top` only
            if len(tot) > top:
                part = np.argpartition(tot, top - 1)[:top]
                ei, ci, tot = ei[part], ci[part], tot[part]
        pool.add(tot, (lambda g, a, c: (lambda i: _chain_candidate(g, int(a[i]), int(c[i]), wl)))(gr, ei, ci),
                 "disjoint")
    ranked, by_placement = _rank(pool, wl, prof, top)
    if not ranked:
        raise ValueError(f"no configuration of {wl.encoder.name} + {wl.llm.name} on {world_size} ranks fits the "
                         f"memory limit of {limit / 1e9:.1f} GB per rank (or none divides global batch "
                         f"{wl.global_batch} with micro-batch {wl.micro_batch})")
    baseline = _runtime_baseline(wl, prof, world_size, space, limit) if space.runtime else by_placement.get("homogeneous")
    return SearchResult(ranked=ranked, baseline=baseline, evaluated=evaluated, space_size=size,
                        seconds=time.perf_counter() - t0, world_size=world_size, memory_limit=limit,
                        by_placement=by_placement)


def _runtime_baseline(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float) -> Optional[Ranked]:
    """The runtime's homogeneous baseline: the best colocated candidate whose encoder runs on the
    LLM's own layout (cp = 1: the runtime's encoders do not take CP)."""
    best = None
    for t, c, p, d in _layouts(world, space.tp, (1,), space.pp, wl.llm, True, True):
        if wl.encoder.heads % t or wl.encoder.num_layers % p:
            continue
        cand = Candidate("colocated", Segment(t, c, p, d, wl.encoder.num_layers), (Segment(t, c, p, d, wl.llm.num_layers),))
        try:
            bd = evaluate(cand, wl, prof)
        except ValueError:
            continue
        if bd.memory_per_rank_peak <= limit and (best is None or bd.total < best.breakdown.total):
            best = Ranked(cand, bd)
    return best


def _scalar_search(wl: Workload, prof: Profile, world: int, limit: float, space: SearchSpace, top: int,
                   t0: float) -> SearchResult:
    scored = brute_force(wl, prof, world, limit, space)
    if not scored:
        raise ValueError(f"no configuration of {wl.encoder.name} + {wl.llm.name} on {world} ranks fits the "
                         f"memory limit of {limit / 1e9:.1f} GB per rank (or none divides global batch "
                         f"{wl.global_batch} with micro-batch {wl.micro_batch})")
    ranked = [Ranked(c, evaluate(c, wl, prof)) for _, c in scored[:top]]
    by_placement = {}
    for _, c in scored:
        if c.placement not in by_placement:
            by_placement[c.placement] = Ranked(c, evaluate(c, wl, prof))
    baseline = _runtime_baseline(wl, prof, world, space, limit) if space.runtime else by_placement.get("homogeneous")
    return SearchResult(ranked=ranked, baseline=baseline, evaluated=len(scored), space_size=len(scored),
                        seconds=time.perf_counter() - t0, world_size=world, memory_limit=limit,
                        by_placement=by_placement)


def _rank(pool: _Pool, wl: Workload, prof: Profile, top: int) -> tuple[list, dict]:
    if not pool.totals:
        return [], {}
    totals = np.concatenate(pool.totals)
    src = np.concatenate([np.full(len(t), i) for i, t in enumerate(pool.totals)])
    idx = np.concatenate([np.arange(len(t)) for t in pool.totals])
    order = np.argsort(totals, kind="stable")
    order = order[np.isfinite(totals[order])]

    def make(j) -> Ranked:
        cand = pool.builders[src[j]](int(idx[j]))
        bd = evaluate(cand, wl, prof)
        assert math.isclose(bd.total, totals[j], rel_tol=1e-9), (cand, bd.total, totals[j])
        return Ranked(cand, bd)

    ranked = [make(j) for j in order[:top]]
    kinds = np.array(pool.placement)[src[order]]
    by_placement = {}
    for kind in C.PLACEMENT_KINDS:
        hit = np.nonzero(kinds == kind)[0]
        if len(hit):
            by_placement[kind] = make(order[hit[0]])
    return ranked, by_placement


def brute_force(wl: Workload, prof: Profile, world_size: int, memory_limit: Optional[float] = None,
                space: SearchSpace = SearchSpace()) -> list[tuple[float, Candidate]]:
    """Reference for tests: every candidate of `space` built one by one and scored with the scalar
    `cost.evaluate` (homogeneous: every stage-0 layer count). Sorted (total, candidate), feasible only."""
    limit = 0.9 * prof.memory_bytes if memory_limit is None else float(memory_limit)
    space = space.effective()
    enc, llm, L, Le = wl.encoder, wl.llm, wl.llm.num_layers, wl.encoder.num_layers
    cands: list[Candidate] = []
    if "homogeneous" in space.placements:
        for t, c, p, d in _layouts(world_size, space.tp, space.cp, space.pp, llm, True):
            if enc.heads % t == 0 and Le >= p:
                best = None
                for l0 in ([0] if p == 1 else range(1, L - p + 2)):
                    cand = Candidate("homogeneous", Segment(t, c, p, d, Le), (Segment(t, c, p, d, L),), first_stage_layers=l0)
                    r = _try(cand, wl, prof, limit)
                    if r is not None and (best is None or r < best[0]):
                        best = (r, cand)
                if best:
                    cands.append(best[1])
    if "colocated" in space.placements:
        for a in _layouts(world_size, space.tp, space.cp, space.pp, llm, True, space.runtime):
            for e in _layouts(world_size, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime):
                if max(a[3], e[3]) % min(a[3], e[3]) == 0:
                    for o in space.offload:
                        cands.append(Candidate("colocated", Segment(*e, Le), (Segment(*a, L),), offload=o))
    if "disjoint" in space.placements:
        for we in space.islands(world_size):
            for e in _layouts(we, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime):
                for r in _chains(wl, world_size - we, space):
                    ta, cp, pa, da, na, tb, pb, db, nb = r
                    if max(e[3], da) % min(e[3], da):
                        continue
                    segs = (Segment(ta, cp, pa, da, na),) + ((Segment(tb, cp, pb, db, nb),) if nb else ())
                    cands.append(Candidate("disjoint", Segment(*e, Le), segs, encoder_ranks=we))
    out = []
    for cand in cands:
        r = _try(cand, wl, prof, limit)
        if r is not None:
            out.append((r, cand))
    out.sort(key=lambda x: x[0])
    return out


def _try(cand: Candidate, wl: Workload, prof: Profile, limit: float) -> Optional[float]:
    try:
        bd = evaluate(cand, wl, prof)
    except ValueError:
        return None
    return bd.total if bd.memory_per_rank_peak <= limit else None


# =============================================================================================
# Presets and the simulated regime table
# =============================================================================================
# Encoders: ViT-style, 1024 patches per image (448 px / 14 px patches), non-gated MLP 4h.
ENCODER_PRESETS = {
    "1B": ModelSpec("vision-1B", 32, 1536, 6144, 16, 1024, kind="encoder"),
    "3B": ModelSpec("vision-3B", 48, 2304, 9216, 24, 1024, kind="encoder"),
    "6B": ModelSpec("vision-6B", 48, 3200, 12800, 32, 1024, kind="encoder"),
    "12B": ModelSpec("vision-12B", 60, 4096, 16384, 32, 1024, kind="encoder"),
}
# LLMs: gated (SwiGLU) MLP, 128K vocabulary, untied embeddings; seq is set per context.
LLM_PRESETS = {
    "14B": ModelSpec("llm-14B", 40, 5120, 13824, 40, 8192, vocab=128256, gated=True),
    "70B": ModelSpec("llm-70B", 80, 8192, 24576, 64, 8192, vocab=128256, gated=True),
    "120B": ModelSpec("llm-120B", 96, 10240, 26624, 80, 8192, vocab=128256, gated=True),
}
REGIME_WORLD = {"14B": 64, "70B": 256, "120B": 1024}
REGIME_CONTEXTS = (8192, 32768, 131072)
TOKENS_PER_STEP = 4 * 1024 * 1024


def regime_workload(encoder: str, llm: str, context: int, tokens_per_step: int = TOKENS_PER_STEP) -> Workload:
    """The regime table's workload: global batch = tokens_per_step / context samples, one
    1024-patch image per 8K tokens of context (image tokens = 1/8 of the context)."""
    try:
        enc, lm = ENCODER_PRESETS[encoder], LLM_PRESETS[llm]
    except KeyError as exc:
        raise ValueError(f"unknown preset {exc}; encoders {list(ENCODER_PRESETS)}, LLMs {list(LLM_PRESETS)}") from None
    lm = ModelSpec(lm.name, lm.num_layers, lm.hidden, lm.ffn_hidden, lm.heads, context, vocab=lm.vocab, gated=lm.gated)
    return Workload(enc, lm, global_batch=max(1, tokens_per_step // context), images_per_sample=max(1, context // 8192))


def regime_table(prof: Profile, encoders: Sequence[str] = tuple(ENCODER_PRESETS), llms: Sequence[str] = tuple(LLM_PRESETS),
                 contexts: Sequence[int] = REGIME_CONTEXTS, world_sizes: Optional[dict] = None,
                 memory_limit: Optional[float] = None, space: SearchSpace = SearchSpace()) -> list[dict]:
    """One row per (encoder, LLM, context): the placement the search picks, its step time, the best
    step time per placement and the predicted gain over the best homogeneous configuration."""
    worlds = dict(REGIME_WORLD, **(world_sizes or {}))
    rows = []
    for lm in llms:
        for enc in encoders:
            for ctx in contexts:
                wl = regime_workload(enc, lm, ctx)
                row = {"encoder": enc, "llm": lm, "context": ctx, "gpus": worlds[lm], "global_batch": wl.global_batch,
                       "picked": None, "layout": None, "step_s": None, "gain": None,
                       "homogeneous_s": None, "colocated_s": None, "disjoint_s": None}
                try:
                    res = search(wl, prof, worlds[lm], memory_limit, space, top=1)
                except ValueError:
                    rows.append(row)
                    continue
                row.update(picked=res.best.candidate.placement, layout=res.best.candidate.describe(),
                           step_s=res.best.breakdown.total, gain=res.gain, evaluated=res.evaluated,
                           space_size=res.space_size, seconds=res.seconds)
                for kind, r in res.by_placement.items():
                    row[f"{kind}_s"] = r.breakdown.total
                rows.append(row)
    return rows
