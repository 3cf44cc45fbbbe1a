"""Autograd-aware boundary: carries one edge's tensor from the source layout to the destination layout.

`Boundary(layout, edge, ...)` is built identically on every rank; calling it runs the edge's
transform for this rank as a `torch.autograd.Function`:

Two modes: "direct" (default, below) and "hierarchical" (disjoint edges only, the leader path of
`runtime/hierarchical.py`, needs the Topology's groups).

forward (direct mode, the plan of `plan/boundary.py`):
  1. header phase: every source rank sends each destination peer an int64 header
     `[seq, hidden, dtype, numel]`; the destination checks it (variable sequence lengths are learnt
     here; a dtype/hidden mismatch raises an error naming the edge);
  2. payload phase: each source rank sends each destination peer, in one message, the pieces of
     its local `[b, s, h]` tensor that peer needs (plan order); pieces a rank already holds
     (colocated) are copied locally and never sent.
backward: the exact inverse route for gradients: every source rank (each TP replica) receives the
  gradient of each element it holds from exactly one destination rank that needs it (destination
  TP replicas hold identical gradients; they are not summed). No header phase: shapes are known.

Local tensor layout on a rank: `[batch / dp, tokens, hidden]` where tokens are its blocks'
sequence intervals concatenated in plan order (for cp > 1: chunk c then chunk 2cp-1-c).

What the call returns: on a destination rank, the tensor in the destination layout; on a
source-only rank (disjoint), a 0-element "token" tensor: call `Boundary.backward_source(token)`
(or `token.backward(token.new_empty(0))`) once the destination's gradient will arrive; on a rank
that is neither, `None`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_hetero.layout.spec import Edge, HeteroLayout
from megatron_hetero.plan.boundary import (
    MODES,
    Block,
    BoundaryPlan,
    BoundaryShape,
    Transfer,
    check_shape,
    plan_boundary,
)
from megatron_hetero.plan.placement import stage_ranks
from megatron_hetero.runtime.hierarchical import HierarchicalRoute
from megatron_hetero.runtime.wire import CODE_DTYPES, DTYPE_CODES, HEADER_LEN, WireStats, header, p2p

if TYPE_CHECKING:
    from megatron_hetero.runtime.topology import Topology


def _locate(blocks: tuple[Block, ...], piece: Block) -> tuple[slice, slice]:
    """Local (batch, seq) slices of `piece` inside a tensor made of `blocks` concatenated along seq."""
    offset = 0
    for blk in blocks:
        if blk.b0 <= piece.b0 and piece.b1 <= blk.b1 and blk.s0 <= piece.s0 and piece.s1 <= blk.s1:
            s = offset + piece.s0 - blk.s0
            b = piece.b0 - blk.b0
            return slice(b, b + piece.b1 - piece.b0), slice(s, s + piece.s1 - piece.s0)
        offset += blk.s1 - blk.s0
    raise AssertionError(f"piece {piece} is not inside the local blocks {blocks}")


def _local_shape(blocks: tuple[Block, ...], hidden: int) -> tuple[int, int, int]:
    if not blocks:
        return (0, 0, hidden)
    return (blocks[0].b1 - blocks[0].b0, sum(b.s1 - b.s0 for b in blocks), hidden)


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
        timeout_s: float = 600.0,
        device: Optional[torch.device] = None,
        topology: Optional["Topology"] = None,
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
        self.layout, self.edge, self.mode = layout, edge, mode
        self.src, self.dst = layout.module(edge.src), layout.module(edge.dst)
        self.batch, self.hidden, self.seq, self.dtype = batch, hidden, seq, dtype
        self.dst_seq, self.dst_offset = dst_seq, dst_offset
        self.timeout_s = float(timeout_s)
        self.device = device or torch.device("cpu")
        self.rank = dist.get_rank()
        self.is_src = self.rank in stage_ranks(self.src, self.src.pp - 1)
        self.is_dst = self.rank in stage_ranks(self.dst, 0)
        self.tag = layout.edges.index(edge)
        self.stats = {"forward": WireStats(), "backward": WireStats()}
        self._plans: dict[int, BoundaryPlan] = {}
        # The peers never depend on the sequence length: learn them from a canonical plan.
        canon = self.plan_for(seq if seq is not None else self._canonical_seq())
        self.fwd_recv_peers = sorted({t.src for t in canon.recvs(self.rank)})
        self.route = HierarchicalRoute(self, topology) if mode == "hierarchical" else None

    def _canonical_seq(self) -> int:
        n = 1
        for m in (self.src, self.dst):
            if m.cp > 1:
                n = n * 2 * m.cp
        return n

    def plan_for(self, seq: int) -> BoundaryPlan:
        """The (cached) plan of this edge for sequence length `seq`; ValueError on a bad shape."""
        if seq not in self._plans:
            shape = BoundaryShape(self.batch, seq, self.hidden, torch.empty(0, dtype=self.dtype).element_size(),
                                  dst_seq=self.dst_seq, dst_offset=self.dst_offset)
            check_shape(self.edge, self.src, self.dst, shape)
            self._plans[seq] = plan_boundary(self.layout, self.edge, shape)
        return self._plans[seq]

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if not (self.is_src or self.is_dst):
            if x is not None:
                raise ValueError(f"edge {self.edge}: rank {self.rank} is on neither side but got a tensor")
            return None
        if self.is_src:
            seq = self._check_source(x)
            self.plan_for(seq)  # shape errors before any communication
            return _BoundaryFunction.apply(self, x)
        if x is not None:
            raise ValueError(f"edge {self.edge}: rank {self.rank} is only a destination; pass None")
        anchor = torch.empty(0, dtype=self.dtype, device=self.device, requires_grad=True)
        return _BoundaryFunction.apply(self, anchor)

    @staticmethod
    def backward_source(token: torch.Tensor) -> None:
        """Run the backward of a source-only rank (receives and applies the gradients)."""
        torch.autograd.backward(token, token.new_empty(token.shape))

    def _check_source(self, x: Optional[torch.Tensor]) -> int:
        """Check the local source tensor; return the global sequence length it implies."""
        e, m = self.edge, self.src
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"edge {e}: rank {self.rank} is a source of {m.name} and needs a tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise ValueError(f"edge {e}: rank {self.rank} got dtype {x.dtype}, the edge carries {self.dtype}")
        if x.dim() != 3:
            raise ValueError(f"edge {e}: rank {self.rank} expects a [batch, seq, hidden] tensor, got shape {tuple(x.shape)}")
        if self.batch % m.dp:
            raise ValueError(f"edge {e}: batch {self.batch} is not divisible by source {m.name} dp({m.dp})")
        if x.shape[0] != self.batch // m.dp or x.shape[2] != self.hidden:
            raise ValueError(
                f"edge {e}: rank {self.rank} expects [batch/dp={self.batch // m.dp}, seq, hidden={self.hidden}], "
                f"got {tuple(x.shape)}"
            )
        seq = x.shape[1] * m.cp
        if self.seq is not None and seq != self.seq:
            raise ValueError(f"edge {e}: rank {self.rank} holds {x.shape[1]} tokens (x cp {m.cp} = {seq}), "
                             f"the edge carries seq {self.seq}")
        return seq

    # -- the two exchanges --------------------------------------------------------------------
    def _gather_pieces(self, tensor: torch.Tensor, blocks: tuple[Block, ...], transfers: list[Transfer]) -> torch.Tensor:
        parts = []
        for t in transfers:
            b, s = _locate(blocks, t.block)
            parts.append(tensor[b, s].reshape(-1))
        return torch.cat(parts).contiguous()

    def _scatter_pieces(self, out: torch.Tensor, blocks: tuple[Block, ...], transfers: list[Transfer],
                        flat: torch.Tensor) -> None:
        offset = 0
        for t in transfers:
            b, s = _locate(blocks, t.block)
            n = t.block.numel(self.hidden)
            out[b, s] = flat[offset:offset + n].view(t.block.b1 - t.block.b0, t.block.s1 - t.block.s0, self.hidden)
            offset += n

    @staticmethod
    def _by_peer(transfers: tuple[Transfer, ...], rank: int) -> tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]:
        """(what `rank` sends, by destination peer; what it receives, by source peer), in plan order."""
        sends: dict[int, list[Transfer]] = {}
        recvs: dict[int, list[Transfer]] = {}
        for t in transfers:
            if t.local:
                continue
            if t.src == rank:
                sends.setdefault(t.dst, []).append(t)
            if t.dst == rank:
                recvs.setdefault(t.src, []).append(t)
        return sends, recvs

    def _numel(self, transfers: list[Transfer]) -> int:
        return sum(t.block.numel(self.hidden) for t in transfers)

    def _move(self, plan: BoundaryPlan, direction: str, have: Optional[torch.Tensor],
              have_blocks: tuple[Block, ...], want_blocks: tuple[Block, ...], headers: int = 0) -> Optional[torch.Tensor]:
        """Payload phase: route `have` (this rank's blocks) to every rank that wants them; return what
        this rank wants, assembled from local copies and received pieces (None if it wants nothing)."""
        transfers = plan.forward if direction == "forward" else plan.backward
        sends, recvs = self._by_peer(transfers, self.rank)
        payloads = {p: self._gather_pieces(have, have_blocks, ts) for p, ts in sends.items()}
        bufs = {p: torch.empty(self._numel(ts), dtype=self.dtype, device=self.device) for p, ts in recvs.items()}
        p2p(payloads, bufs, what=f"{direction} boundary payload", edge=str(self.edge), timeout_s=self.timeout_s,
            tag=self.tag)
        sent = sum(v.numel() * v.element_size() for v in payloads.values())
        self.stats[direction].record_call(sent, headers, len(payloads))
        if not want_blocks:
            return None
        out = torch.empty(_local_shape(want_blocks, self.hidden), dtype=self.dtype, device=self.device)
        for t in transfers:
            if t.local and t.dst == self.rank:
                sb, ss = _locate(have_blocks, t.block)
                db, ds = _locate(want_blocks, t.block)
                out[db, ds] = have[sb, ss]
        for p, ts in recvs.items():
            self._scatter_pieces(out, want_blocks, ts, bufs[p])
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

    def forward_exchange(self, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
        """Forward transform (header phase, then payload phase); returns (output or None, global seq)."""
        if self.route is not None:
            y, sent = self.route.forward(self.plan_for(self.seq), x.detach() if x is not None else None)
            self.stats["forward"].record_call(sent, 0, 0)
            return y, self.seq
        own_seq = x.shape[1] * self.src.cp if self.is_src else None
        hdr_send: dict[int, torch.Tensor] = {}
        if self.is_src:
            sends, _ = self._by_peer(self.plan_for(own_seq).forward, self.rank)
            hdr_send = {p: header(own_seq, self.hidden, self.dtype, self._numel(ts)).to(self.device)
                        for p, ts in sends.items()}
        hdr_recv = {p: torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device) for p in self.fwd_recv_peers}
        p2p(hdr_send, hdr_recv, what="forward boundary header", edge=str(self.edge), timeout_s=self.timeout_s,
            tag=self.tag)
        seqs = {p: int(h[0]) for p, h in hdr_recv.items()}
        if own_seq is not None:
            seqs[self.rank] = own_seq
        if len(set(seqs.values())) != 1:
            raise ValueError(f"edge {self.edge}: rank {self.rank}: ranks disagree on the sequence length "
                             f"(rank: seq) {seqs}")
        seq = next(iter(seqs.values()))
        plan = self.plan_for(seq)
        _, recvs = self._by_peer(plan.forward, self.rank)
        for p, h in hdr_recv.items():
            self._check_header(p, h, self._numel(recvs.get(p, [])))
        y = self._move(plan, "forward", x.detach() if x is not None else None, plan.holds.get(self.rank, ()),
                       plan.needs.get(self.rank, ()), headers=len(hdr_send) * HEADER_LEN * 8)
        return y, seq

    def backward_exchange(self, grad_y: Optional[torch.Tensor], seq: int) -> Optional[torch.Tensor]:
        """Backward transform: destination gradients back to every source replica (no header phase)."""
        plan = self.plan_for(seq)
        if self.route is not None:
            grad_x, sent = self.route.backward(plan, grad_y)
            self.stats["backward"].record_call(sent, 0, 0)
            return grad_x
        return self._move(plan, "backward", grad_y, plan.needs.get(self.rank, ()), plan.holds.get(self.rank, ()))


class _BoundaryFunction(torch.autograd.Function):
    """forward: `Boundary.forward_exchange` (P2P source -> destination, local copies where colocated);
    backward: `Boundary.backward_exchange` (P2P destination -> source, one supplier per element)."""

    @staticmethod
    def forward(ctx, boundary: Boundary, x: torch.Tensor) -> torch.Tensor:
        src_x = x if boundary.is_src else None
        y, seq = boundary.forward_exchange(src_x)
        ctx.boundary, ctx.seq, ctx.x_shape = boundary, seq, tuple(x.shape)
        if y is None:
            return x.new_empty(0)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        boundary: Boundary = ctx.boundary
        g = grad_y.contiguous() if boundary.is_dst else None
        grad_x = boundary.backward_exchange(g, ctx.seq)
        if not boundary.is_src:
            return None, None
        return None, grad_x
