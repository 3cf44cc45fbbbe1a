"""Multi-rank Topology tests on CPU/gloo (world 8, forked ranks).

For every module and every group kind (dense and expert), the runtime group of each member rank
must equal the group the pure plan computes, and an all-reduce over it must give the sum of its
members' ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.placement import coord_of, group_ranks
from megatron_hetero.runtime.launcher import RankFailure, run_ranks
from megatron_hetero.runtime.topology import DENSE_GROUPS, EXPERT_AXES, EXPERT_GROUPS, Topology

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
MOE = {"placement": "colocated", "modules": {"language": {"tp": 2, "dp": 4, "ep": 4}}}


def _expert_groups(m, dims: tuple[str, ...]) -> list[list[int]]:
    """The plan's expert groups of module `m` that vary over `dims`, in the runtime's axis names
    (EXPERT_AXES: tp = expert-TP, ep, dp = expert-DP, pp). Expert-TP and EP coordinates are the plan's
    (`coord_of`); a rank's expert-DP coordinate is its index among the ranks of its pipeline stage
    with the same (expert-TP, EP) coordinates."""
    coords = {r: coord_of(m, r) for r in m.ranks.ranks()}
    peers: dict[tuple, list[int]] = {}
    edp = {}
    for r, c in coords.items():
        same = peers.setdefault((c.pp, c.ep, c.expt_tp), [])
        edp[r] = len(same)
        same.append(r)
    value = {
        "tp": lambda r: coords[r].expt_tp,
        "ep": lambda r: coords[r].ep,
        "dp": edp.__getitem__,
        "pp": lambda r: coords[r].pp,
    }
    assert set(value) == set(EXPERT_AXES), EXPERT_AXES
    groups: dict[tuple, list[int]] = {}
    for r in coords:
        groups.setdefault(tuple(value[a](r) for a in EXPERT_AXES if a not in dims), []).append(r)
    return list(groups.values())


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
            for field, dims in EXPERT_GROUPS:  # every module, dense ones too (Megatron DDP asks)
                expect = next(g for g in _expert_groups(m, dims) if rank in g)
                got = sorted(dist.get_process_group_ranks(getattr(pgs, field)))
                assert got == expect, (m.name, field, got, expect)
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=getattr(pgs, field))
                assert t.item() == float(sum(expect)), (m.name, field, t.item(), expect)
                seen[(m.name, field)] = got
    finally:
        topo.destroy()
        topo.destroy()  # idempotent
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", [COLOCATED, DISJOINT, MOE], ids=["colocated", "disjoint", "moe"])
def test_topology_groups_match_plan(doc):
    results = run_ranks(8, _check_groups, doc, timeout=90)
    layout = layout_from_dict(doc, world_size=8)
    # every member rank checked every dense and expert group of every module it serves, and
    # nothing else (a rank outside a module has none of its groups)
    for r in range(8):
        assert set(results[r]) == {
            (m.name, field) for m in layout.modules if r in m.ranks.ranks() for field, _ in DENSE_GROUPS + EXPERT_GROUPS
        }, r
    if doc is MOE:
        # Megatron's folding: inside a stage the expert grid is expt_tp fastest, then ep; the plan's
        # groups above must agree with this hand-computed case.
        assert results[0][("language", "ep")] == [0, 1, 2, 3]
        assert results[5][("language", "ep")] == [4, 5, 6, 7]
        assert results[5][("language", "expt_dp")] == [1, 5]
        assert results[5][("language", "tp_ep")] == [4, 5, 6, 7]


def _wrong_world(doc: dict) -> None:
    layout = layout_from_dict(doc)
    Topology.build(layout)


@pytest.mark.timeout(60)
def test_topology_rejects_world_mismatch():
    with pytest.raises(RankFailure, match=r"layout uses ranks 0-7 \(8\) but the job has world size 4"):
        run_ranks(4, _wrong_world, COLOCATED, timeout=30)


def test_plan_expert_groups_partition_each_module():
    """The reference the multi-rank test compares against: for each expert group kind the plan's
    groups partition the module's ranks, with the size the degrees give."""
    for doc in (COLOCATED, DISJOINT, MOE):
        for m in layout_from_dict(doc).modules:
            sizes = {"tp": m.expt_tp, "ep": m.ep, "dp": m.stage_size // (m.expt_tp * m.ep), "pp": m.pp}
            for field, dims in EXPERT_GROUPS:
                groups = _expert_groups(m, dims)
                assert sorted(r for g in groups for r in g) == list(m.ranks.ranks()), (m.name, field)
                want = 1
                for d in dims:
                    want *= sizes[d]
                assert {len(g) for g in groups} == {want}, (m.name, field, groups)
