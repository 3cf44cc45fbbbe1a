"""The hierarchical (leader-based) route of a disjoint edge, as explicit steps.

Pure data, no torch: every rank, root, group and block of the leader path is computed here once;
`runtime/hierarchical.py` only executes the steps. This is the route of Megatron-core's bridge
communicator (and the heteropipe design), kept for comparison with the direct route.

Leaders: source DP shard d's leader is (tp0, cp0, dp d) of the source's last stage; the destination
leader is (tp0, cp0, dp0) of the destination's first stage.

forward (activations):
  1. gather "source CP gather" (only when source cp > 1), one step per source DP shard: the TP-0
     ranks of the shard's CP group send their chunks (`holds`) to the shard leader, which assembles
     the full-sequence shard [B/dp_src, S, H];
  2. gather "leader send": every source leader sends its shard to the destination leader, which
     assembles the whole edge tensor [B, S, H];
  3. broadcast "TP-row broadcast" (destination tp > 1): the destination leader broadcasts the whole
     tensor over its TP group (process group `tp` of the destination);
  4. broadcast "DP x CP column broadcast" (destination dp*cp > 1), one step per TP position t: rank
     (tp t, cp0, dp0) broadcasts it down its DP x CP group (process group `dp_cp`);
  then every destination rank selects its `needs` from the whole tensor.
backward (gradients, the inverse):
  1. gather "gradient gather": the destination TP-0 ranks that need anything send their gradient
     blocks (`needs`) to the destination leader (TP replicas hold identical gradients; one copy
     travels), which assembles the gradient of the whole edge tensor;
  2. scatter "gradient leader send": the destination leader sends each source leader the gradient
     of its shard;
  3. broadcast "source TP x CP broadcast" (source tp*cp > 1), one step per source DP shard: the
     shard leader broadcasts it over its TP x CP group (process group `tp_cp` of the source);
  then every source rank selects its `holds` from its shard.

Every step lists its transfers (a broadcast as one transfer of its region from the root to each
other member); the bytes of a direction are the bytes of its non-local transfers, which is what the
plan prices as the hierarchical mode (`ModeCost`, forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.blocks import Block, BoundaryShape, Transfer
from megatron_hetero.plan.interval_route import needed_blocks, owned_blocks
from megatron_hetero.plan.placement import rank_of

STEP_KINDS = ("gather", "scatter", "broadcast")
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class RouteStep:
    """One phase of the leader route on one group of ranks.

    kind:
      gather    - point-to-point: every member sends its pieces (`transfers` with dst == root) to
                  `root`, which assembles the rectangle `regions` gives it (its own pieces are local
                  copies, src == dst == root);
      scatter   - point-to-point: `root` sends each other member one piece; each receiver then holds
                  that piece as its rectangle;
      broadcast - collective over the process group `pg` of module `module` (membership `group`):
                  `root` broadcasts its rectangle; every member then holds it.
    `regions`: (rank, rectangle) for every rank that holds a new tensor after the step.
    """

    direction: str
    kind: str
    label: str
    root: int
    group: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    regions: tuple[tuple[int, Block], ...]
    module: str = ""
    pg: str = ""

    def region_of(self, rank: int) -> Optional[Block]:
        """The rectangle `rank` holds after this step (None when the step leaves it unchanged)."""
        for r, blk in self.regions:
            if r == rank:
                return blk
        return None

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank and not t.local]

    def recvs(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank and not t.local]

    def local_copies(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.local and t.dst == rank]

    def bytes_sent_per_rank(self, shape: BoundaryShape) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.transfers:
            if not t.local:
                out[t.src] = out.get(t.src, 0) + t.block.numel(shape.hidden) * shape.dtype_bytes
        return out

    def bytes(self, shape: BoundaryShape) -> int:
        return sum(self.bytes_sent_per_rank(shape).values())

    def describe(self, shape: BoundaryShape) -> str:
        where = f" over {self.module}:{self.pg}" if self.kind == "broadcast" else ""
        msgs = len({(t.src, t.dst) for t in self.transfers if not t.local})  # pieces to one peer travel together
        return (
            f"{self.kind:<9} {self.label}: root {self.root}, group {list(self.group)}{where}, "
            f"{msgs} message{'s' if msgs != 1 else ''}, {self.bytes(shape)} B"
        )


@dataclass(frozen=True)
class LeaderRoute:
    """The whole leader route of one edge for one shape (see module docstring)."""

    shape: BoundaryShape
    src_leaders: tuple[int, ...]
    dst_leader: int
    forward: tuple[RouteStep, ...]
    backward: tuple[RouteStep, ...]
    hops: int

    def steps(self, direction: str) -> tuple[RouteStep, ...]:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        return self.forward if direction == "forward" else self.backward

    def steps_of(self, rank: int, direction: str) -> list[RouteStep]:
        """The steps `rank` takes part in, in route order."""
        return [s for s in self.steps(direction) if rank in s.group]

    def bytes(self, direction: str = "forward") -> int:
        return sum(s.bytes(self.shape) for s in self.steps(direction))

    def bytes_sent_per_rank(self, direction: str = "forward") -> dict[int, int]:
        out: dict[int, int] = {}
        for s in self.steps(direction):
            for r, n in s.bytes_sent_per_rank(self.shape).items():
                out[r] = out.get(r, 0) + n
        return out

    def __str__(self) -> str:
        lines = [f"leaders: source {list(self.src_leaders)}, destination {self.dst_leader}"]
        for d in DIRECTIONS:
            lines.append(f"{d} ({self.bytes(d)} B):")
            lines += [f"  {i + 1}. {s.describe(self.shape)}" for i, s in enumerate(self.steps(d))]
        return "\n".join(lines)


def leaders(src: ModuleLayout, dst: ModuleLayout) -> tuple[tuple[int, ...], int]:
    """(source DP shard leaders in DP order, destination leader) of a src -> dst edge."""
    return tuple(rank_of(src, dp=d, pp=src.pp - 1) for d in range(src.dp)), rank_of(dst)


def _p2p(
    direction: str, kind: str, label: str, root: int, transfers: list[Transfer], regions: dict[int, Block]
) -> RouteStep:
    group = sorted({t.src for t in transfers} | {t.dst for t in transfers} | {root})
    into: dict[int, list[Block]] = {}
    for t in transfers:
        into.setdefault(t.dst, []).append(t.block)
    for r, region in regions.items():  # internal invariant: each assembled rectangle is tiled exactly
        got = into.get(r, [])
        assert all(region.contains(b) for b in got), (label, r, region, got)
        assert sum(b.numel(1) for b in got) == region.numel(1), (label, r, region, got)
    return RouteStep(direction, kind, label, root, tuple(group), tuple(transfers), tuple(sorted(regions.items())))


def _broadcast(
    direction: str, label: str, root: int, group: list[int], region: Block, module: str, pg: str
) -> RouteStep:
    assert root in group, (label, root, group)
    transfers = tuple(Transfer(root, r, region) for r in sorted(group) if r != root)
    return RouteStep(
        direction,
        "broadcast",
        label,
        root,
        tuple(sorted(group)),
        transfers,
        tuple((r, region) for r in sorted(group)),
        module=module,
        pg=pg,
    )


def plan_leader_route(src: ModuleLayout, dst: ModuleLayout, shape: BoundaryShape) -> LeaderRoute:
    """The leader route of a disjoint src -> dst edge (the blocks each rank holds and needs are the
    plan's ownership, `interval_route.owned_blocks` / `needed_blocks`)."""
    src_leaders, dst_leader = leaders(src, dst)
    last = src.pp - 1
    whole = Block(0, shape.batch, 0, shape.seq)
    shards = []
    for d in range(src.dp):
        rows = dp_rows(shape.batch, src.dp, d)
        shards.append(Block(rows.start, rows.stop, 0, shape.seq))

    fwd: list[RouteStep] = []
    if src.cp > 1:
        for d, leader in enumerate(src_leaders):
            members = [rank_of(src, cp=k, dp=d, pp=last) for k in range(src.cp)]
            pieces = [Transfer(m, leader, b) for m in members for b in owned_blocks(src, m, shape)]
            fwd.append(
                _p2p("forward", "gather", f"source CP gather ({src.name} dp{d})", leader, pieces, {leader: shards[d]})
            )
    fwd.append(
        _p2p(
            "forward",
            "gather",
            "leader send",
            dst_leader,
            [Transfer(leader, dst_leader, shards[d]) for d, leader in enumerate(src_leaders)],
            {dst_leader: whole},
        )
    )
    if dst.tp > 1:
        fwd.append(
            _broadcast(
                "forward",
                f"TP-row broadcast ({dst.name})",
                dst_leader,
                [rank_of(dst, tp=t) for t in range(dst.tp)],
                whole,
                dst.name,
                "tp",
            )
        )
    if dst.dp * dst.cp > 1:
        for t in range(dst.tp):
            column = [rank_of(dst, tp=t, cp=c, dp=d) for d in range(dst.dp) for c in range(dst.cp)]
            fwd.append(
                _broadcast(
                    "forward",
                    f"DP x CP column broadcast ({dst.name} tp{t})",
                    rank_of(dst, tp=t),
                    column,
                    whole,
                    dst.name,
                    "dp_cp",
                )
            )

    bwd: list[RouteStep] = []
    # the destination's TP-0 ranks of its first stage, in rank order (dp slowest, then cp)
    tp0 = [rank_of(dst, cp=c, dp=d) for d in range(dst.dp) for c in range(dst.cp)]
    bwd.append(
        _p2p(
            "backward",
            "gather",
            f"gradient gather ({dst.name} tp0)",
            dst_leader,
            [Transfer(r, dst_leader, b) for r in tp0 for b in needed_blocks(dst, r, shape)],
            {dst_leader: whole},
        )
    )
    bwd.append(
        _p2p(
            "backward",
            "scatter",
            "gradient leader send",
            dst_leader,
            [Transfer(dst_leader, leader, shards[d]) for d, leader in enumerate(src_leaders)],
            {leader: shards[d] for d, leader in enumerate(src_leaders)},
        )
    )
    if src.tp * src.cp > 1:
        for d, leader in enumerate(src_leaders):
            group = [rank_of(src, tp=t, cp=c, dp=d, pp=last) for c in range(src.cp) for t in range(src.tp)]
            bwd.append(
                _broadcast(
                    "backward",
                    f"source TP x CP broadcast ({src.name} dp{d})",
                    leader,
                    group,
                    shards[d],
                    src.name,
                    "tp_cp",
                )
            )

    # Serial hops of the forward path: the CP gather, one message per source leader into the single
    # destination leader, then the two broadcast levels.
    hops = (1 if src.cp > 1 else 0) + src.dp + (1 if dst.tp > 1 else 0) + (1 if dst.dp * dst.cp > 1 else 0)
    return LeaderRoute(
        shape=shape, src_leaders=src_leaders, dst_leader=dst_leader, forward=tuple(fwd), backward=tuple(bwd), hops=hops
    )
