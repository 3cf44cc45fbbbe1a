"""The `plan` report of a large world: a summary without a line per rank, and one rank's whole plan.

Pure. The summary's cost grows with the world only through counting (the bytes by arithmetic, the
messages by counting each needer's sources); nothing here holds every rank's transfers. Used by
`megatron-hetero plan` above `SUMMARY_ABOVE` ranks (or with --summary) and with --rank R.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_hetero.layout.spec import Edge, HeteroLayout
from megatron_hetero.plan.blocks import BoundaryShape, Transfer
from megatron_hetero.plan.boundary import ModeCost, check_shape, transform_of
from megatron_hetero.plan.boundary_rank import RankBoundaryPlan, plan_rank_boundary
from megatron_hetero.plan.colocated import stage_peer
from megatron_hetero.plan.interval_route import Side, message_counts, min_bytes
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.plan.route import leaders, plan_leader_route
from megatron_hetero.report.plan import fmt_bytes, expert_coord, is_moe

#: Worlds above this many ranks get the summary by default (the full report has a line per rank).
SUMMARY_ABOVE = 256


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)


def sample_ranks(layout: HeteroLayout) -> list[int]:
    """Rank 0, the last rank, and the first rank of every pipeline stage of every module."""
    out = {0, layout.world_size - 1}
    for m in layout.modules:
        out.update(m.offset + s * m.stage_size for s in range(m.pp))
    return sorted(out)


def edge_summary(layout: HeteroLayout, edge: Edge, shape: BoundaryShape) -> dict[str, Any]:
    """One edge without its transfer lists: transform, the two sides' ranks, bytes (the direct route
    moves exactly the minimum), messages (one per (source, destination) pair) and the most peers of
    one rank per direction, the modes' costs and the leaders."""
    src, dst = layout.module(edge.src), layout.module(edge.dst)
    check_shape(edge, src, dst, shape)
    transform, factor = transform_of(src, dst)
    s, d = Side.source(src, shape), Side.destination(dst, shape)
    fwd_msgs, fwd_peers = message_counts(d, s)
    bwd_msgs, bwd_peers = message_counts(s, d)
    fwd_bytes = min_bytes(d, s)
    costs = {"direct": ModeCost(bytes=fwd_bytes, hops=fwd_peers)}
    if layout.placement == "disjoint":
        route = plan_leader_route(src, dst, shape)
        costs["hierarchical"] = ModeCost(bytes=route.bytes("forward"), hops=route.hops)
    src_leaders, dst_leader = leaders(src, dst)
    return {
        "src": edge.src,
        "dst": edge.dst,
        "transform": transform,
        "factor": factor,
        "shape": {"batch": shape.batch, "seq": shape.seq, "hidden": shape.hidden, "dtype_bytes": shape.dtype_bytes},
        "src_ranks": _span(s.ranks),
        "dst_ranks": _span(d.ranks),
        "bytes_forward": fwd_bytes,
        "bytes_backward": min_bytes(s, d),
        "messages_forward": fwd_msgs,
        "messages_backward": bwd_msgs,
        "max_peers_forward": fwd_peers,
        "max_peers_backward": bwd_peers,
        "modes": {k: {"bytes": c.bytes, "hops": c.hops} for k, c in costs.items()},
        "recommended_mode": min(costs, key=lambda k: (costs[k].bytes, costs[k].hops)),
        "src_leaders": {"count": len(src_leaders), "first": src_leaders[0], "last": src_leaders[-1]},
        "dst_leader": dst_leader,
    }


