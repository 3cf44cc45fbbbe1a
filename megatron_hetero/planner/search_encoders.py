"""The layout search's disjoint candidates with several encoders (`Workload.extra_encoders`, e.g. a
vision and a speech encoder): every encoder on an island of its own (every combination of island
sizes and of each encoder's layouts on its island), the language model as a chain of one or two
segments (`search_disjoint._chains`) on the world's other ranks. Every combination is scored by the
batched evaluator (`placements.encoder_islands`, `llm_chain`, `disjoint`): exhaustive, no pruning.
Pure (numpy only).
"""

from __future__ import annotations

import itertools

import numpy as np

from megatron_hetero.planner import placements as PL
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.search_disjoint import _chains
from megatron_hetero.planner.search_rows import _layouts, _Pool
from megatron_hetero.planner.search_space import INF, SearchSpace
from megatron_hetero.planner.workload import Candidate, Segment, Workload

#: rows scored per evaluator call (bounds the arrays' memory)
BLOCK = 50_000


def _fits(edp: int, M: int, da: int) -> bool:
    """An encoder of dp `edp` splits the micro-batch of M samples and lines up with the first segment's dp."""
    return M % edp == 0 and max(edp, da) % min(edp, da) == 0


def disjoint_islands(wl: Workload, prof: Profile, world: int, space: SearchSpace, limit: float, pool: _Pool) -> int:
    """Score every disjoint candidate of `wl`'s encoders (module docstring) into `pool`; returns how
    many were scored (candidates over the memory limit score inf)."""
    m, n_enc = wl.micro_batch, len(wl.encoders)
    sizes = space.islands(world)
    rows: list[tuple] = []  # (island sizes, encoder rows, chain row)
    for islands in itertools.product(sizes, repeat=n_enc):
        rest = world - sum(islands)
        if rest < 1:
            continue
        chains = _chains(wl, rest, space)
        enc_rows = [
            _layouts(w, space.encoder_tp, space.encoder_cp, space.encoder_pp, spec, False, space.runtime)
            for w, spec in zip(islands, wl.encoders)
        ]
        for ch in chains:
            da, db, nb = ch[3], ch[7], ch[8]
            M = m * max(da, db if nb else 1)
            options = [[r for r in er if _fits(r[3], M, da)] for er in enc_rows]
            rows += [(islands, es, ch) for es in itertools.product(*options)]
    if not rows:
        return 0
    totals = np.full(len(rows), INF)
    for lo in range(0, len(rows), BLOCK):
        totals[lo : lo + BLOCK] = _score(wl, prof, world, limit, rows[lo : lo + BLOCK])

    def build(i: int) -> Candidate:
        islands, es, (ta, cp, pa, da, na, tb, pb, db, nb) = rows[i]
        segs = [Segment.of(e[0], e[1], e[2], e[3], spec.num_layers) for e, spec in zip(es, wl.encoders)]
        llm = (Segment.of(ta, cp, pa, da, na),) + ((Segment.of(tb, cp, pb, db, nb),) if nb else ())
        return Candidate("disjoint", segs[0], llm, encoder_ranks=islands[0], extra_encoders=tuple(segs[1:]))

    pool.add(totals, build, "disjoint")
    return len(rows)


def _score(wl: Workload, prof: Profile, world: int, limit: float, rows: list) -> np.ndarray:
    """Step times of `rows` (inf over the memory limit)."""
    ch = np.array([r[2] for r in rows], dtype=np.int64)
    ta, cp, pa, da, na, tb, pb, db, nb = (ch[:, i] for i in range(9))
    M = wl.micro_batch * np.maximum(da, np.where(nb > 0, db, 1))
    b = wl.global_batch // M
    chain, c_mem = PL.llm_chain(prof, wl, [(ta, cp, pa, da, na), (tb, cp, pb, db, nb)], world)
    degrees = []
    for j in range(len(wl.encoders)):
        e = np.array([r[1][j] for r in rows], dtype=np.int64)
        degrees.append(tuple(e[:, k] for k in range(4)))
    enc, e_mem = PL.encoder_islands(prof, wl, degrees, M, pa + pb)
    tot = np.asarray(PL.disjoint(prof, wl, enc, chain, world, b, full=False), dtype=float)
    return np.where(np.maximum(e_mem, c_mem) <= limit, tot, INF)
