"""Boundary plans: hand-checked plans for a few edges and coverage properties for random layouts.

Ownership (both sides): DP rank d owns samples [d*B/dp, (d+1)*B/dp); with cp > 1 CP rank c owns
Megatron's load-balanced chunks c and 2cp-1-c of 2cp equal sequence chunks; TP ranks are replicas.
The source side is the source module's last pipeline stage, the destination side the destination
module's first stage.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_hetero.layout import Edge, layout_from_dict, load_layout
from megatron_hetero.plan import (
    Block,
    BoundaryShape,
    Coord,
    Transfer,
    coord_of,
    group_ranks,
    plan_all,
    plan_boundary,
    rank_of,
)
from megatron_hetero.plan.boundary import seq_chunks
from megatron_cp import megatron_cp_positions

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = REPO / "examples" / "layouts"


def B(b0, b1, s0, s1) -> Block:
    return Block(b0, b1, s0, s1)


def T(src, dst, b0, b1, s0, s1) -> Transfer:
    return Transfer(src, dst, Block(b0, b1, s0, s1))


# --------------------------------------------------------------------------------------------
# Hand-checked plans
# --------------------------------------------------------------------------------------------


def test_colocated_fan_in_tp1_dp8_to_tp2_pp2_dp2() -> None:
    """vision TP1·DP8 -> language TP2·PP2·DP2 on ranks 0-7, batch 8, seq 4, hidden 2, fp32.

    vision rank r holds sample r. language stage 0 is ranks 0-3: ranks 0,1 (dp0, tp0/tp1) need
    samples 0-3, ranks 2,3 (dp1) need samples 4-7; ranks 4-7 (stage 1) need nothing.
    """
    layout = load_layout(LAYOUTS / "colocated_fan_in.yaml")
    p = plan_boundary(layout, "vision -> language", BoundaryShape(batch=8, seq=4, hidden=2))
    assert (p.transform, p.factor, p.placement) == ("fan-in", 4, "colocated")
    assert p.src_ranks == tuple(range(8)) and p.dst_ranks == (0, 1, 2, 3)
    assert p.holds == {r: (B(r, r + 1, 0, 4),) for r in range(8)}
    assert p.needs == {0: (B(0, 4, 0, 4),), 1: (B(0, 4, 0, 4),), 2: (B(4, 8, 0, 4),), 3: (B(4, 8, 0, 4),)}
    assert p.src_leaders == tuple(range(8)) and p.dst_leader == 0

    assert p.local_copies(0) == [T(0, 0, 0, 1, 0, 4)]
    assert p.recvs(0) == [T(1, 0, 1, 2, 0, 4), T(2, 0, 2, 3, 0, 4), T(3, 0, 3, 4, 0, 4)]
    assert p.local_copies(1) == [T(1, 1, 1, 2, 0, 4)]
    assert p.recvs(1) == [T(0, 1, 0, 1, 0, 4), T(2, 1, 2, 3, 0, 4), T(3, 1, 3, 4, 0, 4)]
    for r in (2, 3):
        assert p.local_copies(r) == []
        assert p.recvs(r) == [T(s, r, s, s + 1, 0, 4) for s in (4, 5, 6, 7)]
    for r in range(4, 8):
        assert p.recvs(r) == [] and p.local_copies(r) == []
        assert p.sends(r) == [T(r, 2, r, r + 1, 0, 4), T(r, 3, r, r + 1, 0, 4)]
    assert p.sends(0) == [T(0, 1, 0, 1, 0, 4)]
    # 14 samples of 4x2 fp32 values move between ranks.
    assert p.planned_bytes("forward") == p.min_bytes_forward == 14 * 4 * 2 * 4 == 448

    # Backward: vision rank r needs the gradient of sample r. Language replicas 0,1 (samples 0-3)
    # and 2,3 (samples 4-7) share the sending; ranks 0 and 1 already hold theirs.
    assert p.local_copies(0, "backward") == [T(0, 0, 0, 1, 0, 4)]
    assert p.local_copies(1, "backward") == [T(1, 1, 1, 2, 0, 4)]
    want = {2: 0, 3: 1, 4: 2, 5: 3, 6: 2, 7: 3}
    for r, src in want.items():
        assert p.recvs(r, "backward") == [T(src, r, r, r + 1, 0, 4)]
    # (one sample = 4*2 fp32 = 32 B; ranks 2,3 each serve two of ranks 4-7)
    assert p.bytes_sent_per_rank("backward") == {0: 32, 1: 32, 2: 64, 3: 64}
    assert p.planned_bytes("backward") == p.min_bytes_backward == 6 * 32
    assert p.local_groups() == [tuple(range(8))]
    assert set(p.costs) == {"direct"} and p.recommended_mode == "direct"


def _positions(blocks) -> list[int]:
    return [s for b in blocks for s in range(b.s0, b.s1)]


def test_disjoint_fan_out_cp2_destination() -> None:
    """vision TP2·DP1 on 0-1 -> language CP2·DP2 on 2-5; batch 2, seq 8, hidden 1.

    language rank 2 (cp0 dp0), 3 (cp1 dp0), 4 (cp0 dp1), 5 (cp1 dp1). With 2*cp = 4 chunks of 2:
    cp0 owns [0:2] and [6:8], cp1 owns [2:4] and [4:6].
    """
    layout = load_layout(LAYOUTS / "disjoint_fan_out.yaml")
    p = plan_boundary(layout, Edge("vision", "language"), BoundaryShape(batch=2, seq=8, hidden=1))
    assert (p.transform, p.factor) == ("fan-out", 2)
    assert p.src_ranks == (0, 1) and p.dst_ranks == (2, 3, 4, 5)
    assert p.holds == {0: (B(0, 2, 0, 8),), 1: (B(0, 2, 0, 8),)}
    assert p.recvs(2) == [T(0, 2, 0, 1, 0, 2), T(0, 2, 0, 1, 6, 8)]
    assert p.recvs(3) == [T(1, 3, 0, 1, 2, 4), T(1, 3, 0, 1, 4, 6)]
    assert p.recvs(4) == [T(0, 4, 1, 2, 0, 2), T(0, 4, 1, 2, 6, 8)]
    assert p.recvs(5) == [T(1, 5, 1, 2, 2, 4), T(1, 5, 1, 2, 4, 6)]
    assert all(not p.local_copies(r) for r in range(6))
    # Each CP rank receives exactly the positions Megatron's own CP slicing gives it, in order.
    for r, cp_rank in ((2, 0), (3, 1), (4, 0), (5, 1)):
        assert _positions(t.block for t in p.recvs(r)) == megatron_cp_positions(8, 2, cp_rank)
    # The two TP replicas of the source share the sending evenly.
    assert p.bytes_sent_per_rank() == {0: 32, 1: 32}
    assert p.planned_bytes() == p.min_bytes_forward == 16 * 4
    # Backward: both source replicas need the gradient of the whole [2, 8] tensor, each piece once.
    for r in (0, 1):
        got = p.recvs(r, "backward")
        assert sorted((t.src, t.block) for t in got) == sorted(
            [
                (2, B(0, 1, 0, 2)),
                (2, B(0, 1, 6, 8)),
                (3, B(0, 1, 2, 4)),
                (3, B(0, 1, 4, 6)),
                (4, B(1, 2, 0, 2)),
                (4, B(1, 2, 6, 8)),
                (5, B(1, 2, 2, 4)),
                (5, B(1, 2, 4, 6)),
            ]
        )
    assert p.planned_bytes("backward") == p.min_bytes_backward == 2 * 16 * 4
    assert set(p.costs) == {"direct", "hierarchical"}
    assert p.costs["direct"].bytes == 64 and p.costs["hierarchical"].bytes >= 64
    assert p.recommended_mode == "direct"
    assert p.src_leaders == (0,) and p.dst_leader == 2


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_chunks_match_megatron(cp: int) -> None:
    seq = 2 * cp * 3
    layout = layout_from_dict(
        {"placement": "disjoint", "modules": {"a": {"dp": 1}, "b": {"cp": cp}}, "edges": ["a -> b"]}
    )
    p = plan_boundary(layout, "a->b", BoundaryShape(batch=1, seq=seq, hidden=1))
    for c, r in enumerate(p.dst_ranks):
        assert _positions(p.needs[r]) == megatron_cp_positions(seq, cp, c)
        assert _positions(t.block for t in p.recvs(r)) == megatron_cp_positions(seq, cp, c)
        assert seq_chunks(seq, cp, c) == (
            [(0, seq)] if cp == 1 else [(c * 3, c * 3 + 3), ((2 * cp - 1 - c) * 3, (2 * cp - c) * 3)]
        )


def test_tp4_source_replicas_spread_the_sending() -> None:
    """language_a TP4 on 0-3 -> language_b DP4 on 4-7 (the llm_segments example), batch 4, seq 2, hidden 3."""
    layout = load_layout(LAYOUTS / "llm_segments.yaml")
    p = plan_boundary(layout, "language_a -> language_b", BoundaryShape(batch=4, seq=2, hidden=3))
    assert (p.transform, p.factor) == ("fan-out", 4)
    for i in range(4):
        assert p.recvs(4 + i) == [T(i, 4 + i, i, i + 1, 0, 2)]
        assert p.sends(i) == [T(i, 4 + i, i, i + 1, 0, 2)]
    assert p.bytes_sent_per_rank() == {0: 24, 1: 24, 2: 24, 3: 24}
    # Backward: every TP replica of the source gets the gradient of all 4 samples, one per sample.
    for r in range(4):
        assert p.recvs(r, "backward") == [T(4 + i, r, i, i + 1, 0, 2) for i in range(4)]
    assert p.bytes_sent_per_rank("backward") == {4: 96, 5: 96, 6: 96, 7: 96}


def test_tp2_source_replicas_spread_over_tp2_destination() -> None:
    # vision TP2·DP1 on 0-1 -> language TP2·DP2 on 2-5: four receivers, each replica serves two.
    layout = layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {"vision": {"tp": 2}, "language": {"tp": 2, "dp": 2}},
            "edges": ["vision->language"],
        }
    )
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=1, hidden=1))
    assert [(t.src, t.dst) for t in p.forward] == [(0, 2), (1, 3), (0, 4), (1, 5)]
    # Backward: destination TP replicas 2,3 (sample 0) and 4,5 (sample 1) hold identical gradients;
    # exactly one of each pair supplies each source replica, never both.
    assert [(t.src, t.dst, t.block.b0) for t in p.backward] == [(2, 0, 0), (4, 0, 1), (3, 1, 0), (5, 1, 1)]


def test_colocated_fan_out_is_all_local_forward() -> None:
    """vision TP2·DP2 -> language TP1·DP4 on 4 ranks: every rank's sample lies in the vision shard it holds."""
    layout = load_layout(LAYOUTS / "colocated_fan_out.yaml")
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=4, seq=2, hidden=1))
    assert (p.transform, p.factor) == ("fan-out", 2)
    assert p.forward == tuple(T(r, r, r, r + 1, 0, 2) for r in range(4))
    assert p.planned_bytes() == p.min_bytes_forward == 0
    # Backward: vision rank 0 (dp0, samples 0-1) gets sample 1's gradient from language rank 1, etc.
    assert [(t.src, t.dst, t.block.b0) for t in p.backward if not t.local] == [
        (1, 0, 1),
        (0, 1, 0),
        (3, 2, 3),
        (2, 3, 2),
    ]
    assert p.planned_bytes("backward") == p.min_bytes_backward == 4 * 2 * 4
    assert p.local_groups() == [(0,), (1,), (2,), (3,)]