def _module_coords(layout: HeteroLayout, rank: int, experts: Optional[dict[str, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in layout.modules:
        if m.rank_range.start <= rank <= m.rank_range.end:
            c = coord_of(m, rank)
            out[m.name] = {
                **c.as_dict(),
                **(expert_coord(m, c) if is_moe(m, experts) else {}),
                "prev_rank": stage_peer(layout, m.name, rank, -1),
                "next_rank": stage_peer(layout, m.name, rank, +1),
            }
    return out


def _count(p: RankBoundaryPlan, direction: str) -> dict[str, int]:
    nb = p.shape.hidden * p.shape.dtype_bytes
    sends, recvs = p.sends(direction), p.recvs(direction)
    return {
        "sends": len(sends),
        "send_peers": len({t.dst for t in sends}),
        "bytes_sent": sum(t.block.numel(1) for t in sends) * nb,
        "recvs": len(recvs),
        "recv_peers": len({t.src for t in recvs}),
        "bytes_received": sum(t.block.numel(1) for t in recvs) * nb,
        "local_copies": len(p.local_copies(direction)),
    }


def summary_json(
    layout: HeteroLayout, shape: BoundaryShape, experts: Optional[dict[str, int]] = None
) -> dict[str, Any]:
    """The `plan --json` document of a large world (`summary: true`): module grids, every edge's
    `edge_summary`, and the sample ranks' coordinates and per-edge counts."""
    samples = []
    for r in sample_ranks(layout):
        edges = {}
        for e in layout.edges:
            p = plan_rank_boundary(layout, e, shape, r)
            if p.is_src or p.is_dst:
                edges[str(e)] = {d: _count(p, d) for d in ("forward", "backward")}
        samples.append({"rank": r, "modules": _module_coords(layout, r, experts), "edges": edges})
    return {
        "world_size": layout.world_size,
        "placement": layout.placement,
        "boundary_mode": layout.boundary_mode,
        "summary": True,
        "modules": {
            m.name: {**m.degrees(), "ranks": str(m.ranks), "stage_size": m.stage_size, "frozen": m.frozen}
            for m in layout.modules
        },
        "edges": [edge_summary(layout, e, shape) for e in layout.edges],
        "sample_ranks": samples,
    }


def summary_text(doc: dict[str, Any]) -> str:
    """The `plan` summary as text, from `summary_json`'s document."""
    lines = [
        f"world size {doc['world_size']}, placement {doc['placement']}, boundary mode {doc['boundary_mode']} (summary; --rank R for one rank's whole plan)",
        "",
    ]
    for name, m in doc["modules"].items():
        grid = f"TP{m['tp']}·CP{m['cp']}·PP{m['pp']}·DP{m['dp']}" + (
            f"·EP{m['ep']}·ETP{m['expt_tp']}" if m["ep"] > 1 or m["expt_tp"] > 1 else ""
        )
        lines.append(
            f"module {name}: {grid} on ranks {m['ranks']}, {m['stage_size']} ranks per stage"
            + (" (frozen)" if m["frozen"] else "")
        )
    for e in doc["edges"]:
        s = e["shape"]
        lines += [
            "",
            f"edge {e['src']}->{e['dst']}: {e['transform']}"
            + (f" x{e['factor']}" if e["factor"] > 1 else "")
            + f"  [batch {s['batch']}, seq {s['seq']}, hidden {s['hidden']}] x {s['dtype_bytes']} B",
            f"  source ranks {e['src_ranks']} -> destination ranks {e['dst_ranks']}",
            f"  forward : moves {fmt_bytes(e['bytes_forward'])} (the minimum) in {e['messages_forward']} messages, "
            f"at most {e['max_peers_forward']} peers per rank",
            f"  backward: moves {fmt_bytes(e['bytes_backward'])} (the minimum) in {e['messages_backward']} messages, "
            f"at most {e['max_peers_backward']} peers per rank",
            "  modes   : "
            + ", ".join(f"{k} {fmt_bytes(c['bytes'])} in {c['hops']} serial hops" for k, c in e["modes"].items())
            + f"; recommended {e['recommended_mode']}",
            f"  leaders : {e['src_leaders']['count']} source (ranks {e['src_leaders']['first']}.."
            f"{e['src_leaders']['last']}), destination {e['dst_leader']}",
        ]
    lines += ["", "sample ranks (0, the last, the first of every module stage):"]
    for r in doc["sample_ranks"]:
        coords = "; ".join(f"{n} tp{c['tp']} cp{c['cp']} dp{c['dp']} pp{c['pp']}" for n, c in r["modules"].items())
        lines.append(f"  rank {r['rank']}: {coords or 'idle'}")
        for name, dirs in r["edges"].items():
            f, b = dirs["forward"], dirs["backward"]
            lines.append(
                f"    {name}: forward sends {f['sends']} to {f['send_peers']} peers ({fmt_bytes(f['bytes_sent'])}), "
                f"receives {f['recvs']} from {f['recv_peers']} ({fmt_bytes(f['bytes_received'])}), "
                f"copies {f['local_copies']}; backward sends {b['sends']}, receives {b['recvs']}, "
                f"copies {b['local_copies']}"
            )
    return "\n".join(lines)


def _transfer(t: Transfer) -> dict[str, int]:
    b = t.block
    return {"src": t.src, "dst": t.dst, "b0": b.b0, "b1": b.b1, "s0": b.s0, "s1": b.s1}


def rank_json(
    layout: HeteroLayout,
    shape: BoundaryShape,
    rank: int,
    experts: Optional[dict[str, int]] = None,
    schedule: Optional[list[str]] = None,
) -> dict[str, Any]:
    """`plan --rank R --json`: the rank's coordinates and pipeline peers in every module it serves,
    its part of every edge it is on (transfers in plan order, both directions) and, when given, its
    schedule table's lines."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"--rank {rank} is outside the layout's world size {layout.world_size}")
    edges = {}
    for e in layout.edges:
        p = plan_rank_boundary(layout, e, shape, rank)
        if p.is_src or p.is_dst:
            edges[str(e)] = {
                "transform": p.transform,
                "factor": p.factor,
                "is_src": p.is_src,
                "is_dst": p.is_dst,
                "holds": [[b.b0, b.b1, b.s0, b.s1] for b in p.holds],
                "needs": [[b.b0, b.b1, b.s0, b.s1] for b in p.needs],
                **{
                    d: {
                        "sends": [_transfer(t) for t in p.sends(d)],
                        "recvs": [_transfer(t) for t in p.recvs(d)],
                        "local_copies": [_transfer(t) for t in p.local_copies(d)],
                    }
                    for d in ("forward", "backward")
                },
            }
    doc: dict[str, Any] = {
        "world_size": layout.world_size,
        "placement": layout.placement,
        "boundary_mode": layout.boundary_mode,
        "rank": rank,
        "modules": _module_coords(layout, rank, experts),
        "edges": edges,
    }
    if schedule is not None:
        doc["schedule"] = schedule
    return doc


def rank_text(doc: dict[str, Any]) -> str:
    """`plan --rank R` as text, from `rank_json`'s document."""
    lines = [
        f"rank {doc['rank']} of world size {doc['world_size']}, placement {doc['placement']}, "
        f"boundary mode {doc['boundary_mode']}"
    ]
    if not doc["modules"]:
        lines.append("  idle: no module uses this rank")
    for n, c in doc["modules"].items():
        lines.append(
            f"  {n}: tp{c['tp']} cp{c['cp']} dp{c['dp']} pp{c['pp']}, pipeline peers "
            f"prev {c['prev_rank'] if c['prev_rank'] is not None else '-'}, "
            f"next {c['next_rank'] if c['next_rank'] is not None else '-'}"
        )
    for name, e in doc["edges"].items():
        side = "+".join(s for s, on in (("source", e["is_src"]), ("destination", e["is_dst"])) if on)
        lines.append(f"  edge {name} ({e['transform']}, {side}):")
        for d in ("forward", "backward"):
            x = e[d]
            parts = []
            if x["local_copies"]:
                parts.append("selects " + ", ".join(_block(t) for t in x["local_copies"]))
            if x["recvs"]:
                parts.append("receives " + ", ".join(f"{_block(t)} from {t['src']}" for t in x["recvs"]))
            if x["sends"]:
                parts.append("sends " + ", ".join(f"{_block(t)} to {t['dst']}" for t in x["sends"]))
            lines.append(f"    {d:<8}: " + ("; ".join(parts) or "-"))
    if "schedule" in doc:
        lines.append("  schedule:")
        lines += [f"    {line}" for line in doc["schedule"]]
    return "\n".join(lines)


def _block(t: dict[str, int]) -> str:
    return f"b[{t['b0']}:{t['b1']}] s[{t['s0']}:{t['s1']}]"
