"""The interval routing (per-rank and whole-edge boundary plans) against the all-pairs reference
(tests/allpairs_route.py): the same transfers, the same sources, the same order, for every rank of
every example layout and of seeded random layouts (both placements, tp/cp/dp/pp, dst_seq/dst_offset).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from allpairs_route import allpairs, of_rank
from megatron_hetero.layout import HeteroLayout, layout_from_dict, load_layout
from megatron_hetero.plan.boundary import BoundaryShape, plan_boundary
from megatron_hetero.plan.boundary_rank import BoundaryPlanCache, plan_rank_boundary
from megatron_hetero.plan.interval_route import Side, message_counts
from megatron_hetero.report.plan import default_shape

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "layouts").glob("*.yaml"))


def _check_edge(layout: HeteroLayout, edge, shape: BoundaryShape) -> int:
    """Whole plan and every rank's plan of `edge` equal the reference; returns the pieces compared."""
    ref = allpairs(layout, edge, shape)
    whole = plan_boundary(layout, edge, shape)
    assert list(whole.forward) == ref["forward"] and list(whole.backward) == ref["backward"]
    assert whole.holds == ref["holds"] and whole.needs == ref["needs"]
    assert (whole.min_bytes_forward, whole.min_bytes_backward) == (ref["min_forward"], ref["min_backward"])
    # the direct route moves exactly the minimum; messages and peers as counted on the reference
    assert (whole.planned_bytes("forward"), whole.planned_bytes("backward")) == (
        ref["min_forward"],
        ref["min_backward"],
    )
    src_side, dst_side = Side.source(layout.module(edge.src), shape), Side.destination(layout.module(edge.dst), shape)
    for needers, holders, transfers in ((dst_side, src_side, ref["forward"]), (src_side, dst_side, ref["backward"])):
        pairs = {(t.src, t.dst) for t in transfers if not t.local}
        peers: dict[int, set] = {}
        for a, b in pairs:
            peers.setdefault(a, set()).add(b)
            peers.setdefault(b, set()).add(a)
        assert message_counts(needers, holders) == (len(pairs), max((len(p) for p in peers.values()), default=0))
    for r in range(layout.world_size):
        mine = plan_rank_boundary(layout, edge, shape, r)
        assert mine.is_src == (r in ref["holds"]) and mine.is_dst == (r in ref["needs"])
        assert mine.holds == ref["holds"].get(r, ()) and mine.needs == ref["needs"].get(r, ())
        for direction in ("forward", "backward"):
            sends, recvs, local = of_rank(ref[direction], r)
            got = (mine.sends(direction), mine.recvs(direction), mine.local_copies(direction))
            assert got == (sends, recvs, local), (str(edge), shape, r, direction)
            assert (whole.sends(r, direction), whole.recvs(r, direction), whole.local_copies(r, direction)) == got
    return len(ref["forward"]) + len(ref["backward"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_layouts_route_as_all_pairs(path: Path) -> None:
    layout = load_layout(path)
    base = default_shape(layout)
    shapes = [base, BoundaryShape(base.batch * 2, base.seq * 3, 2, 2)]
    for edge in layout.edges:
        dst = layout.module(edge.dst)
        # image tokens inside a longer destination sequence, at an offset that cuts the CP chunks
        unit = 2 * dst.cp if dst.cp > 1 else 1
        shapes.append(BoundaryShape(base.batch, base.seq, 3, dst_seq=unit * (base.seq + 5), dst_offset=3))
        for shape in shapes:
            assert _check_edge(layout, edge, shape) > 0


def _factor(n: int, rng: random.Random) -> dict[str, int]:
    """Random tp, cp, pp, dp with tp*cp*pp*dp == n."""
    out = {"tp": 1, "cp": 1, "pp": 1, "dp": 1}
    axes = list(out)
    for p in _primes(n):
        out[rng.choice(axes)] *= p
    return out


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _random_layout(rng: random.Random) -> HeteroLayout:
    placement = rng.choice(["colocated", "disjoint"])
    names = ["vision", "audio", "language"][: rng.choice([2, 3])]
    if placement == "colocated":
        world = rng.choice([2, 4, 6, 8, 12, 16])
        mods = {n: _factor(world, rng) for n in names}
    else:
        mods = {n: _factor(rng.choice([1, 2, 3, 4, 6, 8]), rng) for n in names}
    lang = names[-1]
    edges = [f"{n} -> {lang}" for n in names[:-1]]
    for n in names[:-1]:  # fan factors must be integers: make the smaller dp divide the larger
        a, b = mods[n]["dp"], mods[lang]["dp"]
        if max(a, b) % min(a, b):
            return _random_layout(rng)
    return layout_from_dict({"placement": placement, "modules": mods, "edges": edges})


def _random_shape(layout: HeteroLayout, edge, rng: random.Random) -> BoundaryShape:
    src, dst = layout.module(edge.src), layout.module(edge.dst)
    batch = math.lcm(src.dp, dst.dp) * rng.choice([1, 2, 3])
    seq_unit = 2 * src.cp if src.cp > 1 else 1
    if rng.random() < 0.5:
        seq_unit = math.lcm(seq_unit, 2 * dst.cp if dst.cp > 1 else 1)
        return BoundaryShape(batch, seq_unit * rng.choice([1, 2, 3]), rng.choice([1, 4]), rng.choice([2, 4]))
    seq = seq_unit * rng.choice([1, 2, 5])
    offset = rng.randrange(0, 3 * seq)
    unit = 2 * dst.cp if dst.cp > 1 else 1
    dst_seq = unit * -(-(offset + seq + rng.randrange(0, 2 * seq)) // unit)
    return BoundaryShape(batch, seq, 2, dst_seq=dst_seq, dst_offset=offset)


def test_random_layouts_route_as_all_pairs() -> None:
    rng = random.Random(1234)
    pieces = 0
    for _ in range(120):
        layout = _random_layout(rng)
        for edge in layout.edges:
            pieces += _check_edge(layout, edge, _random_shape(layout, edge, rng))
    assert pieces > 1000  # the loop compared real routes


def test_cache_plans_once_per_edge_and_shape() -> None:
    layout = load_layout(REPO / "examples" / "layouts" / "colocated_fan_in.yaml")
    edge, shape = layout.edges[0], default_shape(layout)
    cache = BoundaryPlanCache(layout, 3)
    first = cache.get(edge, shape)
    assert cache.get(edge, shape) is first and len(cache) == 1
    assert cache.get(edge, BoundaryShape(shape.batch, shape.seq * 2, shape.hidden)) is not first and len(cache) == 2
    assert first == plan_rank_boundary(layout, edge, shape, 3)


def test_rank_plan_of_a_large_world_is_its_own_share() -> None:
    """Rank 0 of a 65,536-rank colocated layout: its pieces only (32 vision shards into one language
    rank), computed without the other ranks' plans."""
    world = 1 << 16
    layout = layout_from_dict(
        {
            "placement": "colocated",
            "modules": {"vision": {"dp": world}, "language": {"tp": 8, "pp": 4, "dp": world // 32}},
            "edges": ["vision -> language"],
        }
    )
    shape = BoundaryShape(world, 8, 4)
    p = plan_rank_boundary(layout, layout.edges[0], shape, 0)
    assert p.is_src and p.is_dst and p.transform == "fan-in" and p.factor == 32
    assert [t.block.b0 for t in p.local_copies()] == [0]
    assert [t.src for t in p.recvs()] == list(range(1, 32))  # vision dp rank d holds sample d
    # it sends its sample to the 7 other TP replicas of language dp 0 (ranks 1-7)
    assert [t.dst for t in p.sends()] == list(range(1, 8))
    last = plan_rank_boundary(layout, layout.edges[0], shape, world - 1)
    assert last.is_src and not last.is_dst and last.recvs() == [] and last.local_copies() == []
    # its sample W-1 goes to the 8 TP replicas of language dp (W-1)//32 = 2047: ranks 16376-16383
    assert [(t.dst, t.block.b0) for t in last.sends()] == [(8 * 2047 + t, world - 1) for t in range(8)]
    # backward: the last vision rank's sample comes from language dp 2047, replica pick % 8
    (g,) = last.recvs("backward")
    # (language dp (W-1)//32 = 2047, TP replica (W-1) % 8 = 7: rank 7 + 8*2047, the stage's last)
    assert g.block.b0 == world - 1 and g.src == 7 + 8 * 2047 == world // 4 - 1
