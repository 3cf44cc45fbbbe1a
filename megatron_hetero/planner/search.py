"""Multimodal layout search. Pure (numpy only).

`search` ranks the space of `SearchSpace`: homogeneous (encoder on the LLM's layout in pipeline
stage 0; the LLM layers of stage 0 chosen optimally), colocated heterogeneous (three-phase, with or
without encoder offload) and disjoint islands (encoder island size, encoder layout, LLM as one
segment or two segments with their own TP/DP and a layer split). Every candidate is scored by the
cost model's evaluator (`planner/cost.py`) on numpy arrays, whatever the profile (simulated, or
measured with overheads and shared execution units); the reported candidates' breakdowns are the
same evaluator with one row (`cost.evaluate`).
Disjoint candidates pair an encoder configuration e with an LLM chain c; with
K(c) = C_sum + (B-1) C_max + C_tail + loss, the critical path is >= E_sum + K(c) and the step
>= uncontended * (E_sum + K(c)) (a lower bound), so after a probe gives tau (the K-th best exact
value seen), only pairs with E_sum + K(c) <= tau / uncontended are evaluated: the returned top-K
equals the top-K of exhaustive evaluation (`prune=False` evaluates every pair).
`SearchSpace(runtime=True)` keeps only layouts `megatron-hetero train` runs (the `search --out` CLI
default). The exact layer-partition search of one model is `planner/heteropipe.py`; presets and the
regime table are `planner/presets.py`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from megatron_hetero.planner import placements as PL
from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.cost_terms import loss_reduce
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.plan.schedule import MAX_MICRO_BATCHES  # the disjoint schedule's stage tables
from megatron_hetero.planner.workload import PLACEMENT_KINDS, Candidate, CostBreakdown, ModelSpec, Segment, Workload

INF = float("inf")


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

        return dataclasses.replace(
            self, placements=tuple(p for p in self.placements if p != "homogeneous"), encoder_cp=(1,)
        )

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
            return (
                None
                if r is None
                else {
                    "candidate": r.candidate.to_dict(),
                    "describe": r.candidate.describe(),
                    "breakdown": r.breakdown.to_dict(),
                }
            )

        return {
            "world_size": self.world_size,
            "memory_limit": self.memory_limit,
            "evaluated": self.evaluated,
            "space_size": self.space_size,
            "seconds": self.seconds,
            "gain_over_homogeneous": self.gain,
            "ranked": [one(r) for r in self.ranked],
            "baseline": one(self.baseline),
            "best_per_placement": {k: one(v) for k, v in self.by_placement.items()},
        }


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
        and wl.encoder.heads % r[0] == 0
        and wl.global_batch % r[3] == 0
        and wl.encoder.num_layers >= r[2]
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
        r
        for r in _layouts(world, space.encoder_tp, space.encoder_cp, space.encoder_pp, wl.encoder, False, space.runtime)
        if wl.global_batch % r[3] == 0
    ]
    combos = [
        (a, e, o, x)
        for a in llm_rows
        for e in enc_rows
        for o in space.offload
        for x in _eps(wl, a)
        if max(a[3], e[3]) % min(a[3], e[3]) == 0
    ]
    if not combos:
        return 0
    la, ea = [c[0] for c in combos], [c[1] for c in combos]
    # mypy cannot count the two starred generators (4 arguments each)
    out = PL.colocated(
        prof,
        wl,
        *(_arr(la, k) for k in range(4)),
        *(_arr(ea, k) for k in range(4)),  # type: ignore[call-arg]
        np.array([c[2] for c in combos], dtype=bool),
        np.array([c[3] for c in combos], dtype=np.int64),
    )
    total = np.where(out["memory_per_rank_peak"] <= limit, out["total"], INF)
    L, Le = wl.llm.num_layers, wl.encoder.num_layers

    def build(i: int) -> Candidate:
        a, e, o, x = combos[i]
        return Candidate("colocated", Segment.of(*e, Le), (Segment.of(*a, L, ep=x),), offload=o)

    pool.add(total, build, "colocated")
    return len(combos)


def _chains(wl: Workload, world_llm: int, space: SearchSpace) -> list[tuple]:
    """LLM chains on an island: (tp_a, cp, pp_a, dp_a, n_a, tp_b, pp_b, dp_b, n_b); n_b = 0: one segment."""
    llm, L, G, m = wl.llm, wl.llm.num_layers, wl.global_batch, wl.micro_batch
    rows = [
        (t, c, p, d, L, 0, 0, 0, 0)
        for t, c, p, d in _layouts(world_llm, space.tp, space.cp, space.pp, llm, True, space.runtime)
        if G % (m * d) == 0 and (not space.runtime or G // (m * d) <= MAX_MICRO_BATCHES)
    ]
    if space.max_segments >= 2 and world_llm % 2 == 0:
        half = _layouts(world_llm // 2, space.tp, space.cp, space.pp, llm, True)
        if space.runtime:
            # the runtime's segments: any two different TP/PP/DP (one DP dividing the other), every
            # stage of a segment holding the same number of layers, at most MAX_MICRO_BATCHES
            # micro-batches (the disjoint schedule's tables)
            by_cp: dict[int, list[tuple[int, int, int]]] = {}
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
        by: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for t, c, p, d in half:
            by.setdefault((c, p), []).append((t, d))
        for (c, p), pairs in by.items():
            for (ta, da), (tb, db) in itertools.permutations(pairs, 2):  # two different strategies
                hi, lo = max(da, db), min(da, db)
                if hi % lo or G % (m * hi):
                    continue
                for na in range(p, L - p + 1):
                    rows.append((ta, c, p, da, na, tb, p, db, L - na))
    return rows


def _disjoint(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, groups: list) -> int:
    """Prepare the disjoint groups (encoder rows x chain rows sharing the pipeline micro-batch M,
    the LLM's stage count and the first segment's dp): each side's aggregates (`planner.step.Side`) and
    memory; rows over the memory limit are dropped. Returns the number of valid (encoder, chain)
    pairs."""
    enc, G, m = wl.encoder, wl.global_batch, wl.micro_batch
    loss = float(loss_reduce(prof, world))
    size = 0
    for we in space.islands(world):
        enc_rows = _layouts(we, space.encoder_tp, space.encoder_cp, space.encoder_pp, enc, False, space.runtime)
        rows = _chains(wl, world - we, space)
        if not enc_rows or not rows:
            continue
        ch = np.array(rows, dtype=np.int64)
        ta, cp, pa, da, na, tb, pb, db, nb = (ch[:, i] for i in range(9))
        M = m * np.maximum(da, np.where(nb > 0, db, 1))
        b = G // M
        P_llm = pa + pb
        chain, c_mem = PL.llm_chain(prof, wl, [(ta, cp, pa, da, na), (tb, cp, pb, db, nb)], world)
        key = chain.sum + (b - 1) * chain.max + chain.tail + loss
        ok = c_mem <= limit
        er = np.array(enc_rows, dtype=np.int64)
        etp, ecp, epp, edp = (er[:, i] for i in range(4))
        uniq, inv = np.unique(np.stack([M, P_llm, da], axis=1), axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        esels = [
            np.nonzero((Mg % edp == 0) & ((np.maximum(edp, dag) % np.minimum(edp, dag)) == 0))[0] for Mg, _, dag in uniq
        ]
        # every group's encoder rows in one evaluator call
        rows_e = np.concatenate(esels)
        rep = np.repeat(np.arange(len(uniq)), [len(x) for x in esels])
        eside_all, e_mem_all = PL.encoder_island(
            prof, wl, etp[rows_e], ecp[rows_e], epp[rows_e], edp[rows_e], uniq[rep, 0], uniq[rep, 1]
        )
        starts = np.cumsum([0] + [len(x) for x in esels])
        for gi, (Mg, _Pg, _dag) in enumerate(uniq):
            sel, esel = np.nonzero(inv == gi)[0], esels[gi]
            if not len(esel):
                continue
            size += len(sel) * len(esel)
            at = np.arange(starts[gi], starts[gi + 1])
            eok = np.nonzero(e_mem_all[at] <= limit)[0]
            eside = eside_all.rows(at, full=False)
            csel = sel[ok[sel]]
            if not len(csel) or not len(eok):
                continue
            csel = csel[np.argsort(key[csel], kind="stable")]
            groups.append(
                dict(
                    we=we,
                    b=int(G // Mg),
                    rows=rows,
                    enc_rows=enc_rows,
                    cidx=csel,
                    ckey=key[csel],
                    chain=chain.rows(csel, full=False),
                    eidx=esel[eok],
                    enc=eside.rows(eok, full=False),
                )
            )
    return size


def _pairs(
    gr: dict, prof: Profile, wl: Workload, world: int, tau: float, probe: Optional[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(encoder positions, chain positions, step times) of the pairs to evaluate in group `gr`: the
    first `probe` chains per encoder, or every chain with E_sum + K(c) <= tau / uncontended."""
    nE, nC = len(gr["eidx"]), len(gr["cidx"])
    if probe is not None:
        cnt = np.full(nE, min(probe, nC))
    else:
        # slack: when the bound is tight it equals the step time up to rounding
        cnt = np.searchsorted(gr["ckey"], tau / prof.uncontended * (1 + 1e-9) - gr["enc"].sum, side="right")
    ei = np.repeat(np.arange(nE), cnt)
    starts = np.cumsum(cnt) - cnt
    ci = np.arange(int(cnt.sum())) - np.repeat(starts, cnt)
    enc, chain = gr["enc"].rows(ei, full=False), gr["chain"].rows(ci, full=False)
    tot = PL.disjoint(prof, wl, enc, chain, world, gr["b"], full=False)
    return ei, ci, np.asarray(tot, dtype=float)


