"""heteropipe: one model of L layers cut into S pipeline stages; each stage gets a contiguous layer
range and a strategy (its `Degrees` with pp = 1: TP/CP/DP, hence tp*cp*dp devices); minimise
    sum_k c_k + (B-1) * max_k c_k            (1F1B with B micro-batches)
Exact: for every candidate bottleneck threshold T (the distinct finite stage costs, ascending), a
dynamic program over (stages, layers covered, devices used) gives g(T) = the least sum of stage
costs with every stage <= T; the answer is the plan behind min_T g(T) + (B-1)*T. (The optimum's own
max M* is a threshold and g(M*) <= its sum, and a plan found at T has max <= T, so this is exact.)
The scan starts at the least feasible threshold (bisection: feasibility is monotone in T), runs
all thresholds of a chunk at once in numpy, and stops once g(inf) + (B-1)*T reaches the best value
found (a lower bound for every larger T). Pure (numpy only).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from megatron_hetero.layout.degrees import Degrees
from megatron_hetero.planner.cost_terms import act_bytes, layer_parts, p2p_time, state_bytes
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import ModelSpec, Workload

INF = float("inf")


def strategy_label(d: Degrees) -> str:
    """'TP2·DP4' ('TP1·CP2·DP4' with CP): a stage strategy (pp = 1) as the plans print it."""
    return f"TP{d.tp}·" + (f"CP{d.cp}·" if d.cp > 1 else "") + f"DP{d.dp}"


def _check_strategies(strategies: Sequence[Degrees]) -> None:
    for s in strategies:
        if not isinstance(s, Degrees) or s.pp != 1:
            raise ValueError(f"a stage strategy is a Degrees with pp = 1, got {s!r}")


@dataclass(frozen=True)
class StagePlan:
    start: int  # first layer
    end: int  # one past the last layer
    strategy: Degrees
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
        return " | ".join(f"layers {s.start}-{s.end - 1} {strategy_label(s.strategy)}" for s in self.stages)


StageCost = Callable[[int, int, Degrees, int], float]


def stage_cost_table(
    num_layers: int, num_stages: int, strategies: Sequence[Degrees], stage_cost: StageCost
) -> np.ndarray:
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
    for name, v in (
        ("num_layers", num_layers),
        ("num_devices", num_devices),
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages need at least {num_stages} layers, got {num_layers}")
    if not strategies:
        raise ValueError("at least one strategy is needed")


def _units(strategies, num_devices):
    g = math.gcd(*(s.size for s in strategies))
    return [s.size // g for s in strategies], num_devices // g, g


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
            cand = np.min(f[:, :, None, : D + 1 - ds] + cm[:, :, :, None], axis=1)  # (nT, j, d)
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
            tot = f[k][:, None, : D + 1 - ds] + cm[:, :, None]  # (i, j, d)
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


def heteropipe_search(
    num_layers: int,
    num_devices: int,
    num_stages: int,
    strategies: Sequence[Degrees],
    stage_cost: StageCost,
    num_microbatches: int,
    use_all_devices: bool = True,
    table: Optional[np.ndarray] = None,
) -> PipelinePlan:
    """Exact minimum of sum + (B-1)*max over layer partitions and per-stage strategies.

    stage_cost(start, end, strategy, stage_index) -> seconds per micro-batch (inf: infeasible, e.g.
    out of memory). Stages use exactly `num_devices` devices in total (or at most, with
    use_all_devices=False). Raises ValueError if no plan is feasible.
    """
    _check_pipeline_args(num_layers, num_devices, num_stages, strategies, num_microbatches)
    _check_strategies(strategies)
    if table is None:
        table = stage_cost_table(num_layers, num_stages, strategies, stage_cost)
    dev, D, g = _units(strategies, num_devices)
    b = num_microbatches
    finite = table[np.isfinite(table)]
    if (use_all_devices and num_devices % g) or finite.size == 0:
        raise ValueError(
            f"no feasible pipeline: {num_stages} stages of {[strategy_label(s) for s in strategies]} "
            f"cannot cover {num_layers} layers on {num_devices} devices"
        )
    thresholds = np.unique(finite)
    g_inf = _dp_values(table, dev, D, [INF], use_all_devices)[0]
    if not np.isfinite(g_inf):
        raise ValueError(
            f"no feasible pipeline: {num_stages} stages of {[strategy_label(s) for s in strategies]} "
            f"cannot cover {num_layers} layers using {'exactly' if use_all_devices else 'at most'} "
            f"{num_devices} devices"
        )
    # feasibility is monotone in T: bisect for the least feasible threshold (the min-max bottleneck)
    lo, hi = 0, len(thresholds) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if np.isfinite(_dp_values(table, dev, D, thresholds[mid : mid + 1], use_all_devices)[0]):
            hi = mid
        else:
            lo = mid + 1
    thresholds = thresholds[lo:]
    L1 = num_layers + 1
    chunk = max(1, int(4e6 // (L1 * L1 * (D + 1))))
    best_val, best_t = INF, None
    for lo in range(0, len(thresholds), chunk):
        ts = thresholds[lo : lo + chunk]
        if g_inf + (b - 1) * ts[0] >= best_val:
            break
        vals = _dp_values(table, dev, D, ts, use_all_devices) + (b - 1) * ts
        i = int(np.argmin(vals))
        if vals[i] < best_val:
            best_val, best_t = float(vals[i]), float(ts[i])
    plan = _plan_at(table, dev, D, best_t, use_all_devices, list(strategies), b)
    assert plan is not None and plan.objective <= best_val * (1 + 1e-12) + 1e-300
    return plan


def enumerate_pipelines(
    num_layers: int, num_devices: int, num_stages: int, strategies: Sequence[Degrees], use_all_devices: bool = True
) -> Iterator[tuple]:
    """Every (layer cuts x strategies) configuration: tuples of (start, end, strategy) per stage."""
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0,) + cuts + (num_layers,)
        for strats in itertools.product(strategies, repeat=num_stages):
            used = sum(s.size for s in strats)
            if used == num_devices or (not use_all_devices and used <= num_devices):
                yield tuple((bounds[k], bounds[k + 1], strats[k]) for k in range(num_stages))


def transformer_stage_cost(
    prof: Profile,
    wl: Workload,
    spec: ModelSpec,
    microbatch_samples: int,
    num_stages: int,
    memory_limit: Optional[float] = None,
) -> StageCost:
    """Stage cost of layers [start, end) of `spec` for the heteropipe DP, from the cost model:
    (end-start) * (compute + TP + CP per layer) for microbatch_samples/dp samples per replica, plus
    the pipeline exchange when num_stages > 1; inf when the stage's parameters, gradients, optimizer
    state and min(S - k, B) in-flight micro-batches of activations exceed `memory_limit`."""
    b = wl.global_batch // microbatch_samples

    @functools.lru_cache(maxsize=None)
    def by_size(n: int, s: Degrees, k: int) -> float:  # the cost depends on the layer count only
        if microbatch_samples % s.dp:
            return INF
        samples = microbatch_samples // s.dp
        c, t, p = layer_parts(prof, wl, spec, samples, s.tp, s.cp)
        val = n * float(c + t + p)
        if num_stages > 1:
            val += float(p2p_time(prof, wl, spec, samples, s.cp, True))
        if memory_limit is not None:
            params = n * spec.layer_params / s.tp
            mem = state_bytes(wl, params, s.dp * s.cp) + act_bytes(wl, spec, samples, s.tp, s.cp, n) * min(
                num_stages - k, b
            )
            if mem > memory_limit:
                return INF
        return val

    def cost(start: int, end: int, s: Degrees, k: int) -> float:
        return by_size(end - start, s, k)

    return cost
