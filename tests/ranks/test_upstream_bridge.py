"""Our colocated boundary against Megatron-core 0.19's `ColocatedBridgeCommunicator` on CPU/gloo (its
NCCL groups given the world's backend for the test's upstream part only: `bench/boundary_upstream.py`).

The same global edge tensor X [B, S, H] and weight W (same seed on every rank) go through both. Each
source rank feeds its rows of X, and each destination rank computes sum(y * W[its rows]). Both must
deliver exactly X[its rows] to every destination rank and return exactly W[its rows] to every source
rank (TP replicas included). The tensors come back to the test process, which compares ours, upstream's
and the expected slices. The upstream refusals the boundary bench reports are checked by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_hetero.bench import boundary_upstream as upstream
from megatron_hetero.layout import layout_from_dict
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.runtime.boundary import Boundary
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.topology import Topology

B, S, H = 8, 6, 4


def _doc(placement: str, src: dict, dst: dict) -> dict:
    return {"placement": placement, "modules": {"vision": src, "language": dst}, "edges": ["vision -> language"]}


def _rank(doc: dict) -> dict:
    rank = dist.get_rank()
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    src, dst = layout.module("vision"), layout.module("language")
    g = torch.Generator().manual_seed(7)
    X, W = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    s_rows, d_rows = dp_rows(B, src.dp, coord_of(src, rank).dp), dp_rows(B, dst.dp, coord_of(dst, rank).dp)
    out = {"x": X[s_rows.start : s_rows.stop], "w": W[d_rows.start : d_rows.stop]}
    topo = Topology.build(layout)
    try:
        bnd = Boundary(layout, layout.edges[0], batch=B, hidden=H, seq=S, headers=False, topology=topo)
        with upstream.upstream_on_this_machine() as counter:
            comm, refusal = upstream.build(topo, "vision", "language")
            assert refusal is None, refusal
            try:
                for name, fn in (("ours", bnd), ("upstream", comm.communicate)):
                    x = out["x"].clone().requires_grad_(True)
                    y = fn(x)
                    (y * out["w"]).sum().backward()
                    out[name] = (y.detach(), x.grad)
                out["upstream_bytes"] = counter.received
                out["analytic"] = upstream.analytic_bytes(comm, tuple(out["x"].shape), 4, dist.get_world_size())
            finally:
                comm.destroy()
        out["ours_bytes"] = bnd.stats["forward"].payload_bytes + bnd.stats["backward"].payload_bytes
        return out
    finally:
        topo.destroy()


CASES = [
    ("equal-dp TP2·DP2 -> TP2·DP2", _doc("colocated", {"tp": 2, "dp": 2}, {"tp": 2, "dp": 2})),
    ("fan-in DP4 -> TP2·DP2", _doc("colocated", {"dp": 4}, {"tp": 2, "dp": 2})),
    ("fan-out TP2·DP2 -> DP4", _doc("colocated", {"tp": 2, "dp": 2}, {"dp": 4})),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_colocated_boundary_and_upstream_bridge_deliver_the_same_tensors(case):
    label, doc = case
    per_rank = run_ranks(4, _rank, doc, timeout=120)
    for rank, r in enumerate(per_rank):
        (y_ours, g_ours), (y_up, g_up) = r["ours"], r["upstream"]
        assert torch.equal(y_ours, y_up), f"{label}: rank {rank}: forward tensors differ"
        assert torch.equal(g_ours, g_up), f"{label}: rank {rank}: source gradients differ"
    # the expected values: destination rows of X forward, source rows of W backward
    layout = layout_from_dict(doc, world_size=4)
    src, dst = layout.module("vision"), layout.module("language")
    g = torch.Generator().manual_seed(7)
    X, W = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    for rank, r in enumerate(per_rank):
        d = dp_rows(B, dst.dp, coord_of(dst, rank).dp)
        s = dp_rows(B, src.dp, coord_of(src, rank).dp)
        assert torch.equal(r["ours"][0], X[d.start : d.stop]), f"{label}: rank {rank}: not X's rows"
        assert torch.equal(r["ours"][1], W[s.start : s.stop]), f"{label}: rank {rank}: not W's rows"
    ours = sum(r["ours_bytes"] for r in per_rank)
    up = sum(r["upstream_bytes"] for r in per_rank)
    assert ours == up == per_rank[0]["analytic"], (ours, up, per_rank[0]["analytic"])


def test_upstream_bridge_refusals_are_named():
    """Upstream's ValueErrors before any group exists: CP, PP, grids on different ranks."""

    def refusals() -> list:
        out = []
        for doc in (
            _doc("colocated", {"tp": 2, "dp": 2}, {"cp": 2, "dp": 2}),
            _doc("colocated", {"dp": 4}, {"pp": 2, "dp": 2}),
            _doc("disjoint", {"dp": 2}, {"tp": 2}),
        ):
            layout = layout_from_dict(doc, world_size=dist.get_world_size())
            topo = Topology.build(layout)
            try:
                with upstream.upstream_on_this_machine():
                    out.append(upstream.build(topo, "vision", "language")[1])
            finally:
                topo.destroy()
        return out

    got = run_ranks(4, refusals, timeout=120)[0]
    assert got == [
        "dest CP must be 1 for ColocatedBridgeCommunicator, got 2",
        "dest PP must be 1 for ColocatedBridgeCommunicator, got 2",
        "Grids must have same rank offset: src=0, dest=2",
    ]
