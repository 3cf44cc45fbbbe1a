"""Pure per-rank plans: roles, batch arithmetic, colocated phase tables and their checker."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hetero.layout import layout_from_dict, load_layout
from megatron_hetero.plan.batch import dp_rows, megatron_micro_batch, micro_batching, sample_range
from megatron_hetero.plan.actions import Link, Recv, Send, Stage
from megatron_hetero.plan.colocated import (
    BoundaryCall,
    ColocatedTable,
    EncoderForward,
    LanguagePhase,
    StateMove,
    check_colocated_tables,
    colocated_tables,
)
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.plan.rank_plan import rank_plan, rank_plans, step_micro_batching
from megatron_hetero.plan.roles import roles

LAYOUTS = Path(__file__).resolve().parents[2] / "examples" / "layouts"


def test_dp_rows_partition_the_batch_in_order():
    for batch, dp in ((8, 1), (8, 2), (8, 8), (12, 3)):
        rows = [list(dp_rows(batch, dp, d)) for d in range(dp)]
        assert sum(rows, []) == list(range(batch))
    assert list(sample_range(16, 8, 4, 3)) == [22, 23]
    with pytest.raises(ValueError, match=r"batch of 8 rows is not divisible by dp\(3\)"):
        dp_rows(8, 3, 0)
    with pytest.raises(ValueError, match=r"dp rank 2 is not in \[0, dp=2\)"):
        dp_rows(8, 2, 2)


def test_micro_batching_is_megatrons_arithmetic():
    mb = micro_batching(16, 2, 2)
    assert (mb.count, mb.samples) == (4, 4)
    assert list(mb.rows(dp=2, dp_rank=1, mb=3, step=1)) == [16 + 12 + 2, 16 + 12 + 3]
    # Megatron's order: DP share first, then micro-batches inside it
    assert list(megatron_micro_batch(16, 16, 2, 1, 2, 3)) == [16 + 8 + 6, 16 + 8 + 7]
    with pytest.raises(ValueError, match=r"DP share 16/dp\(2\) = 8 samples is not divisible by --micro-batch-size 3"):
        micro_batching(16, 2, 3)
    with pytest.raises(ValueError, match=r"--global-batch-size 9 is not divisible by dp\(2\)"):
        micro_batching(9, 2, 1)


def test_roles_sink_or_segments():
    lay = load_layout(LAYOUTS / "colocated_two_encoders.yaml")
    assert roles(lay).encoders == ("vision", "audio") and roles(lay).language == ("language",)
    seg = load_layout(LAYOUTS / "llm_segments.yaml")
    r = roles(seg)
    assert r.language == tuple(
        m.name for m in sorted((m for m in seg.modules if m.layers), key=lambda m: m.layers.start)
    )
    assert r.encoders == tuple(m.name for m in seg.modules if m.layers is None)
    two_sinks = layout_from_dict({"placement": "colocated", "modules": {"a": {}, "b": {}}, "edges": []}, world_size=1)
    with pytest.raises(ValueError, match=r"2 sinks"):
        roles(two_sinks)


def test_colocated_tables_fan_in_pp2():
    lay = load_layout(LAYOUTS / "colocated_fan_in.yaml")  # vision DP8, language TP2·PP2·DP2
    tables = colocated_tables(lay, 8, 1, offload_encoders=True)
    assert set(tables) == set(range(8))
    lang = lay.module("language")
    for rank, t in tables.items():
        fwd = [a for a in t.actions if isinstance(a, EncoderForward)]
        assert fwd == [EncoderForward("vision", 0, range(rank, rank + 1))]  # DP rank = rank, one row each
        (lp,) = [a for a in t.actions if isinstance(a, LanguagePhase)]
        c = coord_of(lang, rank)
        assert (lp.stage, lp.pp, lp.micro_batches, lp.warmup) == (c.pp, 2, 4, 1 - c.pp)
        assert lp.rows == range(4 * c.dp, 4 * c.dp + 4)
        bc = [a for a in t.actions if isinstance(a, BoundaryCall)]
        assert [b.direction for b in bc] == ["forward", "backward"]
        assert all(b.src and b.dst == (c.pp == 0) for b in bc)
        assert [a.kind for a in t.actions if isinstance(a, StateMove)] == ["offload", "restore"]
        assert [n for n, _ in t.phases] == ["phase 1", "phase 2", "phase 3", "close"]
    assert check_colocated_tables(tables) == 0


def test_colocated_tables_pipelined_encoder_peers_and_checker():
    lay = load_layout(LAYOUTS / "homogeneous.yaml")  # encoder on the LLM's TP2·PP2·DP2
    tables = colocated_tables(lay, 8, 1)
    enc = lay.module("vision")
    for rank, t in tables.items():
        c = coord_of(enc, rank)
        sends = [a for a in t.actions if isinstance(a, Send)]
        recvs = [a for a in t.actions if isinstance(a, Recv)]
        peer = rank + (enc.stage_size if c.pp == 0 else -enc.stage_size)
        link = Link(Stage("vision", 0), Stage("vision", 1))
        assert {a.stage for a in sends + recvs} == {Stage("vision", c.pp)}
        if c.pp == 0:
            assert sends == [Send(link, 0, "forward", peer, 4)]
            assert recvs == [Recv(link, 0, "backward", peer, 4)]
        else:
            assert recvs == [Recv(link, 0, "forward", peer, 4)]
            assert sends == [Send(link, 0, "backward", peer, 4)]
    assert check_colocated_tables(tables) == 8  # 4 activations up, 4 gradients down


def test_colocated_checker_finds_a_missing_send_and_a_split_collective():
    lay = load_layout(LAYOUTS / "homogeneous.yaml")
    tables = colocated_tables(lay, 8, 1)
    broken = dict(tables)
    t0 = tables[0]
    broken[0] = ColocatedTable(
        0, tuple((n, tuple(a for a in acts if not isinstance(a, Send))) for n, acts in t0.phases)
    )
    with pytest.raises(ValueError, match=r"deadlock: .*rank 4 waits in 'Recv forward vision/0->vision/1 mb 0 from r0'"):
        check_colocated_tables(broken)
    swapped = dict(tables)
    p = list(tables[1].phases)
    p[0], p[1] = p[1], p[0]
    swapped[1] = ColocatedTable(1, tuple(p))
    with pytest.raises(ValueError, match=r"different collectives|deadlock"):
        check_colocated_tables(swapped)


def test_rank_plan_peers_and_disjoint_tables():
    lay = load_layout(LAYOUTS / "disjoint_encoder_pp.yaml")
    plans = rank_plans(lay, 8, 2)
    for rank, p in plans.items():
        assert p.disjoint is not None and p.colocated is None
        (name,) = p.modules
        me = p.modules[name]
        m = lay.module(name)
        assert p.disjoint.stage.module == name and p.disjoint.stage.pp == me.coord.pp
        assert me.prev_rank == (None if me.coord.pp == 0 else rank - m.stage_size)
        assert me.next_rank == (None if me.coord.pp == m.pp - 1 else rank + m.stage_size)
    assert plans[0].micro_batching == step_micro_batching(lay, 8, 2)
    with pytest.raises(ValueError, match=r"outside the layout's world size"):
        rank_plan(lay, 99, 8, 2)
    with pytest.raises(ValueError, match=r"not divisible by dp\(2\)"):
        rank_plans(lay, 8, 1)


@pytest.mark.parametrize("path", sorted(LAYOUTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_one_rank_plan_is_that_rank_of_every_ranks_plans(path: Path):
    """`rank_plan` computes one rank's plan from its own coordinates; it equals that rank's entry of
    the whole world's `rank_plans`, and a batch the layout cannot split fails both with one message."""
    from megatron_hetero.plan.rank_plan import check_rank_plans

    lay = load_layout(path)
    valid = 0
    for g, mbs, offload in ((8, 1, False), (16, 2, True), (24, 4, False), (32, 1, True), (6, 1, False)):
        offload = offload and lay.placement == "colocated"
        try:
            every = rank_plans(lay, g, mbs, offload)
        except ValueError as exc:
            with pytest.raises(ValueError) as one:
                rank_plan(lay, 0, g, mbs, offload)
            assert str(one.value) == str(exc)
            continue
        valid += 1
        checked = check_rank_plans(lay, g, mbs, offload)
        for r in range(lay.world_size):
            assert rank_plan(lay, r, g, mbs, offload) == every[r]
            assert rank_plan(lay, r, g, mbs, offload, checked=checked) == every[r]
    assert valid, "no batch of the list fits the layout: the test compared nothing"
