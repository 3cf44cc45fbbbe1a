"""The layout search's candidate rows: the (tp, cp, pp, dp) layouts and EP sizes a module can take, the
pool of scored step times, and the homogeneous and colocated candidates scored as whole arrays by the
batched evaluator (`planner/placements.py`). Pure (numpy only).
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from megatron_hetero.planner import placements as PL
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.workload import Candidate, ModelSpec, Segment, Workload
from megatron_hetero.planner.search_space import INF, SearchSpace


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


def _eps(wl: Workload, row) -> tuple[int, ...]:
    """EP sizes the LLM can take on layout `row` (tp, cp, pp, dp): 1 for a dense LLM; with experts,
    every ep that divides the number of experts and the stage's tp*cp*dp (expert-TP 1), and with
    tp > 1 only ep = 1 (Megatron's MoE needs sequence parallelism for TP x EP, which `train` does
    not run)."""
    n = wl.llm.num_experts
    if not n:
        return (1,)
    stage = row[0] * row[1] * row[3]
    return tuple(e for e in range(1, n + 1) if n % e == 0 and stage % e == 0 and (e == 1 or row[0] == 1))


def _with_ep(wl: Workload, rows: list) -> tuple[list, list]:
    """`rows` repeated once per EP size each can take: (rows, eps)."""
    out, eps = [], []
    for r in rows:
        for e in _eps(wl, r):
            out.append(r)
            eps.append(e)
    return out, eps


def _arr(rows, k):
    return np.array([r[k] for r in rows], dtype=np.int64)


class _Pool:
    """Step times collected during the search, with how to rebuild each candidate."""

    def __init__(self):
        self.totals: list[np.ndarray] = []
        self.builders: list[Callable[[int], Candidate]] = []
        self.placement: list[str] = []

    def add(self, totals: np.ndarray, builder: Callable[[int], Candidate], placement: str) -> None:
        self.totals.append(np.asarray(totals, dtype=float))
        self.builders.append(builder)
        self.placement.append(placement)


def _homogeneous(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, pool: _Pool) -> int:
    rows = [
        r
        for r in _layouts(world, space.tp, space.cp, space.pp, wl.llm, True)
        if wl.global_batch % (wl.micro_batch * r[3]) == 0
        and wl.global_batch % r[3] == 0
        and all(e.heads % r[0] == 0 and e.num_layers >= r[2] for e in wl.encoders)
    ]
    if not rows:
        return 0
    rows, eps = _with_ep(wl, rows)
    L, Le = wl.llm.num_layers, wl.encoder.num_layers
    tp, cp, pp, dp = (_arr(rows, k)[:, None] for k in range(4))
    ep = np.array(eps, dtype=np.int64)[:, None]
    l0 = np.arange(1, L + 1)[None, :]
    valid = np.where(pp == 1, l0 == L, l0 <= L - (pp - 1))
    grid = [np.broadcast_to(x, valid.shape).ravel() for x in (tp, cp, pp, dp, l0, ep)]
    out = PL.homogeneous(prof, wl, *grid)
    total = np.where(
        valid & (out["memory_per_rank_peak"].reshape(valid.shape) <= limit), out["total"].reshape(valid.shape), INF
    )
    best_l0 = np.argmin(total, axis=1)
    totals = total[np.arange(len(rows)), best_l0]

    def build(i: int) -> Candidate:
        t_, c_, p_, d_ = rows[i]
        return Candidate(
            "homogeneous",
            Segment.of(t_, c_, p_, d_, Le),
            (Segment.of(t_, c_, p_, d_, L, ep=eps[i]),),
            first_stage_layers=int(best_l0[i]) + 1 if p_ > 1 else 0,
            extra_encoders=tuple(Segment.of(t_, c_, p_, d_, e.num_layers) for e in wl.extra_encoders),
        )

    pool.add(totals, build, "homogeneous")
    return int(valid.sum())


def _colocated(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, pool: _Pool) -> int:
    llm_rows = [
        r
        for r in _layouts(world, space.tp, space.cp, space.pp, wl.llm, True, space.runtime)
        if wl.global_batch % (wl.micro_batch * r[3]) == 0
    ]
    enc_rows = [
        [
            r
            for r in _layouts(world, space.encoder_tp, space.encoder_cp, space.encoder_pp, spec, False, space.runtime)
            if wl.global_batch % r[3] == 0
        ]
        for spec in wl.encoders
    ]
    # every encoder's layout on the same ranks (several encoders: every combination of theirs)
    combos = [
        (a, es, o, x)
        for a in llm_rows
        for es in itertools.product(*enc_rows)
        for o in space.offload
        for x in _eps(wl, a)
        if all(max(a[3], e[3]) % min(a[3], e[3]) == 0 for e in es)
    ]
    if not combos:
        return 0
    la = [c[0] for c in combos]
    per_enc = [[c[1][j] for c in combos] for j in range(len(wl.encoders))]
    extra = tuple(tuple(_arr(ej, k) for k in range(4)) for ej in per_enc[1:])
    lt, et = [_arr(la, k) for k in range(4)], [_arr(per_enc[0], k) for k in range(4)]
    out = PL.colocated(
        prof,
        wl,
        lt[0],
        lt[1],
        lt[2],
        lt[3],
        et[0],
        et[1],
        et[2],
        et[3],
        np.array([c[2] for c in combos], dtype=bool),
        np.array([c[3] for c in combos], dtype=np.int64),
        extra=extra,
    )
    total = np.where(out["memory_per_rank_peak"] <= limit, out["total"], INF)
    L = wl.llm.num_layers

    def build(i: int) -> Candidate:
        a, es, o, x = combos[i]
        segs = [Segment.of(*e, spec.num_layers) for e, spec in zip(es, wl.encoders)]
        return Candidate("colocated", segs[0], (Segment.of(*a, L, ep=x),), offload=o, extra_encoders=tuple(segs[1:]))

    pool.add(total, build, "colocated")
    return len(combos)