def test_colocated_equal_dp_cp_only_backward_moves() -> None:
    """vision TP2·DP2 -> language CP2·DP2 on 4 ranks (example): both read rank r as dp r//2."""
    layout = load_layout(LAYOUTS / "colocated_equal_dp_cp.yaml")
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=8, hidden=1))
    assert (p.transform, p.factor) == ("equal-dp", 1)
    assert p.local_copies(1) == [T(1, 1, 0, 1, 2, 4), T(1, 1, 0, 1, 4, 6)]
    assert p.local_copies(2) == [T(2, 2, 1, 2, 0, 2), T(2, 2, 1, 2, 6, 8)]
    assert p.planned_bytes() == p.min_bytes_forward == 0
    # Each vision rank lacks the gradient of its peer CP rank's two chunks (4 positions).
    assert p.recvs(0, "backward") == [T(1, 0, 0, 1, 2, 4), T(1, 0, 0, 1, 4, 6)]
    assert p.recvs(1, "backward") == [T(0, 1, 0, 1, 0, 2), T(0, 1, 0, 1, 6, 8)]
    assert p.planned_bytes("backward") == p.min_bytes_backward == 4 * 4 * 4


@pytest.mark.parametrize(
    "doc",
    [
        {"modules": {"a": {"tp": 2, "dp": 2}, "b": {"tp": 2, "dp": 2}}},
        {"modules": {"a": {"cp": 2, "dp": 2, "pp": 1}, "b": {"cp": 2, "dp": 2}}},
        {"modules": {"a": {"dp": 8}, "b": {"dp": 8}}},
        {"modules": {"a": {"tp": 4}, "b": {"tp": 4}}},
    ],
)
def test_equal_dp_identity_colocated_moves_nothing(doc) -> None:
    layout = layout_from_dict({**doc, "placement": "colocated", "edges": ["a -> b"]})
    p = plan_boundary(layout, "a->b", BoundaryShape(batch=8, seq=8, hidden=4))
    assert (p.transform, p.factor) == ("equal-dp", 1)
    assert all(t.local for t in p.forward) and all(t.local for t in p.backward)
    assert p.planned_bytes("forward") == p.planned_bytes("backward") == 0
    assert p.min_bytes_forward == p.min_bytes_backward == 0
    assert p.bytes_sent_per_rank() == {} and p.costs["direct"].hops == 0
    assert p.local_groups() == [(r,) for r in range(layout.world_size)]


