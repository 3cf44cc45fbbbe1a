"""Zero-bubble tables (`build_tables(schedule="zb")`): the 1F1B order with each backward split into
its input-gradient pass (Backward) and weight-gradient pass (WeightGrad), the checker proving them
complete and deadlock-free under both execution models on the random DAGs of the 1F1B tests, and the
simulated bubble below 1F1B's on chains."""

from __future__ import annotations

import random

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.actions import Send
from megatron_hetero.plan.schedule import (
    Backward,
    Forward,
    StageTable,
    WeightGrad,
    build_tables,
    one_f_one_b_order,
    rank_tables,
    zero_bubble_order,
)
from megatron_hetero.plan.schedule_check import ScheduleError, check_tables
from test_schedule_tables import chain_doc, make_doc


def test_order_by_hand() -> None:
    # first of 2 stages (w = 1), M = 3: each W right after its B
    assert zero_bubble_order(3, 1) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("W", 0),
        ("F", 2),
        ("B", 1),
        ("W", 1),
        ("B", 2),
        ("W", 2),
    ]


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("w", [0, 1, 2, 4, 9])
def test_order_is_1f1b_plus_one_w_per_micro_batch_after_its_b(m: int, w: int) -> None:
    order = zero_bubble_order(m, w)
    assert [op for op in order if op[0] != "W"] == one_f_one_b_order(m, w)
    assert all(order[order.index(("B", mb)) + 1] == ("W", mb) for mb in range(m))
    assert sorted(mb for k, mb in order if k == "W") == list(range(m))


def test_cool_down_gradient_leaves_between_b_and_w() -> None:
    """In the cool-down (nothing left to pair the gradient with) the upstream stage gets the gradient
    before this stage runs its weight pass; in the steady phase it keeps 1F1B's pairing with the
    next activation's receive."""
    layout = layout_from_dict(chain_doc(2))
    tables = build_tables(layout, 3, schedule="zb")
    t = next(tb for st, tb in tables.items() if st.pp == 1)
    acts = list(t.actions)
    b, w = acts.index(Backward(t.stage, 2)), acts.index(WeightGrad(t.stage, 2))
    assert w == b + 2 and acts[b + 1] == Send(next(iter(tables[t.stage].actions)).link, 2, "backward")
    for mb in (0, 1):
        send = acts.index(Send(acts[0].link, mb, "backward"))
        assert acts.index(WeightGrad(t.stage, mb)) < send and acts[send + 1].mb == mb + 1  # paired


def _chain_reports(pps, m):
    layout = layout_from_dict(chain_doc(*pps))
    one = check_tables(build_tables(layout, m), layout=layout, micro_batches=m, mode="rendezvous")
    zb = check_tables(build_tables(layout, m, schedule="zb"), layout=layout, micro_batches=m, mode="rendezvous")
    return one, zb


@pytest.mark.parametrize("pps,m", [((2,), 4), ((4,), 8), ((2, 2), 8), ((1, 3), 6), ((8,), 16)])
def test_zb_chain_has_less_bubble_and_the_same_work(pps, m) -> None:
    one, zb = _chain_reports(pps, m)
    assert zb.bubble_fraction < one.bubble_fraction
    assert zb.makespan < one.makespan
    for st in one.busy:  # the same work, split differently
        assert zb.busy[st] == pytest.approx(one.busy[st])


def test_zb_two_stage_values() -> None:
    # 2 stages, M = 4, F 1, B 1, W 1 (backward 2 split in half): 1F1B (M + P - 1) * 3 = 15, bubble 1/5;
    # zb 14 (worked by hand: the last stage's B0 ends at 3, not 4, and the waves keep that lead)
    one, zb = _chain_reports((2,), 4)
    assert one.makespan == pytest.approx(15.0) and one.bubble_fraction == pytest.approx(1 / 5)
    assert zb.makespan == pytest.approx(14.0) and zb.bubble_fraction == pytest.approx(1 - 24 / 28)


def test_random_dags_zb_tables_pass_both_modes() -> None:
    for seed in range(20):
        rng = random.Random(1000 + seed)
        doc, m = make_doc(rng.randint)
        layout = layout_from_dict(doc)
        rt = rank_tables(layout, m, schedule="zb")
        for mode in ("buffered", "rendezvous"):
            rep = check_tables(rt, layout=layout, micro_batches=m, mode=mode)
            assert rep.ok
        for t in build_tables(layout, m, schedule="zb").values():
            assert t.schedule == "zb" and sum(isinstance(a, WeightGrad) for a in t.actions) == m
            assert t.cost_of(Backward(t.stage, 0)) + t.cost_of(WeightGrad(t.stage, 0)) == pytest.approx(t.backward_cost)


def _with_actions(t: StageTable, actions, schedule=None) -> StageTable:
    return StageTable(
        t.stage, tuple(actions), t.warmup, t.steady, t.cooldown, t.ranks, schedule=schedule or t.schedule,
        weight_fraction=t.weight_fraction,
    )  # fmt: skip


def test_checker_rejects_a_missing_or_misplaced_weight_pass() -> None:
    layout = layout_from_dict(chain_doc(2))
    tables = build_tables(layout, 4, schedule="zb")
    st = next(iter(tables))
    t = tables[st]
    dropped = [a for a in t.actions if a != WeightGrad(st, 2)]
    with pytest.raises(ScheduleError, match="WeightGrad mb 2 is missing"):
        check_tables({**tables, st: _with_actions(t, dropped)})
    early = [WeightGrad(st, 0)] + [a for a in t.actions if a != WeightGrad(st, 0)]
    with pytest.raises(ScheduleError, match="WeightGrad mb 0 .* comes before Backward mb 0"):
        check_tables({**tables, st: _with_actions(t, early)})
    one = build_tables(layout, 4)
    stray = list(one[st].actions) + [WeightGrad(st, 1)]
    with pytest.raises(ScheduleError, match="WeightGrad mb 1 .* in a 1f1b table"):
        check_tables({**one, st: _with_actions(one[st], stray)})


def test_bad_schedule_name_is_value_error() -> None:
    layout = layout_from_dict(chain_doc(2))
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_tables(layout, 4, schedule="zb-h2")
    assert isinstance(build_tables(layout, 2)[next(iter(build_tables(layout, 2)))].compute()[0], Forward)


def test_schedule_choice_rules_for_both_front_ends() -> None:
    """`check_schedule_choice` (train's validate_job and the scripts' check_common): zb needs a disjoint
    layout with direct boundaries; 1f1b runs everywhere; an unknown name is refused."""
    from pathlib import Path

    from megatron_hetero.layout import load_layout
    from megatron_hetero.plan.schedule import check_schedule_choice

    examples = Path(__file__).resolve().parents[2] / "examples" / "layouts"
    direct = load_layout(examples / "disjoint_fan_in.yaml")
    hier = load_layout(examples / "disjoint_hierarchical.yaml")
    coloc = load_layout(examples / "colocated_fan_in.yaml")
    assert hier.boundary_mode == "hierarchical" and direct.boundary_mode == "direct"
    check_schedule_choice("zb", direct)
    for layout in (direct, hier, coloc):
        check_schedule_choice("1f1b", layout)
    with pytest.raises(ValueError, match="zb runs with boundary_mode direct only"):
        check_schedule_choice("zb", hier)
    with pytest.raises(ValueError, match="zb applies to the disjoint schedule only"):
        check_schedule_choice("zb", coloc)
    with pytest.raises(ValueError, match="must be one of"):
        check_schedule_choice("interleaved", direct)
