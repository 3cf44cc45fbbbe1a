"""Multi-rank Topology tests on CPU/gloo (world 8, forked ranks).

For every module and every group kind, the runtime group of each member rank must equal the
group the pure plan computes, and an all-reduce over it must give the sum of its members' ranks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.placement import group_ranks
from megatron_hetero.runtime.launcher import RankFailure, run_ranks
from megatron_hetero.runtime.topology import DENSE_GROUPS, EXPERT_GROUPS, Topology

COLOCATED = {
    "placement": "colocated",
    "modules": {"vision": {"tp": 1, "dp": 8}, "language": {"tp": 2, "pp": 2, "dp": 2}},
    "edges": ["vision -> language"],
}
DISJOINT = {
    "placement": "disjoint",
    "modules": {
        "vision": {"tp": 1, "cp": 1, "dp": 2, "ranks": "0-1"},
        "audio": {"tp": 2, "dp": 1, "ranks": "2-3"},
        "language": {"tp": 2, "cp": 2, "dp": 1, "ranks": "4-7"},
    },
    "edges": ["vision -> language", "audio -> language"],
}
MOE = {
    "placement": "colocated",
    "modules": {"language": {"tp": 2, "dp": 4, "ep": 4}},
}


def _check_groups(doc: dict) -> dict:
    """In each rank: build the Topology, compare every group with the plan, all-reduce the rank ids."""
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    rank = dist.get_rank()
    seen = {}
    try:
        for m in layout.modules:
            if not topo.serves(m.name):
                with pytest.raises(ValueError, match="not one of module"):
                    topo.pg_collection(m.name)
                continue
            pgs = topo.pg_collection(m.name)
            for field, dims in DENSE_GROUPS:
                expect = next(g for g in group_ranks(m, list(dims)) if rank in g)
                got = sorted(dist.get_process_group_ranks(getattr(pgs, field)))
                assert got == expect, (m.name, field, got, expect)
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=getattr(pgs, field))
                assert t.item() == float(sum(expect)), (m.name, field, t.item(), expect)
                seen[(m.name, field)] = got
            pp_group = next(g for g in group_ranks(m, "pp") if rank in g)
            embd = sorted(dist.get_process_group_ranks(pgs.embd)) if rank in (pp_group[0], pp_group[-1]) else None
            if embd is not None:
                assert embd == sorted({pp_group[0], pp_group[-1]})
            if m.ep > 1:
                ep_ranks = sorted(dist.get_process_group_ranks(pgs.ep))
                t = torch.tensor([1.0])
                dist.all_reduce(t, group=pgs.ep)
                assert t.item() == m.ep and len(ep_ranks) == m.ep
                seen[(m.name, "ep")] = ep_ranks
    finally:
        topo.destroy()
        topo.destroy()  # idempotent
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", [COLOCATED, DISJOINT, MOE], ids=["colocated", "disjoint", "moe"])
def test_topology_groups_match_plan(doc):
    results = run_ranks(8, _check_groups, doc, timeout=90)
    layout = layout_from_dict(doc, world_size=8)
    # every member rank checked every dense group of every module it serves
    for m in layout.modules:
        for r in m.ranks.ranks():
            for field, _ in DENSE_GROUPS:
                assert (m.name, field) in results[r]
    if doc is MOE:
        # Megatron's folding: inside a stage the expert grid is expt_tp fastest, then ep.
        assert results[0][("language", "ep")] == [0, 1, 2, 3]
        assert results[5][("language", "ep")] == [4, 5, 6, 7]


def _wrong_world(doc: dict) -> None:
    layout = layout_from_dict(doc)
    Topology.build(layout)


@pytest.mark.timeout(60)
def test_topology_rejects_world_mismatch():
    with pytest.raises(RankFailure, match=r"layout uses ranks 0-7 \(8\) but the job has world size 4"):
        run_ranks(4, _wrong_world, COLOCATED, timeout=30)


def test_expert_groups_listed():
    assert [f for f, _ in EXPERT_GROUPS] == ["expt_tp", "ep", "expt_dp", "tp_ep", "tp_ep_pp"]