def test_disjoint_fan_in_and_plan_all() -> None:
    layout = load_layout(LAYOUTS / "disjoint_two_encoders.yaml")
    plans = plan_all(layout, BoundaryShape(batch=2, seq=4, hidden=2))
    assert [(str(p.edge), p.transform, p.factor) for p in plans] == [
        ("vision->language", "fan-in", 2),
        ("audio->language", "fan-in", 2),
    ]
    vision, audio = plans
    # language TP2·PP2·DP1 on 4-7: stage 0 = ranks 4,5 both need samples 0-1.
    assert vision.dst_ranks == (4, 5)
    assert vision.recvs(4) == [T(0, 4, 0, 1, 0, 4), T(1, 4, 1, 2, 0, 4)]
    assert vision.recvs(5) == [T(0, 5, 0, 1, 0, 4), T(1, 5, 1, 2, 0, 4)]
    assert audio.recvs(4) == [T(2, 4, 0, 1, 0, 4), T(3, 4, 1, 2, 0, 4)]
    # Backward: vision rank 0 (sample 0) from language rank 4, rank 1 (sample 1) from rank 5.
    assert vision.recvs(0, "backward") == [T(4, 0, 0, 1, 0, 4)]
    assert vision.recvs(1, "backward") == [T(5, 1, 1, 2, 0, 4)]
    shapes = {Edge("vision", "language"): BoundaryShape(2, 4, 2), Edge("audio", "language"): BoundaryShape(4, 4, 2)}
    assert [p.shape.batch for p in plan_all(layout, shapes)] == [2, 4]


def test_source_is_last_stage_destination_first_stage() -> None:
    layout = load_layout(LAYOUTS / "disjoint_encoder_pp.yaml")  # vision PP2·DP2 on 0-3, language TP2·PP2 on 4-7
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=2, hidden=1))
    assert p.src_ranks == (2, 3) and p.dst_ranks == (4, 5)
    assert p.src_leaders == (2, 3) and p.dst_leader == 4
    assert p.recvs(4) == [T(2, 4, 0, 1, 0, 2), T(3, 4, 1, 2, 0, 2)]


def test_placeholder_tokens_in_longer_cp_destination_sequence() -> None:
    """4 image tokens land at positions [1, 5) of an 8-long destination sequence, language CP2·DP2.

    Destination CP chunks are taken over the 8 positions: cp0 owns [0:2],[6:8] -> only position 1
    is an image token (edge token 0); cp1 owns [2:4],[4:6] -> positions 2,3,4 (edge tokens 1-3).
    """
    layout = load_layout(LAYOUTS / "disjoint_fan_out.yaml")  # vision TP2 on 0-1, language CP2·DP2 on 2-5
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=4, hidden=1, dst_seq=8, dst_offset=1))
    assert p.holds == {0: (B(0, 2, 0, 4),), 1: (B(0, 2, 0, 4),)}
    assert p.needs == {
        2: (B(0, 1, 0, 1),),
        3: (B(0, 1, 1, 3), B(0, 1, 3, 4)),
        4: (B(1, 2, 0, 1),),
        5: (B(1, 2, 1, 3), B(1, 2, 3, 4)),
    }
    assert p.recvs(2) == [T(0, 2, 0, 1, 0, 1)]
    assert p.recvs(3) == [T(1, 3, 0, 1, 1, 3), T(1, 3, 0, 1, 3, 4)]
    assert p.planned_bytes() == p.min_bytes_forward == 8 * 4
    assert p.planned_bytes("backward") == p.min_bytes_backward == 2 * 8 * 4
    # Tokens at [2, 6): cp0 ranks need nothing at all.
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=4, hidden=1, dst_seq=8, dst_offset=2))
    assert p.needs[2] == () and p.needs[4] == () and p.recvs(2) == [] and p.sends(0, "backward") == []
    assert p.needs[3] == (B(0, 1, 0, 2), B(0, 1, 2, 4))
    # The source still shards the edge sequence; the destination only the longer one.
    with pytest.raises(ValueError) as info:
        plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=4, hidden=1, dst_seq=6, dst_offset=0))
    assert str(info.value) == (
        "edge vision->language: destination sequence 6 is not divisible by 2*cp = 2*2 = 4 of destination "
        "language (load-balanced context-parallel chunks)"
    )
    with pytest.raises(ValueError) as info:
        plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=4, hidden=1, dst_seq=8, dst_offset=5))
    assert str(info.value) == (
        "edge vision->language: placeholder span [5, 5+4) does not fit in the destination sequence of 8"
    )
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=3, hidden=1, dst_seq=8, dst_offset=5))
    assert p.needs[2] == (B(0, 1, 1, 3),) and p.needs[3] == (B(0, 1, 0, 1),)


