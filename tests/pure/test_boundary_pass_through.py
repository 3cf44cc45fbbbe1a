"""`RankBoundaryPlan.pass_through`: true exactly where a rank's destination tensor is its source
tensor (colocated, same rows and positions on both sides, nothing on the wire), checked against the
rank's own transfers and the whole-edge plan."""

from __future__ import annotations

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.boundary import BoundaryShape, plan_boundary
from megatron_hetero.plan.boundary_rank import plan_rank_boundary


def _lay(placement: str, src: dict, dst: dict, world: int):
    doc = {"placement": placement, "modules": {"vision": src, "language": dst}, "edges": ["vision -> language"]}
    return layout_from_dict(doc, world_size=world)


# (id, placement, src, dst, world, shape, ranks expected to pass through)
CASES = [
    (
        "col-equal-tp2dp4",
        "colocated",
        {"tp": 2, "dp": 4},
        {"tp": 2, "dp": 4},
        8,
        BoundaryShape(8, 16, 4),
        set(range(8)),
    ),
    ("col-equal-dp2", "colocated", {"dp": 2}, {"dp": 2}, 2, BoundaryShape(4, 4, 3), {0, 1}),
    ("col-equal-cp2dp2", "colocated", {"cp": 2, "dp": 2}, {"cp": 2, "dp": 2}, 4, BoundaryShape(4, 8, 2), set(range(4))),
    ("col-dst-cp2", "colocated", {"tp": 2, "dp": 4}, {"cp": 2, "dp": 4}, 8, BoundaryShape(8, 16, 4), set()),
    ("col-fan-in", "colocated", {"dp": 8}, {"tp": 2, "dp": 4}, 8, BoundaryShape(8, 16, 4), set()),
    ("col-fan-out", "colocated", {"tp": 2, "dp": 4}, {"dp": 8}, 8, BoundaryShape(8, 16, 4), set()),
    ("col-permuted", "colocated", {"pp": 2, "dp": 2}, {"tp": 2, "dp": 2}, 4, BoundaryShape(4, 4, 3), set()),
    (
        "col-equal-tokens-inside-text",
        "colocated",
        {"dp": 2},
        {"dp": 2},
        2,
        BoundaryShape(4, 4, 3, dst_seq=8, dst_offset=2),
        {0, 1},
    ),
    ("dis-equal", "disjoint", {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}, 8, BoundaryShape(8, 16, 4), set()),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_pass_through_exactly_where_nothing_moves_and_rows_agree(case) -> None:
    _, placement, src, dst, world, shape, expected = case
    layout = _lay(placement, src, dst, world)
    edge = layout.edges[0]
    whole = plan_boundary(layout, edge, shape)
    got = set()
    for r in range(world):
        p = plan_rank_boundary(layout, edge, shape, r)
        if p.pass_through:
            got.add(r)
            # what makes it safe: the rank's output assembled from its local copies is its input
            assert p.holds == p.needs and p.is_src and p.is_dst
            assert not whole.sends(r, "forward") and not whole.recvs(r, "forward")
            assert not whole.sends(r, "backward") and not whole.recvs(r, "backward")
            assert sum(t.block.numel(1) for t in p.local_copies("forward")) == sum(b.numel(1) for b in p.needs)
    assert got == expected