def _chain_candidate(gr: dict, e: int, c: int, wl: Workload) -> Candidate:
    et, ec, ep, ed = gr["enc_rows"][gr["eidx"][e]]
    ta, cp, pa, da, na, tb, pb, db, nb = gr["rows"][gr["cidx"][c]]
    segs = (Segment.of(ta, cp, pa, da, na),) + ((Segment.of(tb, cp, pb, db, nb),) if nb else ())
    return Candidate("disjoint", Segment.of(et, ec, ep, ed, wl.encoder.num_layers), segs, encoder_ranks=gr["we"])


def search(
    wl: Workload,
    prof: Profile,
    world_size: int,
    memory_limit: Optional[float] = None,
    space: SearchSpace = SearchSpace(),
    top: int = 10,
    prune: bool = True,
) -> SearchResult:
    """Rank the configurations of `space` on `world_size` ranks by predicted step time.

    memory_limit: bytes per rank (default: 90% of the profile's device memory). Returns the `top`
    best with their `CostBreakdown`, the best homogeneous one (baseline) and the best per placement.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    unknown = sorted(set(space.placements) - set(PLACEMENT_KINDS))
    if unknown:
        raise ValueError(f"unknown placements {unknown}; choose from {list(PLACEMENT_KINDS)}")
    limit = 0.9 * prof.memory_bytes if memory_limit is None else float(memory_limit)
    space = space.effective()
    t0 = time.perf_counter()
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
            _, _, tot = _pairs(gr, prof, wl, world_size, INF, top)
            evaluated += len(tot)
            exact.append(tot[np.isfinite(tot)])
            best_disjoint = min(best_disjoint, float(tot.min()))
        allv = np.concatenate(exact)
        if len(allv) >= top:
            # the K-th best value seen bounds the true K-th best; the best disjoint value seen
            # bounds the best disjoint candidate (reported per placement)
            tau = max(float(np.partition(allv, top - 1)[top - 1]), best_disjoint)
    for _gi, gr in enumerate(groups):
        ei, ci, tot = _pairs(gr, prof, wl, world_size, tau, None)
        evaluated += len(tot)
        keep = tot <= tau if np.isfinite(tau) else np.isfinite(tot)
        if prune:
            ei, ci, tot = ei[keep], ci[keep], tot[keep]
        else:  # keep the group's best `top` only
            if len(tot) > top:
                part = np.argpartition(tot, top - 1)[:top]
                ei, ci, tot = ei[part], ci[part], tot[part]
        pool.add(tot, (lambda g, a, c: lambda i: _chain_candidate(g, int(a[i]), int(c[i]), wl))(gr, ei, ci), "disjoint")
    ranked, by_placement = _rank(pool, wl, prof, top)
    if not ranked:
        raise ValueError(
            f"no configuration of {wl.encoder.name} + {wl.llm.name} on {world_size} ranks fits the "
            f"memory limit of {limit / 1e9:.1f} GB per rank (or none divides global batch "
            f"{wl.global_batch} with micro-batch {wl.micro_batch})"
        )
    baseline = (
        _runtime_baseline(wl, prof, world_size, space, limit) if space.runtime else by_placement.get("homogeneous")
    )
    return SearchResult(
        ranked=ranked,
        baseline=baseline,
        evaluated=evaluated,
        space_size=size,
        seconds=time.perf_counter() - t0,
        world_size=world_size,
        memory_limit=limit,
        by_placement=by_placement,
    )


def _runtime_baseline(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float) -> Optional[Ranked]:
    """The runtime's homogeneous baseline: the best colocated candidate whose encoder runs on the
    LLM's own layout (cp = 1: the runtime's encoders do not take CP)."""
    best = None
    for t, c, p, d in _layouts(world, space.tp, (1,), space.pp, wl.llm, True, True):
        if wl.encoder.heads % t or wl.encoder.num_layers % p:
            continue
        cand = Candidate(
            "colocated", Segment.of(t, c, p, d, wl.encoder.num_layers), (Segment.of(t, c, p, d, wl.llm.num_layers),)
        )
        try:
            bd = evaluate(cand, wl, prof)
        except ValueError:
            continue
        if bd.memory_per_rank_peak <= limit and (best is None or bd.total < best.breakdown.total):
            best = Ranked(cand, bd)
    return best


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
        return Ranked(cand, evaluate(cand, wl, prof))

    ranked = [make(j) for j in order[:top]]
    kinds = np.array(pool.placement)[src[order]]
    by_placement = {}
    for kind in PLACEMENT_KINDS:
        hit = np.nonzero(kinds == kind)[0]
        if len(hit):
            by_placement[kind] = make(order[hit[0]])
    return ranked, by_placement