@pytest.mark.parametrize(
    "extra",
    [
        {"dst_seq": "8"},
        {"dst_seq": [8]},
        {"dst_seq": 8.0},
        {"dst_seq": 8, "dst_offset": True},
        {"dst_seq": 8, "dst_offset": 1.0},
    ],
)
def test_placeholder_fields_are_validated(extra) -> None:
    """BUG (partly): `check_shape` type-checks batch/seq/hidden/dtype_bytes but not dst_seq, and lets a
    bool dst_offset through: dst_seq="8" raises TypeError ('>' not supported between 'int' and 'str'),
    dst_seq=8.0 gives blocks with float bounds, dst_offset=True is taken as 1."""
    layout = load_layout(LAYOUTS / "disjoint_fan_out.yaml")
    with pytest.raises(ValueError) as info:
        plan_boundary(layout, "vision->language", BoundaryShape(batch=2, seq=4, hidden=1, **extra))
    assert "edge vision->language:" in str(info.value)


def test_shape_errors_name_the_edge() -> None:
    layout = load_layout(LAYOUTS / "colocated_equal_dp_cp.yaml")  # vision dp2, language cp2 dp2

    def err(shape, edge="vision->language") -> str:
        with pytest.raises(ValueError) as info:
            plan_boundary(layout, edge, shape)
        return str(info.value)

    assert err(BoundaryShape(batch=3, seq=8, hidden=1)) == (
        "edge vision->language: batch 3 is not divisible by source vision dp(2) (remainder 1); "
        "every DP rank must get the same number of samples"
    )
    assert err(BoundaryShape(batch=2, seq=6, hidden=1)) == (
        "edge vision->language: sequence 6 is not divisible by 2*cp = 2*2 = 4 of destination language "
        "(load-balanced context-parallel chunks)"
    )
    assert (
        err(BoundaryShape(batch=0, seq=8, hidden=1)) == "edge vision->language: batch must be a positive integer, got 0"
    )
    assert err(BoundaryShape(batch=2, seq=8, hidden=True)) == (
        "edge vision->language: hidden must be a positive integer, got True"
    )
    assert err(BoundaryShape(batch=2, seq=8, hidden=1, dtype_bytes=2.0)) == (
        "edge vision->language: dtype_bytes must be a positive integer, got 2.0"
    )
    assert (
        err(BoundaryShape(2, 8, 1), "language->vision")
        == "edge language->vision is not declared; edges are ['vision->language']"
    )
    assert err(BoundaryShape(2, 8, 1), "vision") == (
        "edge 'vision' is not of the form 'src -> dst' (e.g. 'vision -> language')"
    )
    layout2 = load_layout(LAYOUTS / "colocated_fan_in.yaml")  # language dp2, vision dp8
    with pytest.raises(ValueError) as info:
        plan_boundary(layout2, "vision->language", BoundaryShape(batch=4, seq=8, hidden=1))
    assert str(info.value) == (
        "edge vision->language: batch 4 is not divisible by source vision dp(8) (remainder 4); "
        "every DP rank must get the same number of samples"
    )
    with pytest.raises(ValueError) as info:
        plan_boundary(layout2, "vision->language", BoundaryShape(batch=8, seq=8, hidden=1)).planned_bytes("sideways")
    assert str(info.value) == "direction must be 'forward' or 'backward', got 'sideways'"


# --------------------------------------------------------------------------------------------
# Property tests over random valid layouts
# --------------------------------------------------------------------------------------------


