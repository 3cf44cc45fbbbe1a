"""Autograd-aware boundary: carries one edge's tensor from the source layout to the destination layout.

`Boundary(layout, edge, ...)` is built identically on every rank; calling it runs the edge's
transform for this rank as one `torch.autograd.Function` (`boundary_autograd.BoundaryFunction`, whose docstring
lists exactly what goes over the wire in each mode and direction). Every rank, block and byte
count comes from this rank's pure plan (`plan.boundary_rank.plan_rank_boundary`: its own sends,
receives and local copies, never the other ranks'; for the hierarchical mode also the edge's leader
`route` of `plan/route.py`), one per sequence length, cached in a `BoundaryPlanCache` that the
boundaries of one schedule share; this file only moves tensors.

Two modes:
- "direct" (default; the only mode of a colocated edge): point-to-point messages between the
  ranks of the plan's transfers (one message per peer and phase) plus local copies where a rank
  already holds a piece - in colocated placement both sides are the same set of ranks, nothing
  leaves it and nothing is all-gathered. Forward has a header phase (variable sequence lengths
  are learnt from it), then the payload phase; backward is the inverse route of the gradients.
- "hierarchical" (disjoint edges only; needs the Topology's groups and a fixed seq): the leader
  route's steps, executed by `runtime/hierarchical.py`; the layout's `boundary_mode` (the disjoint
  schedule builds its boundaries in it).

Local tensor layout on a rank: `[batch / dp, tokens, hidden]` where tokens are its blocks'
sequence intervals concatenated in plan order (for cp > 1: chunk c then chunk 2cp-1-c).

Pass-through: where this rank's plan says its destination tensor is its source tensor
(`RankBoundaryPlan.pass_through`: colocated equal-DP with the same TP/CP on both sides, nothing sent
or received in either direction), the call returns the source tensor itself (as an autograd view, no
copy) and its backward hands the gradient back unchanged; nothing goes over the wire.

What the call returns: on a destination rank, the tensor in the destination layout; on a
source-only rank (disjoint), a 0-element "token" tensor: call `Boundary.backward_source(token)`
(or `token.backward(token.new_empty(0))`) once the destination's gradient will arrive; on a rank
that is neither, `None`. The disjoint schedule may also call `forward_exchange` /
`backward_exchange` directly (no autograd), one side per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.layout.degrees import DEFAULT_COMM_TIMEOUT_S
from megatron_hetero.layout.spec import Edge, HeteroLayout
from megatron_hetero.plan.blocks import Block, Transfer, local_extent
from megatron_hetero.plan.boundary import MODES, BoundaryShape, check_shape
from megatron_hetero.plan.boundary_rank import BoundaryPlanCache, RankBoundaryPlan
from megatron_hetero.runtime.boundary_autograd import BoundaryFunction, PassThrough
from megatron_hetero.runtime.hierarchical import run_route
from megatron_hetero.runtime.wire import (
    CODE_DTYPES,
    DTYPE_CODES,
    HEADER_LEN,
    WireStats,
    copy_local,
    header,
    p2p,
    pack,
    unpack,
)

if TYPE_CHECKING:
    from megatron_hetero.runtime.topology import Topology


@dataclass
class Phase:
    """One exchange of a boundary on this rank before it goes on the wire: `sends` {peer: tensor},
    `recvs` {peer: buffer} (global ranks, message tag `tag`), and `finish()`, to call once every
    message has arrived (assembles this rank's output; None where it wants nothing). The disjoint
    schedule posts the phases of several boundaries and pipeline links as one batch."""

    sends: dict[int, torch.Tensor]
    recvs: dict[int, torch.Tensor]
    finish: Callable[[], Optional[torch.Tensor]]
    tag: int


class Boundary:
    """One edge's boundary on this rank (see module docstring)."""

    def __init__(
        self,
        layout: HeteroLayout,
        edge: Edge | str,
        *,
        batch: int,
        hidden: int,
        seq: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        dst_seq: Optional[int] = None,
        dst_offset: int = 0,
        mode: str = "direct",
        timeout_s: float = DEFAULT_COMM_TIMEOUT_S,
        device: Optional[torch.device] = None,
        topology: Optional["Topology"] = None,
        headers: bool = True,
        plans: Optional[BoundaryPlanCache] = None,
    ) -> None:
        edge = Edge.parse(edge) if isinstance(edge, str) else edge
        if edge not in layout.edges:
            raise ValueError(f"edge {edge} is not declared; edges are {[str(e) for e in layout.edges]}")
        if mode not in MODES:
            raise ValueError(f"edge {edge}: mode must be one of {list(MODES)}, got {mode!r}")
        if mode == "hierarchical":
            if layout.placement != "disjoint":
                raise ValueError(f"edge {edge}: the hierarchical (leader) mode is for disjoint placement only")
            if topology is None or seq is None:
                raise ValueError(f"edge {edge}: the hierarchical mode needs the Topology and a fixed seq")
        if dtype not in DTYPE_CODES:
            raise ValueError(f"edge {edge}: dtype {dtype} is not supported; use one of {list(DTYPE_CODES)}")
        if not dist.is_initialized():
            raise RuntimeError("Boundary needs torch.distributed to be initialized")
        world = dist.get_world_size()
        if layout.world_size != world:
            raise ValueError(
                f"edge {edge}: the layout places modules on ranks 0-{layout.world_size - 1} but the job has "
                f"world size {world}: edge peers would be missing"
            )
        if dst_seq is not None and seq is None:
            raise ValueError(f"edge {edge}: a destination sequence (dst_seq) needs a fixed edge seq")
        if not headers and seq is None:
            raise ValueError(f"edge {edge}: a forward without headers (headers=False) needs a fixed edge seq")
        self.layout, self.edge, self.mode = layout, edge, mode
        self.src, self.dst = layout.module(edge.src), layout.module(edge.dst)
        self.batch, self.hidden, self.seq, self.dtype = batch, hidden, seq, dtype
        self.dst_seq, self.dst_offset = dst_seq, dst_offset
        self.headers = headers  # False: the direct forward skips its header round (fixed seq; see forward_exchange)
        self.timeout_s = float(timeout_s)
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank()
        self.tag = layout.edges.index(edge)
        self.stats = {"forward": WireStats(), "backward": WireStats()}
        if plans is not None and (plans.rank != self.rank or plans.layout != layout):
            raise ValueError(f"edge {edge}: the plan cache is for another layout or rank")
        # this rank's plans, one per sequence length (shared with the other boundaries of a schedule)
        self.plans = plans if plans is not None else BoundaryPlanCache(layout, self.rank)
        self._plans: dict[int, RankBoundaryPlan] = {}
        # The peers never depend on the sequence length: learn them from a canonical plan.
        canon = self.plan_for(seq if seq is not None else self._canonical_seq())
        self.is_src = canon.is_src  # the source module's last stage
        self.is_dst = canon.is_dst  # the destination module's first stage
        self.fwd_recv_peers = sorted({t.src for t in canon.recvs("forward")})
        # The sample rows this rank holds as a source (the plan's DP rule; independent of seq).
        held = canon.holds
        self._src_rows = held[0].b1 - held[0].b0 if held else 0
        # Hierarchical mode: the plan's leader route, and the process group of every broadcast step
        # this rank is a member of (steps and membership do not depend on the sequence length).
        self.route = canon.route if mode == "hierarchical" else None
        self._groups: dict[str, dict[int, dist.ProcessGroup]] = {"forward": {}, "backward": {}}
        if self.route is not None:
            for direction in ("forward", "backward"):
                for i, step in enumerate(self.route.steps(direction)):
                    if step.kind == "broadcast" and self.rank in step.group:
                        pg = getattr(topology.pg_collection(step.module), step.pg)
                        members = tuple(sorted(dist.get_process_group_ranks(pg)))
                        assert members == step.group, (step.label, members, step.group)
                        self._groups[direction][i] = pg

    def _canonical_seq(self) -> int:
        n = 1
        for m in (self.src, self.dst):
            if m.cp > 1:
                n = n * 2 * m.cp
        return n

    def plan_for(self, seq: int) -> RankBoundaryPlan:
        """This rank's (cached) plan of the edge for sequence length `seq`; ValueError on a bad shape."""
        if seq not in self._plans:
            shape = BoundaryShape(
                self.batch,
                seq,
                self.hidden,
                torch.empty(0, dtype=self.dtype).element_size(),
                dst_seq=self.dst_seq,
                dst_offset=self.dst_offset,
            )
            check_shape(self.edge, self.src, self.dst, shape)
            self._plans[seq] = self.plans.get(self.edge, shape, with_route=self.mode == "hierarchical")
        return self._plans[seq]

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if not (self.is_src or self.is_dst):
            if x is not None:
                raise ValueError(f"edge {self.edge}: rank {self.rank} is on neither side but got a tensor")
            return None
        if self.is_src:
            seq = self._check_source(x)
            if self.plan_for(seq).pass_through:  # shape errors before any communication
                return PassThrough.apply(self, x)
            return BoundaryFunction.apply(self, x)
        if x is not None:
            raise ValueError(f"edge {self.edge}: rank {self.rank} is only a destination; pass None")
        anchor = torch.empty(0, dtype=self.dtype, device=self.device, requires_grad=True)
        return BoundaryFunction.apply(self, anchor)

    @staticmethod
    def backward_source(token: torch.Tensor) -> None:
        """Run the backward of a source-only rank (receives and applies the gradients)."""
        torch.autograd.backward(token, token.new_empty(token.shape))

    def _check_source(self, x: Optional[torch.Tensor]) -> int:
        """Check the local source tensor; return the global sequence length it implies."""
        e, m = self.edge, self.src
        if not isinstance(x, torch.Tensor):
            raise ValueError(
                f"edge {e}: rank {self.rank} is a source of {m.name} and needs a tensor, got {type(x).__name__}"
            )
        if x.dtype != self.dtype:
            raise ValueError(f"edge {e}: rank {self.rank} got dtype {x.dtype}, the edge carries {self.dtype}")
        if x.dim() != 3:
            raise ValueError(
                f"edge {e}: rank {self.rank} expects a [batch, seq, hidden] tensor, got shape {tuple(x.shape)}"
            )
        if x.shape[0] != self._src_rows or x.shape[2] != self.hidden:
            raise ValueError(
                f"edge {e}: rank {self.rank} expects [batch/dp={self._src_rows}, seq, hidden={self.hidden}], "
                f"got {tuple(x.shape)}"
            )
        seq = x.shape[1] * m.cp
        if self.seq is not None and seq != self.seq:
            raise ValueError(
                f"edge {e}: rank {self.rank} holds {x.shape[1]} tokens (x cp {m.cp} = {seq}), "
                f"the edge carries seq {self.seq}"
            )
        return seq

    # -- the two exchanges --------------------------------------------------------------------
    def _numel(self, transfers: list[Transfer]) -> int:
        return sum(t.block.numel(self.hidden) for t in transfers)

    def _phase(
        self,
        plan: RankBoundaryPlan,
        direction: str,
        have: Optional[torch.Tensor],
        have_blocks: tuple[Block, ...],
        want_blocks: tuple[Block, ...],
        headers: int = 0,
    ) -> "Phase":
        """The payload phase of `direction` on this rank, not yet on the wire: `have` (this rank's
        blocks) packed per destination peer, a buffer per source peer, and `finish` to assemble what
        this rank wants from local copies and the received pieces (None if it wants nothing)."""
        sends, recvs = plan.peers(direction)
        payloads = {p: pack(have, have_blocks, ts) for p, ts in sends.items()}
        bufs = {p: torch.empty(self._numel(ts), dtype=self.dtype, device=self.device) for p, ts in recvs.items()}
        sent = sum(v.numel() * v.element_size() for v in payloads.values())

        def finish() -> Optional[torch.Tensor]:
            self.stats[direction].record_call(sent, headers, len(payloads))
            if not want_blocks:
                return None
            out = torch.empty(*local_extent(want_blocks), self.hidden, dtype=self.dtype, device=self.device)
            copy_local(out, want_blocks, have, have_blocks, plan.local_copies(direction))
            for p, ts in recvs.items():
                unpack(out, want_blocks, ts, bufs[p])
            return out

        return Phase(payloads, bufs, finish, self.tag)

    def _move(
        self,
        plan: RankBoundaryPlan,
        direction: str,
        have: Optional[torch.Tensor],
        have_blocks: tuple[Block, ...],
        want_blocks: tuple[Block, ...],
        headers: int = 0,
    ) -> Optional[torch.Tensor]:
        """Payload phase on the wire now (`_phase`, then one exchange with every peer)."""
        ph = self._phase(plan, direction, have, have_blocks, want_blocks, headers)
        p2p(
            ph.sends,
            ph.recvs,
            what=f"{direction} boundary payload",
            edge=str(self.edge),
            timeout_s=self.timeout_s,
            tag=self.tag,
        )
        return ph.finish()

    def _run_route(
        self, plan: RankBoundaryPlan, direction: str, have: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """Hierarchical mode: run the plan's leader-route steps of `direction` on this rank."""
        start, want = (plan.holds, plan.needs) if direction == "forward" else (plan.needs, plan.holds)
        sides = (self.is_src, self.is_dst) if direction == "forward" else (self.is_dst, self.is_src)
        assert plan.route is not None  # planned with the route in hierarchical mode
        out, sent = run_route(
            plan.route.steps(direction),
            rank=self.rank,
            have=have if sides[0] else None,
            have_blocks=start,
            want_blocks=want if sides[1] else None,
            groups=self._groups[direction],
            hidden=self.hidden,
            dtype=self.dtype,
            device=self.device,
            edge=str(self.edge),
            tag=self.tag,
            timeout_s=self.timeout_s,
        )
        self.stats[direction].record_call(sent, 0, 0)
        return out

    def _check_header(self, peer: int, h: torch.Tensor, numel: int) -> None:
        _, hidden, code, n = (int(v) for v in h.tolist())
        dtype = CODE_DTYPES.get(code)
        problems = []
        if dtype != self.dtype:
            problems.append(f"dtype {dtype} (expected {self.dtype})")
        if hidden != self.hidden:
            problems.append(f"hidden {hidden} (expected {self.hidden})")
        if n != numel:
            problems.append(f"{n} elements (expected {numel})")
        if problems:
            raise ValueError(f"edge {self.edge}: rank {self.rank} received from rank {peer}: " + ", ".join(problems))

    def header_phase(self, x: Optional[torch.Tensor]) -> "Phase":
        """Direct mode, forward, step 1 (not yet on the wire): a source rank's header per destination
        peer, a header buffer per source peer (see `BoundaryFunction`)."""
        hdr_send: dict[int, torch.Tensor] = {}
        if self.is_src:
            own_seq = self._check_source(x)
            sends, _ = self.plan_for(own_seq).peers("forward")
            hdr_send = {
                p: header(own_seq, self.hidden, self.dtype, self._numel(ts)).to(self.device) for p, ts in sends.items()
            }
        hdr_recv = {p: torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device) for p in self.fwd_recv_peers}
        return Phase(hdr_send, hdr_recv, lambda: None, self.tag)

    def forward_phase(self, x: Optional[torch.Tensor], hdr: "Phase") -> tuple["Phase", int]:
        """Direct mode, forward, step 2 once the header phase `hdr` completed: check the headers and
        agree on seq, then the payload phase (not yet on the wire) and the global seq."""
        own_seq = x.shape[1] * self.src.cp if self.is_src else None
        seqs = {p: int(h[0]) for p, h in hdr.recvs.items()}
        if own_seq is not None:
            seqs[self.rank] = own_seq
        if len(set(seqs.values())) != 1:
            raise ValueError(
                f"edge {self.edge}: rank {self.rank}: ranks disagree on the sequence length (rank: seq) {seqs}"
            )
        seq = next(iter(seqs.values()))
        plan = self.plan_for(seq)
        _, recvs = plan.peers("forward")
        for p, h in hdr.recvs.items():
            self._check_header(p, h, self._numel(recvs.get(p, [])))
        ph = self._phase(
            plan,
            "forward",
            x.detach() if x is not None else None,
            plan.holds,
            plan.needs,
            headers=len(hdr.sends) * HEADER_LEN * 8,
        )
        return ph, seq

    def planned_forward_phase(self, x: Optional[torch.Tensor], seq: Optional[int] = None) -> tuple["Phase", int]:
        """Direct mode, forward, for an edge with a fixed seq (or the `seq` of this call, which every
        rank knows from the data: variable image tokens): the payload phase without a header
        phase (both sides size their messages from the same plan; the source checks its tensor
        against it first). Used where several exchanges are posted as one batch (the disjoint
        schedule), since a header round inside a batch would hold back the batch's other messages."""
        seq = self.seq if seq is None else seq
        if seq is None:
            raise ValueError(f"edge {self.edge}: a forward without headers needs the edge's fixed seq")
        if self.is_src:
            got = self._check_source(x)
            if got != seq:
                raise ValueError(
                    f"edge {self.edge}: rank {self.rank} is sending a sequence of {got} where the call carries {seq}"
                )
        plan = self.plan_for(seq)
        ph = self._phase(
            plan,
            "forward",
            x.detach() if x is not None else None,
            plan.holds,
            plan.needs,
        )
        return ph, seq

    def backward_phase(self, grad_y: Optional[torch.Tensor], seq: int) -> "Phase":
        """Direct mode, backward (not yet on the wire): destination gradients back to every source
        replica; no header phase (the shapes are known from the forward)."""
        plan = self.plan_for(seq)
        return self._phase(plan, "backward", grad_y, plan.needs, plan.holds)

    def forward_exchange(self, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
        """Forward transform (header phase, then payload phase); returns (output or None, global seq).
        With `headers=False` (a fixed seq) the header round is skipped: both sides size the payload from
        the same plan (`planned_forward_phase`), one round of messages instead of two."""
        if self.route is not None:
            if self.is_src:
                self._check_source(x)  # shape, dtype and seq against the plan before any communication
            y = self._run_route(self.plan_for(self.seq), "forward", x.detach() if x is not None else None)
            return y, self.seq
        if not self.headers:
            ph, seq = self.planned_forward_phase(x)
            p2p(
                ph.sends,
                ph.recvs,
                what="forward boundary payload",
                edge=str(self.edge),
                timeout_s=self.timeout_s,
                tag=self.tag,
            )
            return ph.finish(), seq
        hdr = self.header_phase(x)
        p2p(
            hdr.sends,
            hdr.recvs,
            what="forward boundary header",
            edge=str(self.edge),
            timeout_s=self.timeout_s,
            tag=self.tag,
        )
        ph, seq = self.forward_phase(x, hdr)
        p2p(
            ph.sends,
            ph.recvs,
            what="forward boundary payload",
            edge=str(self.edge),
            timeout_s=self.timeout_s,
            tag=self.tag,
        )
        return ph.finish(), seq

    def backward_exchange(self, grad_y: Optional[torch.Tensor], seq: int) -> Optional[torch.Tensor]:
        """Backward transform: destination gradients back to every source replica (no header phase)."""
        plan = self.plan_for(seq)
        if self.route is not None:
            return self._run_route(plan, "backward", grad_y)
        ph = self.backward_phase(grad_y, seq)
        p2p(
            ph.sends,
            ph.recvs,
            what="backward boundary payload",
            edge=str(self.edge),
            timeout_s=self.timeout_s,
            tag=self.tag,
        )
        return ph.finish()
