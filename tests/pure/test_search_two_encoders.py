"""`search` with a second encoder gives it its own layout: the search's ranking over a small space
equals a brute force that builds every candidate itself and prices it with the one-row evaluator."""

from __future__ import annotations

import functools
import itertools

import pytest

from megatron_hetero.planner import hardware as HW
from megatron_hetero.planner.cost import evaluate
from megatron_hetero.planner.search import search
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.workload import Candidate, ModelSpec, Segment, Workload

pytestmark = pytest.mark.pure

VISION = ModelSpec("vision", 2, 64, 256, 4, 16, kind="encoder")
AUDIO = ModelSpec("audio", 1, 128, 512, 4, 30, kind="encoder")  # 1 layer: no pp 2; 2 chunks of 30 tokens a clip
LLM = ModelSpec("language", 4, 64, 256, 4, 128, kind="llm", vocab=256)
WL = Workload(VISION, LLM, global_batch=8, micro_batch=1, extra_encoders=(AUDIO,), extra_inputs=(2,))
PROF = HW.Profile(
    layers={"llm": HW.LayerModel(1e-4, 1e-12), "encoder": HW.LayerModel(5e-5, 2e-12)},
    links={"intra": HW.AlphaBeta(2e-6, 1e-10), "inter": HW.AlphaBeta(1e-5, 1e-9)},
    devices_per_node=8,
    memory_bytes=1e12,
)
SPACE = SearchSpace(tp=(1, 2), cp=(1,), pp=(1, 2), encoder_tp=(1, 2), encoder_pp=(1, 2), max_segments=1)
WORLD = 4


def _layouts(n: int, spec: ModelSpec, tps, pps):
    return [
        (t, 1, p, n // (t * p))
        for t in tps
        for p in pps
        if n % (t * p) == 0 and spec.heads % t == 0 and spec.num_layers >= p
    ]


def _aligned(a: int, b: int) -> bool:
    return max(a, b) % min(a, b) == 0


@functools.cache
def _brute() -> tuple:
    """Every candidate of SPACE on WORLD ranks, built here, each priced by `evaluate`: (step time,
    memory peak, candidate), fastest first."""
    G, m, L = WL.global_batch, WL.micro_batch, LLM.num_layers
    out = []
    for t, c, p, d in _layouts(WORLD, LLM, SPACE.tp, SPACE.pp):
        if G % (m * d):
            continue
        llm = (Segment.of(t, c, p, d, L),)
        if all(e.heads % t == 0 and e.num_layers >= p for e in WL.encoders):  # homogeneous
            for first in range(1, L - p + 2) if p > 1 else (0,):
                same = [Segment.of(t, c, p, d, e.num_layers) for e in WL.encoders]
                out.append(Candidate("homogeneous", same[0], llm, first_stage_layers=first, extra_encoders=(same[1],)))
        for v, a in itertools.product(
            *(_layouts(WORLD, e, SPACE.encoder_tp, SPACE.encoder_pp) for e in WL.encoders)
        ):  # colocated, each encoder its own layout
            if G % v[3] or G % a[3] or not (_aligned(v[3], d) and _aligned(a[3], d)):
                continue
            for off in (False, True):
                out.append(
                    Candidate(
                        "colocated",
                        Segment.of(*v, VISION.num_layers),
                        llm,
                        offload=off,
                        extra_encoders=(Segment.of(*a, AUDIO.num_layers),),
                    )
                )
    for wv, wa in itertools.product(SPACE.islands(WORLD), repeat=2):  # disjoint: an island each
        rest = WORLD - wv - wa
        for t, c, p, d in _layouts(rest, LLM, SPACE.tp, SPACE.pp) if rest > 0 else []:
            if G % (m * d):
                continue
            for v, a in itertools.product(
                _layouts(wv, VISION, SPACE.encoder_tp, SPACE.encoder_pp),
                _layouts(wa, AUDIO, SPACE.encoder_tp, SPACE.encoder_pp),
            ):
                if all((m * d) % e[3] == 0 and _aligned(e[3], d) for e in (v, a)):
                    out.append(
                        Candidate(
                            "disjoint",
                            Segment.of(*v, VISION.num_layers),
                            (Segment.of(t, c, p, d, L),),
                            encoder_ranks=wv,
                            extra_encoders=(Segment.of(*a, AUDIO.num_layers),),
                        )
                    )
    priced = ((evaluate(c, WL, PROF), c) for c in out)
    return tuple(sorted(((b.total, b.memory_per_rank_peak, c) for b, c in priced), key=lambda x: x[0]))


@pytest.mark.parametrize("limit", [None, "tight"])
def test_search_with_two_encoders_equals_brute_force(limit):
    every = _brute()
    assert {c.placement for _, _, c in every} == {"homogeneous", "colocated", "disjoint"} and len(every) > 50
    peaks = sorted(peak for _, peak, _ in every)
    mem_limit = None if limit is None else peaks[len(peaks) // 2]  # rules out half the candidates
    brute = [(t, c) for t, peak, c in every if mem_limit is None or peak <= mem_limit]
    res = search(WL, PROF, WORLD, memory_limit=mem_limit, space=SPACE, top=5)
    assert res.space_size == len(every)
    assert [r.breakdown.total for r in res.ranked] == pytest.approx([t for t, _ in brute[:5]], rel=1e-12)
    assert res.best.breakdown.total == pytest.approx(brute[0][0], rel=1e-12)
    assert len(res.best.candidate.extra_encoders) == 1
    for kind in ("homogeneous", "colocated", "disjoint"):
        of_kind = [t for t, c in brute if c.placement == kind]
        assert (kind in res.by_placement) == bool(of_kind)
        if of_kind:
            assert res.by_placement[kind].breakdown.total == pytest.approx(min(of_kind), rel=1e-12)


def test_the_pick_runs_as_a_two_encoder_layout():
    res = search(WL, PROF, WORLD, space=SearchSpace(tp=(1, 2), cp=(1,), pp=(1, 2), runtime=True), top=3)
    lay = res.best.candidate.to_layout()
    assert {"vision", "audio"} <= set(lay.names)
    assert sum(1 for e in lay.edges if e.dst.startswith("language")) >= 2