def _factorise(draw, size: int) -> dict:
    tp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if size % d == 0]))
    cp = draw(st.sampled_from([d for d in (1, 2, 3) if (size // tp) % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2) if (size // tp // cp) % d == 0]))
    return {"tp": tp, "cp": cp, "pp": pp, "dp": size // (tp * cp * pp)}


@st.composite
def layouts(draw, placement=None, min_modules=1):
    placement = placement or draw(st.sampled_from(["colocated", "disjoint"]))
    n = draw(st.integers(min_modules, 3))
    names = ["m0", "m1", "m2"][:n]
    sizes = (
        [draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))] * n
        if placement == "colocated"
        else [draw(st.sampled_from([1, 2, 3, 4, 6, 8])) for _ in range(n)]
    )
    modules = {name: _factorise(draw, s) for name, s in zip(names, sizes)}
    if placement == "disjoint" and draw(st.booleans()):
        # Explicit ranks, islands in a random order.
        start = 0
        for name in draw(st.permutations(names)):
            modules[name]["ranks"] = f"{start}-{start + sizes[names.index(name)] - 1}"
            start += sizes[names.index(name)]
    edges = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            da, db = modules[a]["dp"], modules[b]["dp"]
            if max(da, db) % min(da, db) == 0 and draw(st.booleans()):
                edges.append(f"{a} -> {b}")
    return layout_from_dict({"placement": placement, "modules": modules, "edges": edges})


@st.composite
def shapes_for(draw, layout):
    dps = [m.dp for m in layout.modules]
    cps = [2 * m.cp if m.cp > 1 else 1 for m in layout.modules]
    seq = math.lcm(*cps) * draw(st.integers(1, 3))
    extra = {}
    if draw(st.booleans()):
        # Edge tokens placed inside a longer destination sequence (image tokens among text tokens).
        dst_seq = math.lcm(*cps) * draw(st.integers(1, 4))
        dst_seq = dst_seq * ((seq + dst_seq - 1) // dst_seq)
        extra = {"dst_seq": dst_seq, "dst_offset": draw(st.integers(0, dst_seq - seq))}
    return BoundaryShape(
        batch=math.lcm(*dps) * draw(st.integers(1, 2)),
        seq=seq,
        hidden=draw(st.integers(1, 3)),
        dtype_bytes=draw(st.sampled_from([1, 2, 4])),
        **extra,
    )


def _expected_blocks(m, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    """Independent ownership arithmetic (not via the code under test)."""
    local = rank - m.ranks.start
    cp_rank = (local // m.tp) % m.cp
    dp_rank = (local // (m.tp * m.cp)) % m.dp
    per = shape.batch // m.dp
    if m.cp == 1:
        spans = [(0, shape.seq)]
    else:
        n = shape.seq // (2 * m.cp)
        spans = [(cp_rank * n, (cp_rank + 1) * n), ((2 * m.cp - 1 - cp_rank) * n, (2 * m.cp - cp_rank) * n)]
    return tuple(Block(dp_rank * per, (dp_rank + 1) * per, s0, s1) for s0, s1 in spans)


def _expected_needs(m, rank: int, shape: BoundaryShape) -> tuple[Block, ...]:
    """Independent arithmetic for the destination side, with or without a longer dst sequence."""
    if shape.dst_seq is None:
        return _expected_blocks(m, rank, shape)
    local = rank - m.ranks.start
    cp_rank = (local // m.tp) % m.cp
    dp_rank = (local // (m.tp * m.cp)) % m.dp
    per = shape.batch // m.dp
    out = []
    for pos in _cp_positions(shape.dst_seq, m.cp, cp_rank):
        if shape.dst_offset <= pos < shape.dst_offset + shape.seq:
            e = pos - shape.dst_offset
            if out and out[-1][1] == e and out[-1][2] == _chunk_of(pos, shape.dst_seq, m.cp):
                out[-1][1] = e + 1
            else:
                out.append([e, e + 1, _chunk_of(pos, shape.dst_seq, m.cp)])
    return tuple(Block(dp_rank * per, (dp_rank + 1) * per, a, b) for a, b, _ in out)


def _cp_positions(seq: int, cp: int, cp_rank: int) -> list[int]:
    if cp == 1:
        return list(range(seq))
    n = seq // (2 * cp)
    return list(range(cp_rank * n, (cp_rank + 1) * n)) + list(range((2 * cp - 1 - cp_rank) * n, (2 * cp - cp_rank) * n))


def _chunk_of(pos: int, seq: int, cp: int) -> int:
    return 0 if cp == 1 else pos // (seq // (2 * cp))


def _inside(inner: Block, outer: Block) -> bool:
    return outer.b0 <= inner.b0 < inner.b1 <= outer.b1 and outer.s0 <= inner.s0 < inner.s1 <= outer.s1


def _check_direction(transfers, needers: dict, holders: dict, shape: BoundaryShape) -> int:
    """Every needed element arrives exactly once from a rank that holds it; returns moved bytes."""
    count = {r: np.zeros((shape.batch, shape.seq), dtype=np.int64) for r in needers}
    moved = 0
    for t in transfers:
        assert t.dst in needers, t
        assert t.src in holders, t
        assert t.block.b0 < t.block.b1 and t.block.s0 < t.block.s1, t
        assert any(_inside(t.block, h) for h in holders[t.src]), f"{t.src} does not hold {t.block}"
        assert any(_inside(t.block, n) for n in needers[t.dst]), f"{t.dst} does not need {t.block}"
        if t.src != t.dst:
            # A piece the receiver already holds is always a local copy.
            assert not any(_inside(t.block, h) for h in holders.get(t.dst, ())), t
            moved += t.block.numel(shape.hidden) * shape.dtype_bytes
        count[t.dst][t.block.b0 : t.block.b1, t.block.s0 : t.block.s1] += 1
    for r, blocks in needers.items():
        want = np.zeros((shape.batch, shape.seq), dtype=np.int64)
        for b in blocks:
            want[b.b0 : b.b1, b.s0 : b.s1] += 1
        assert want.max() <= 1
        np.testing.assert_array_equal(count[r], want, err_msg=f"rank {r}")
    return moved


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_plans_cover_exactly_once(data) -> None:
    layout = data.draw(layouts())
    assume(layout.edges)
    shape = data.draw(shapes_for(layout))
    for p in plan_all(layout, shape):
        src, dst = layout.module(p.edge.src), layout.module(p.edge.dst)
        assert list(p.src_ranks) == list(range(src.ranks.start + (src.pp - 1) * src.stage_size, src.ranks.end + 1))
        assert list(p.dst_ranks) == list(range(dst.ranks.start, dst.ranks.start + dst.stage_size))
        assert p.holds == {r: _expected_blocks(src, r, shape) for r in p.src_ranks}
        assert p.needs == {r: _expected_needs(dst, r, shape) for r in p.dst_ranks}
        # Forward: each destination element from exactly one source rank that holds it.
        fwd = _check_direction(p.forward, p.needs, p.holds, shape)
        # Backward: each source element's gradient from exactly one destination rank (no sums).
        bwd = _check_direction(p.backward, p.holds, p.needs, shape)
        assert p.planned_bytes("forward") == fwd == p.min_bytes_forward
        assert p.planned_bytes("backward") == bwd == p.min_bytes_backward
        assert sum(p.bytes_sent_per_rank("forward").values()) == fwd
        assert sum(p.bytes_sent_per_rank("backward").values()) == bwd
        if src.dp == dst.dp:
            assert (p.transform, p.factor) == ("equal-dp", 1)
        elif src.dp > dst.dp:
            assert (p.transform, p.factor) == ("fan-in", src.dp // dst.dp)
        else:
            assert (p.transform, p.factor) == ("fan-out", dst.dp // src.dp)
        ranks = {t.src for t in p.forward + p.backward} | {t.dst for t in p.forward + p.backward}
        if layout.placement == "colocated":
            assert ranks <= set(range(layout.world_size)) and set(p.costs) == {"direct"}
            assert ranks <= set(src.ranks.ranks()) and ranks <= set(dst.ranks.ranks())
        else:
            # Disjoint islands: nothing is local; every element crosses.
            assert not any(t.local for t in p.forward + p.backward)
            assert ranks <= set(src.ranks.ranks()) | set(dst.ranks.ranks())
            assert p.costs["hierarchical"].bytes >= p.costs["direct"].bytes
        assert p.costs["direct"].bytes == fwd
        grouped = sorted(r for g in p.local_groups() for r in g)
        assert len(grouped) == len(set(grouped))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_property_bad_shapes_name_the_edge(data) -> None:
    layout = data.draw(layouts())
    assume(layout.edges)
    e = data.draw(st.sampled_from(layout.edges))
    src, dst = layout.module(e.src), layout.module(e.dst)
    good = data.draw(shapes_for(layout))
    batch = data.draw(st.integers(1, 30))
    seq = data.draw(st.integers(1, 30))
    bad_batch = any(batch % m.dp for m in (src, dst))
    bad_seq = any(m.cp > 1 and seq % (2 * m.cp) for m in (src, dst))
    shape = BoundaryShape(batch=batch, seq=seq, hidden=good.hidden)
    if bad_batch or bad_seq:
        with pytest.raises(ValueError) as info:
            plan_boundary(layout, e, shape)
        msg = str(info.value)
        assert f"edge {e}:" in msg
        assert (bad_batch and "batch" in msg) or (bad_seq and "sequence" in msg), msg
    else:
        p = plan_boundary(layout, e, shape)
        assert p.planned_bytes() == p.min_bytes_forward


_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_invalid_input_raises_only_value_error(data) -> None:
    layout = data.draw(layouts())
    edge = data.draw(
        st.one_of(
            st.sampled_from(list(layout.edges) or [Edge("m0", "m1")]),
            st.sampled_from(list(layout.edges) or [Edge("m0", "m1")]).map(str),
            st.text(max_size=10),
            st.sampled_from(["m0->m1", "m1 -> m0", "m0->m2", "x->y", "->", "m0"]),
            st.builds(Edge, st.sampled_from(["m0", "m1", "m2", "zz"]), st.sampled_from(["m0", "m1", "m2", "zz"])),
        )
    )
    placeholder = data.draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries({"dst_seq": st.integers(-3, 40)}, optional={"dst_offset": st.integers(-3, 40)}),
        )
    )
    shape = BoundaryShape(
        batch=data.draw(_junk),
        seq=data.draw(_junk),
        hidden=data.draw(_junk),
        dtype_bytes=data.draw(_junk),
        **placeholder,
    )
    try:
        p = plan_boundary(layout, edge, shape)
    except ValueError as exc:
        assert str(exc)
        return
    assert p.planned_bytes() == p.min_bytes_forward


# --------------------------------------------------------------------------------------------
# The hierarchical (leader) route: explicit steps computed in the plan
# --------------------------------------------------------------------------------------------

_PG_DIMS = {"tp": ["tp"], "dp_cp": ["cp", "dp"], "tp_cp": ["tp", "cp"]}


def _closed_form_hierarchical_bytes(src, dst, shape: BoundaryShape) -> int:
    """Independent price of the forward leader route (not via the code under test): source CP
    gather of (cp-1)/cp of the tensor, every shard once to the leader, TP-row and column broadcasts."""
    full = shape.batch * shape.seq * shape.hidden
    gather = full * (src.cp - 1) // src.cp if src.cp > 1 else 0
    return (gather + full * (1 + (dst.tp - 1) + dst.tp * (dst.dp * dst.cp - 1))) * shape.dtype_bytes


def _simulate_route(steps, start: dict, want: dict, shape: BoundaryShape) -> dict:
    """Run the steps on element ids: each rank holds a [batch, seq] array of global element ids
    (-1 = not held). Checks that every piece is sent by a rank that holds it, that every rectangle a
    step assembles gets each of its elements exactly once, that a broadcast root holds what it
    broadcasts, and at the end that every rank holds the right element at each position it wants.
    Returns the bytes each rank sent."""
    ids = np.arange(shape.batch * shape.seq).reshape(shape.batch, shape.seq)
    held = {}
    for r, blocks in start.items():
        held[r] = np.full((shape.batch, shape.seq), -1)
        for b in blocks:
            held[r][b.b0 : b.b1, b.s0 : b.s1] = ids[b.b0 : b.b1, b.s0 : b.s1]
    sent: dict[int, int] = {}
    for step in steps:
        assert step.kind in ("gather", "scatter", "broadcast"), step
        assert step.root in step.group, step
        for t in step.transfers:
            assert t.src in step.group and t.dst in step.group, (step.label, t)
            got = held[t.src][t.block.b0 : t.block.b1, t.block.s0 : t.block.s1]
            np.testing.assert_array_equal(
                got,
                ids[t.block.b0 : t.block.b1, t.block.s0 : t.block.s1],
                err_msg=f"{step.label}: rank {t.src} does not hold {t.block}",
            )
            if not t.local:
                sent[t.src] = sent.get(t.src, 0) + t.block.numel(shape.hidden) * shape.dtype_bytes
        if step.kind == "broadcast":
            region = step.region_of(step.root)
            assert dict(step.regions) == {r: region for r in step.group}
            assert sorted(t.dst for t in step.transfers) == [r for r in step.group if r != step.root]
            assert all(t.src == step.root and t.block == region for t in step.transfers)
        if step.kind == "gather":
            assert [r for r, _ in step.regions] == [step.root] and all(t.dst == step.root for t in step.transfers)
        if step.kind == "scatter":
            assert all(t.src == step.root and not t.local for t in step.transfers)
            assert sorted(r for r, _ in step.regions) == sorted(t.dst for t in step.transfers)
        new = {}
        for r, region in step.regions:
            count = np.zeros((shape.batch, shape.seq), dtype=np.int64)
            new[r] = np.full((shape.batch, shape.seq), -1)
            pieces = [t.block for t in step.transfers if t.dst == r]
            if step.kind == "broadcast" and r == step.root:
                pieces = [region]  # the root keeps what it broadcasts (checked above: it holds it)
            for blk in pieces:
                assert region.contains(blk), (step.label, blk, region)
                count[blk.b0 : blk.b1, blk.s0 : blk.s1] += 1
            inside = np.zeros_like(count)
            inside[region.b0 : region.b1, region.s0 : region.s1] = 1
            np.testing.assert_array_equal(
                count, inside, err_msg=f"{step.label}: rank {r} gets an element of {region} other than exactly once"
            )
            new[r][region.b0 : region.b1, region.s0 : region.s1] = ids[region.b0 : region.b1, region.s0 : region.s1]
        held.update(new)
    for r, blocks in want.items():
        for b in blocks:
            np.testing.assert_array_equal(
                held[r][b.b0 : b.b1, b.s0 : b.s1],
                ids[b.b0 : b.b1, b.s0 : b.s1],
                err_msg=f"rank {r} lacks {b} at the end",
            )
    return sent


def _check_route(layout, p) -> None:
    """Every property the runtime relies on, for one disjoint plan."""
    src, dst = layout.module(p.edge.src), layout.module(p.edge.dst)
    route = p.route
    assert route is not None and route.shape == p.shape
    assert (route.src_leaders, route.dst_leader) == (p.src_leaders, p.dst_leader)
    # Leaders: (tp0, cp0) of each source DP shard on the last stage; (tp0, cp0, dp0) of stage 0.
    assert [coord_of(src, r) for r in route.src_leaders] == [
        Coord(tp=0, cp=0, dp=d, pp=src.pp - 1) for d in range(src.dp)
    ]
    assert coord_of(dst, route.dst_leader) == Coord(tp=0, cp=0, dp=0, pp=0)
    # Forward: destination ranks end with their needs; every element of each assembled
    # rectangle exactly once; bytes = the plan's price = the closed form.
    fwd = _simulate_route(route.forward, p.holds, p.needs, p.shape)
    assert fwd == route.bytes_sent_per_rank("forward")
    assert sum(fwd.values()) == route.bytes("forward") == p.costs["hierarchical"].bytes
    assert p.costs["hierarchical"].bytes == _closed_form_hierarchical_bytes(src, dst, p.shape)
    # Backward: every source replica ends with the gradient of all it holds.
    bwd = _simulate_route(route.backward, p.needs, p.holds, p.shape)
    assert bwd == route.bytes_sent_per_rank("backward") and sum(bwd.values()) == route.bytes("backward")
    for step in route.forward + route.backward:
        assert set(step.group) <= set(p.src_ranks) | set(p.dst_ranks), step
        if step.kind == "broadcast":
            # a real process group of the module (the one the runtime looks up), root inside it
            m = layout.module(step.module)
            assert list(step.group) in group_ranks(m, _PG_DIMS[step.pg]), step
            assert step.root in step.group
    # The broadcasts go where the design says: the leader over its TP row, each TP position down its column.
    fb = [s for s in route.forward if s.kind == "broadcast"]
    assert [s.pg for s in fb] == (["tp"] if dst.tp > 1 else []) + (["dp_cp"] * dst.tp if dst.dp * dst.cp > 1 else [])
    assert [s.root for s in fb if s.pg == "dp_cp"] == (
        [rank_of(dst, tp=t) for t in range(dst.tp)] if dst.dp * dst.cp > 1 else []
    )
    bb = [s for s in route.backward if s.kind == "broadcast"]
    assert [s.root for s in bb] == (list(route.src_leaders) if src.tp * src.cp > 1 else [])
    assert str(route).count("\n") == 2 + len(route.forward) + len(route.backward)


ROUTE_CASES = [
    # (id, source, destination, batch, seq, hidden, dst placeholder)
    ("fan-in dp4 -> tp2dp2", {"dp": 4}, {"tp": 2, "dp": 2}, 8, 4, 2, {}),
    ("fan-out tp2 -> cp2dp2", {"tp": 2}, {"cp": 2, "dp": 2}, 4, 8, 2, {}),
    ("equal-dp tp2dp2 -> tp2dp2", {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}, 4, 4, 3, {}),
    ("equal-dp cp2dp2 -> tp2cp2dp2", {"cp": 2, "dp": 2}, {"tp": 2, "cp": 2, "dp": 2}, 4, 8, 1, {}),
    ("fan-in tp2cp2dp2 pp2 -> cp4", {"tp": 2, "cp": 2, "dp": 2, "pp": 2}, {"cp": 4}, 2, 16, 2, {}),
    ("fan-out cp3 -> tp2dp3 pp2", {"cp": 3}, {"tp": 2, "dp": 3, "pp": 2}, 6, 12, 1, {}),
    ("placeholder cp2 destination", {"tp": 2}, {"cp": 2, "dp": 2}, 2, 6, 1, {"dst_seq": 16, "dst_offset": 1}),
    ("placeholder misses cp0", {"dp": 2}, {"tp": 2, "cp": 2}, 2, 4, 1, {"dst_seq": 8, "dst_offset": 2}),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_leader_route_delivers_every_element_once_at_the_priced_bytes(case) -> None:
    _, src, dst, batch, seq, hidden, extra = case
    layout = layout_from_dict(
        {"placement": "disjoint", "modules": {"vision": src, "language": dst}, "edges": ["vision -> language"]}
    )
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch, seq, hidden, **extra))
    _check_route(layout, p)
    assert p.costs["hierarchical"].bytes > p.costs["direct"].bytes


def test_leader_route_hand_checked() -> None:
    """vision TP2·CP2·DP2 on 0-7 -> language TP2·CP2 on 8-11; batch 4, seq 8, hidden 2, fp32.

    Shard d (samples [2d, 2d+2)) has leader 4d; its TP-0 CP ranks are 4d (cp0) and 4d+2 (cp1).
    language: rank 8 (tp0 cp0) leads, 9 is its TP peer, 10/11 are the cp1 ranks of tp0/tp1.
    """
    layout = layout_from_dict(
        {
            "placement": "disjoint",
            "modules": {"vision": {"tp": 2, "cp": 2, "dp": 2}, "language": {"tp": 2, "cp": 2}},
            "edges": ["vision->language"],
        }
    )
    p = plan_boundary(layout, "vision->language", BoundaryShape(batch=4, seq=8, hidden=2))
    r = p.route
    assert (r.src_leaders, r.dst_leader) == ((0, 4), 8)
    whole, s0, s1 = B(0, 4, 0, 8), B(0, 2, 0, 8), B(2, 4, 0, 8)
    fwd = [(s.kind, s.root, s.group, s.regions, s.module, s.pg) for s in r.forward]
    assert fwd == [
        ("gather", 0, (0, 2), ((0, s0),), "", ""),
        ("gather", 4, (4, 6), ((4, s1),), "", ""),
        ("gather", 8, (0, 4, 8), ((8, whole),), "", ""),
        ("broadcast", 8, (8, 9), ((8, whole), (9, whole)), "language", "tp"),
        ("broadcast", 8, (8, 10), ((8, whole), (10, whole)), "language", "dp_cp"),
        ("broadcast", 9, (9, 11), ((9, whole), (11, whole)), "language", "dp_cp"),
    ]
    # cp1 of shard 0 sends chunks 1 and 2 (of 4 chunks of 2); the leader's own chunks 0 and 3 are local.
    assert r.forward[0].transfers == (
        T(0, 0, 0, 2, 0, 2),
        T(0, 0, 0, 2, 6, 8),
        T(2, 0, 0, 2, 2, 4),
        T(2, 0, 0, 2, 4, 6),
    )
    assert r.forward[2].transfers == (T(0, 8, 0, 2, 0, 8), T(4, 8, 2, 4, 0, 8))
    # one shard is 2*8*2 fp32 = 128 B; the whole tensor 256 B
    assert [s.bytes(p.shape) for s in r.forward] == [64, 64, 256, 256, 256, 256]
    assert p.costs["hierarchical"].bytes == r.bytes("forward") == 1152
    bwd = [(s.kind, s.root, s.group, s.regions, s.pg) for s in r.backward]
    assert bwd == [
        ("gather", 8, (8, 10), ((8, whole),), ""),
        ("scatter", 8, (0, 4, 8), ((0, s0), (4, s1)), ""),
        ("broadcast", 0, (0, 1, 2, 3), tuple((k, s0) for k in (0, 1, 2, 3)), "tp_cp"),
        ("broadcast", 4, (4, 5, 6, 7), tuple((k, s1) for k in (4, 5, 6, 7)), "tp_cp"),
    ]
    assert r.backward[0].transfers == (
        T(8, 8, 0, 4, 0, 2),
        T(8, 8, 0, 4, 6, 8),
        T(10, 8, 0, 4, 2, 4),
        T(10, 8, 0, 4, 4, 6),
    )
    assert r.bytes_sent_per_rank("backward") == {10: 128, 8: 256, 0: 384, 4: 384}
    assert str(r).splitlines()[:3] == [
        "leaders: source [0, 4], destination 8",
        "forward (1152 B):",
        "  1. gather    source CP gather (vision dp0): root 0, group [0, 2], 1 message, 64 B",
    ]
    assert "  4. broadcast TP-row broadcast (language): root 8, group [8, 9] over language:tp, 1 message, 256 B" in str(
        r
    )
    _check_route(layout, p)


def test_colocated_plans_have_no_leader_route() -> None:
    layout = load_layout(LAYOUTS / "colocated_fan_in.yaml")
    p = plan_boundary(layout, "vision -> language", BoundaryShape(batch=8, seq=4, hidden=2))
    assert p.route is None and set(p.costs) == {"direct"}


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_property_leader_route(data) -> None:
    layout = data.draw(layouts("disjoint", 2))
    if not layout.edges:  # (no assume: most draws would be filtered out)
        return
    shape = data.draw(shapes_for(layout))
    for p in plan_all(layout, shape):
        _check_route(layout, p)


def test_cp_chunk_positions_are_the_plan_chunks() -> None:
    """The CP attention's index tensor is built from the plan's one chunking rule (and so matches it)."""
    from megatron_hetero.models.cp_attention import cp_chunk_positions

    for cp in (1, 2, 3, 4):
        for c in range(cp):
            want = [s for a, b in seq_chunks(24, cp, c) for s in range(a, b)]
            assert cp_chunk_positions(24, c, cp).tolist() == want == megatron_cp_positions(24, cp, c)
