"""Per-rank placement: golden rank tables and cross-checks against Megatron-core's own enumerations.

The golden tables below are written out by hand (Megatron's default order tp fastest, then cp, dp,
pp; expert grid expt_tp fastest, then ep, then expert-dp inside a pipeline stage); they are not
computed by the code under test.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.parallel_state import RankGenerator
from megatron_hetero.layout import ModuleLayout, RankRange, layout_from_dict
from megatron_hetero.plan.placement import Coord, coord_of, group_ranks, rank_map, rank_of, stage_ranks

# Each case: (layout document, {rank: {module: (tp, cp, dp, pp) or (tp, cp, dp, pp, ep, expt_tp)}}).
GOLDEN = {
    "w2-colocated-tp2-vs-dp2": (
        {"placement": "colocated", "modules": {"a": {"tp": 2}, "b": {"dp": 2}}},
        {0: {"a": (0, 0, 0, 0), "b": (0, 0, 0, 0)}, 1: {"a": (1, 0, 0, 0), "b": (0, 0, 1, 0)}},
    ),
    "w3-colocated-dp3-vs-tp3": (
        {"placement": "colocated", "modules": {"a": {"dp": 3}, "b": {"tp": 3}}, "edges": ["a->b"]},
        {
            0: {"a": (0, 0, 0, 0), "b": (0, 0, 0, 0)},
            1: {"a": (0, 0, 1, 0), "b": (1, 0, 0, 0)},
            2: {"a": (0, 0, 2, 0), "b": (2, 0, 0, 0)},
        },
    ),
    "w6-disjoint-fan-out-cp2": (
        {
            "placement": "disjoint",
            "modules": {"vision": {"tp": 2}, "language": {"cp": 2, "dp": 2}},
            "edges": ["vision->language"],
        },
        {
            0: {"vision": (0, 0, 0, 0)},
            1: {"vision": (1, 0, 0, 0)},
            2: {"language": (0, 0, 0, 0)},
            3: {"language": (0, 1, 0, 0)},
            4: {"language": (0, 0, 1, 0)},
            5: {"language": (0, 1, 1, 0)},
        },
    ),
    "w8-colocated-fan-in-pp2": (
        {
            "placement": "colocated",
            "modules": {"vision": {"dp": 8}, "language": {"tp": 2, "pp": 2, "dp": 2}},
            "edges": ["vision->language"],
        },
        {
            0: {"vision": (0, 0, 0, 0), "language": (0, 0, 0, 0)},
            1: {"vision": (0, 0, 1, 0), "language": (1, 0, 0, 0)},
            2: {"vision": (0, 0, 2, 0), "language": (0, 0, 1, 0)},
            3: {"vision": (0, 0, 3, 0), "language": (1, 0, 1, 0)},
            4: {"vision": (0, 0, 4, 0), "language": (0, 0, 0, 1)},
            5: {"vision": (0, 0, 5, 0), "language": (1, 0, 0, 1)},
            6: {"vision": (0, 0, 6, 0), "language": (0, 0, 1, 1)},
            7: {"vision": (0, 0, 7, 0), "language": (1, 0, 1, 1)},
        },
    ),
    "w8-disjoint-encoder-pp2": (
        {
            "placement": "disjoint",
            "modules": {"vision": {"pp": 2, "dp": 2}, "language": {"tp": 2, "pp": 2}},
            "edges": ["vision->language"],
        },
        {
            0: {"vision": (0, 0, 0, 0)},
            1: {"vision": (0, 0, 1, 0)},
            2: {"vision": (0, 0, 0, 1)},
            3: {"vision": (0, 0, 1, 1)},
            4: {"language": (0, 0, 0, 0)},
            5: {"language": (1, 0, 0, 0)},
            6: {"language": (0, 0, 0, 1)},
            7: {"language": (1, 0, 0, 1)},
        },
    ),
    "w8-colocated-moe-etp2-ep2-pp2": (
        {
            "placement": "colocated",
            "modules": {"enc": {"dp": 8}, "language": {"tp": 2, "dp": 2, "pp": 2, "ep": 2, "expt_tp": 2}},
        },
        {
            0: {"enc": (0, 0, 0, 0), "language": (0, 0, 0, 0, 0, 0)},
            1: {"enc": (0, 0, 1, 0), "language": (1, 0, 0, 0, 0, 1)},
            2: {"enc": (0, 0, 2, 0), "language": (0, 0, 1, 0, 1, 0)},
            3: {"enc": (0, 0, 3, 0), "language": (1, 0, 1, 0, 1, 1)},
            4: {"enc": (0, 0, 4, 0), "language": (0, 0, 0, 1, 0, 0)},
            5: {"enc": (0, 0, 5, 0), "language": (1, 0, 0, 1, 0, 1)},
            6: {"enc": (0, 0, 6, 0), "language": (0, 0, 1, 1, 1, 0)},
            7: {"enc": (0, 0, 7, 0), "language": (1, 0, 1, 1, 1, 1)},
        },
    ),
    "w8-colocated-moe-cp2-dp4-ep4": (
        {"placement": "colocated", "modules": {"language": {"cp": 2, "dp": 4, "ep": 4}}},
        {
            0: {"language": (0, 0, 0, 0, 0, 0)},
            1: {"language": (0, 1, 0, 0, 1, 0)},
            2: {"language": (0, 0, 1, 0, 2, 0)},
            3: {"language": (0, 1, 1, 0, 3, 0)},
            4: {"language": (0, 0, 2, 0, 0, 0)},
            5: {"language": (0, 1, 2, 0, 1, 0)},
            6: {"language": (0, 0, 3, 0, 2, 0)},
            7: {"language": (0, 1, 3, 0, 3, 0)},
        },
    ),
    "w12-disjoint-three-islands-out-of-order": (
        {
            "placement": "disjoint",
            "modules": {
                "vision": {"dp": 2, "ranks": "10-11"},
                "audio": {"tp": 2, "ranks": "8-9"},
                "language": {"tp": 2, "cp": 2, "dp": 2, "ranks": "0-7"},
            },
            "edges": ["vision->language", "audio->language"],
        },
        {
            0: {"language": (0, 0, 0, 0)},
            1: {"language": (1, 0, 0, 0)},
            2: {"language": (0, 1, 0, 0)},
            3: {"language": (1, 1, 0, 0)},
            4: {"language": (0, 0, 1, 0)},
            5: {"language": (1, 0, 1, 0)},
            6: {"language": (0, 1, 1, 0)},
            7: {"language": (1, 1, 1, 0)},
            8: {"audio": (0, 0, 0, 0)},
            9: {"audio": (1, 0, 0, 0)},
            10: {"vision": (0, 0, 0, 0)},
            11: {"vision": (0, 0, 1, 0)},
        },
    ),
    "w16-colocated-tp2-cp2-dp2-pp2-vs-tp4-dp4": (
        {
            "placement": "colocated",
            "modules": {"a": {"tp": 2, "cp": 2, "dp": 2, "pp": 2}, "b": {"tp": 4, "dp": 4}},
            "edges": ["a->b"],
        },
        {
            0: {"a": (0, 0, 0, 0), "b": (0, 0, 0, 0)},
            1: {"a": (1, 0, 0, 0), "b": (1, 0, 0, 0)},
            2: {"a": (0, 1, 0, 0), "b": (2, 0, 0, 0)},
            3: {"a": (1, 1, 0, 0), "b": (3, 0, 0, 0)},
            4: {"a": (0, 0, 1, 0), "b": (0, 0, 1, 0)},
            5: {"a": (1, 0, 1, 0), "b": (1, 0, 1, 0)},
            6: {"a": (0, 1, 1, 0), "b": (2, 0, 1, 0)},
            7: {"a": (1, 1, 1, 0), "b": (3, 0, 1, 0)},
            8: {"a": (0, 0, 0, 1), "b": (0, 0, 2, 0)},
            9: {"a": (1, 0, 0, 1), "b": (1, 0, 2, 0)},
            10: {"a": (0, 1, 0, 1), "b": (2, 0, 2, 0)},
            11: {"a": (1, 1, 0, 1), "b": (3, 0, 2, 0)},
            12: {"a": (0, 0, 1, 1), "b": (0, 0, 3, 0)},
            13: {"a": (1, 0, 1, 1), "b": (1, 0, 3, 0)},
            14: {"a": (0, 1, 1, 1), "b": (2, 0, 3, 0)},
            15: {"a": (1, 1, 1, 1), "b": (3, 0, 3, 0)},
        },
    ),
    "w16-disjoint-moe-pp3": (
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 4}, "language": {"tp": 2, "dp": 2, "pp": 3, "ep": 4}},
            "edges": ["vision->language"],
        },
        {
            0: {"vision": (0, 0, 0, 0)},
            1: {"vision": (0, 0, 1, 0)},
            2: {"vision": (0, 0, 2, 0)},
            3: {"vision": (0, 0, 3, 0)},
            4: {"language": (0, 0, 0, 0, 0, 0)},
            5: {"language": (1, 0, 0, 0, 1, 0)},
            6: {"language": (0, 0, 1, 0, 2, 0)},
            7: {"language": (1, 0, 1, 0, 3, 0)},
            8: {"language": (0, 0, 0, 1, 0, 0)},
            9: {"language": (1, 0, 0, 1, 1, 0)},
            10: {"language": (0, 0, 1, 1, 2, 0)},
            11: {"language": (1, 0, 1, 1, 3, 0)},
            12: {"language": (0, 0, 0, 2, 0, 0)},
            13: {"language": (1, 0, 0, 2, 1, 0)},
            14: {"language": (0, 0, 1, 2, 2, 0)},
            15: {"language": (1, 0, 1, 2, 3, 0)},
        },
    ),
}


def _coord(t: tuple) -> Coord:
    tp, cp, dp, pp, ep, etp = (tuple(t) + (0, 0))[:6]
    return Coord(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, expt_tp=etp)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden_rank_table(name: str) -> None:
    doc, table = GOLDEN[name]
    layout = layout_from_dict(doc)
    assert layout.world_size == len(table)
    got = {e.rank: e.modules for e in rank_map(layout)}
    want = {r: {m: _coord(c) for m, c in mods.items()} for r, mods in table.items()}
    assert got == want
    # rank_of is the inverse on the golden coordinates.
    for r, mods in table.items():
        for mname, c in mods.items():
            m = layout.module(mname)
            assert rank_of(m, tp=c[0], cp=c[1], dp=c[2], pp=c[3]) == r
            assert coord_of(m, r) == _coord(c)


def test_golden_groups_and_stages() -> None:
    layout = layout_from_dict(GOLDEN["w8-colocated-fan-in-pp2"][0])
    lang = layout.module("language")
    assert group_ranks(lang, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(lang, ["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(lang, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(lang, "cp") == [[r] for r in range(8)]
    assert group_ranks(lang, ["tp", "dp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stage_ranks(lang, 0) == [0, 1, 2, 3] and stage_ranks(lang, 1) == [4, 5, 6, 7]
    assert group_ranks(layout.module("vision"), "dp") == [list(range(8))]

    layout = layout_from_dict(GOLDEN["w12-disjoint-three-islands-out-of-order"][0])
    lang = layout.module("language")
    assert group_ranks(lang, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(lang, ["cp", "dp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert group_ranks(layout.module("vision"), "dp") == [[10, 11]]
    assert group_ranks(layout.module("audio"), "tp") == [[8, 9]]
    assert stage_ranks(layout.module("vision"), 0) == [10, 11]


def test_placement_errors() -> None:
    layout = layout_from_dict(GOLDEN["w12-disjoint-three-islands-out-of-order"][0])
    audio = layout.module("audio")
    with pytest.raises(ValueError) as info:
        coord_of(audio, 10)
    assert str(info.value) == "rank 10 is not in module audio (ranks 8-9)"
    with pytest.raises(ValueError, match="rank 7 is not in module audio"):
        coord_of(audio, 7)
    with pytest.raises(ValueError) as info:
        rank_of(audio, tp=2)
    assert str(info.value) == "module audio: tp coordinate 2 outside 0..1"
    with pytest.raises(ValueError) as info:
        rank_of(audio, dp=-1)
    assert str(info.value) == "module audio: dp coordinate -1 outside 0..0"
    with pytest.raises(ValueError) as info:
        group_ranks(audio, ["tp", "ep"])
    assert str(info.value) == "unknown axis 'ep'; axes are ['tp', 'cp', 'dp', 'pp']"


# --------------------------------------------------------------------------------------------
# Cross-checks against Megatron-core
# --------------------------------------------------------------------------------------------

DIMS = [["tp"], ["cp"], ["dp"], ["pp"], ["cp", "dp"], ["tp", "cp"], ["tp", "dp"]]
CROSS = [
    # (tp, cp, dp, pp, offset)
    (1, 1, 8, 1, 0),
    (2, 1, 2, 2, 0),
    (2, 2, 2, 2, 0),
    (1, 2, 2, 1, 2),
    (4, 1, 2, 1, 6),
    (2, 2, 1, 3, 4),
    (1, 4, 2, 2, 3),
    (3, 1, 2, 2, 5),
    (2, 1, 4, 1, 8),
]


def _module(tp, cp, dp, pp, offset, ep=1, expt_tp=1) -> ModuleLayout:
    size = tp * cp * dp * pp
    return ModuleLayout(
        "m", tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, expt_tp=expt_tp, ranks=RankRange(offset, offset + size - 1)
    )


def _as_set(groups) -> set[tuple[int, ...]]:
    return {tuple(sorted(g)) for g in groups}


def _check_against_megatron(m: ModuleLayout) -> None:
    gen = RankGenerator(tp=m.tp, ep=1, dp=m.dp, pp=m.pp, cp=m.cp, order="tp-cp-ep-dp-pp", rank_offset=m.offset)
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(m.offset + m.size)}):
        grid = HyperCommGrid([m.tp, m.cp, m.dp, m.pp], ["tp", "cp", "dp", "pp"], rank_offset=m.offset)
    for dims in DIMS:
        ours = group_ranks(m, dims)
        assert all(g == sorted(g) for g in ours)
        assert ours == sorted(ours, key=lambda g: g[0])
        assert _as_set(ours) == _as_set(gen.get_ranks("-".join(dims))), (m, dims)
        assert _as_set(ours) == _as_set(grid.get_rank_enum(dims)), (m, dims)


@pytest.mark.parametrize("tp,cp,dp,pp,offset", CROSS)
def test_groups_match_megatron(tp, cp, dp, pp, offset) -> None:
    _check_against_megatron(_module(tp, cp, dp, pp, offset))


def test_hyper_comm_grid_needs_world_size_env(monkeypatch) -> None:
    # The cross-check uses HyperCommGrid without a process group: WORLD_SIZE is read from the env.
    monkeypatch.setenv("WORLD_SIZE", "12")
    m = _module(2, 2, 2, 1, 4)
    grid = HyperCommGrid([2, 2, 2, 1], ["tp", "cp", "dp", "pp"], rank_offset=4)
    assert (
        _as_set(group_ranks(m, ["cp", "dp"]))
        == _as_set(grid.get_rank_enum(["cp", "dp"]))
        == {(4, 6, 8, 10), (5, 7, 9, 11)}
    )


MOE = [
    # (tp, cp, dp, pp, ep, expt_tp, offset)
    (2, 1, 4, 1, 4, 1, 0),
    (2, 1, 4, 2, 2, 2, 0),
    (1, 2, 4, 1, 4, 1, 3),
    (2, 2, 2, 2, 4, 2, 0),
    (4, 1, 2, 1, 8, 1, 2),
    (1, 1, 8, 2, 2, 4, 0),
]


def _check_ep_against_megatron(m: ModuleLayout) -> None:
    expt_dp = m.stage_size // (m.expt_tp * m.ep)
    gen = RankGenerator(tp=m.expt_tp, ep=m.ep, dp=expt_dp, pp=m.pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=m.offset)
    ep_groups = gen.get_ranks("ep")
    assert len(ep_groups) == m.size // m.ep
    for g in ep_groups:
        coords = [coord_of(m, r) for r in g]
        assert [c.ep for c in coords] == list(range(m.ep)), (m, g)
        assert len({(c.expt_tp, c.pp) for c in coords}) == 1
    for g in gen.get_ranks("tp"):  # expert tensor-parallel groups
        coords = [coord_of(m, r) for r in g]
        assert [c.expt_tp for c in coords] == list(range(m.expt_tp)), (m, g)
        assert len({(c.ep, c.pp) for c in coords}) == 1
    for g in gen.get_ranks("pp"):
        coords = [coord_of(m, r) for r in g]
        assert [c.pp for c in coords] == list(range(m.pp))
        assert len({(c.ep, c.expt_tp) for c in coords}) == 1


@pytest.mark.parametrize("tp,cp,dp,pp,ep,expt_tp,offset", MOE)
def test_ep_coordinate_matches_megatron(tp, cp, dp, pp, ep, expt_tp, offset) -> None:
    _check_ep_against_megatron(_module(tp, cp, dp, pp, offset, ep=ep, expt_tp=expt_tp))


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------


@st.composite
def modules(draw):
    tp, cp, dp, pp = (draw(st.integers(1, 4)) for _ in range(4))
    dense = tp * cp * dp
    expert = draw(st.sampled_from([d for d in range(1, dense + 1) if dense % d == 0]))
    expt_tp = draw(st.sampled_from([d for d in range(1, expert + 1) if expert % d == 0]))
    return _module(tp, cp, dp, pp, draw(st.integers(0, 9)), ep=expert // expt_tp, expt_tp=expt_tp)


@settings(max_examples=200, deadline=None)
@given(m=modules())
def test_property_coord_rank_inverse_and_partition(m: ModuleLayout) -> None:
    seen = []
    for r in m.ranks.ranks():
        c = coord_of(m, r)
        assert 0 <= c.tp < m.tp and 0 <= c.cp < m.cp and 0 <= c.dp < m.dp and 0 <= c.pp < m.pp
        assert 0 <= c.ep < m.ep and 0 <= c.expt_tp < m.expt_tp
        assert rank_of(m, tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r
        assert r in stage_ranks(m, c.pp)
        seen.append((c.tp, c.cp, c.dp, c.pp))
    assert len(set(seen)) == m.size  # every coordinate once
    for dims in DIMS + [["tp", "cp", "dp", "pp"]]:
        groups = group_ranks(m, dims)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(m.ranks.ranks())  # every rank exactly once
        size = 1
        for d in dims:
            size *= getattr(m, d)
        assert all(len(g) == size for g in groups)
    # Expert grid: inside each stage every (ep, expt_tp) pair appears stage_size/(ep*expt_tp) times.
    for pp in range(m.pp):
        pairs = [(coord_of(m, r).ep, coord_of(m, r).expt_tp) for r in stage_ranks(m, pp)]
        per = m.stage_size // (m.ep * m.expt_tp)
        assert all(pairs.count((e, t)) == per for e in range(m.ep) for t in range(m.expt_tp))


@settings(max_examples=100, deadline=None)
@given(m=modules())
def test_property_groups_and_ep_match_megatron(m: ModuleLayout) -> None:
    _check_against_megatron(m)
    _check_ep_against_megatron(m)


@pytest.mark.parametrize("name", list(GOLDEN))
def test_rank_map_covers_each_module_once(name: str) -> None:
    layout = layout_from_dict(GOLDEN[name][0])
    entries = rank_map(layout)
    assert [e.rank for e in entries] == list(range(layout.world_size))
    for m in layout.modules:
        ranks = [e.rank for e in entries if m.name in e.modules]
        assert ranks == list(m.ranks.ranks())
