"""The hierarchical (leader-based) route of a disjoint edge, as the upstream bridge and the
heteropipe design do it; kept for comparison with the direct route (`megatron-hetero bench boundary`).

forward:
  1. source CP gather: in each source DP shard, the CP ranks of TP position 0 send their sequence
     chunks to the shard leader (tp0, cp0, last stage), which assembles the full-sequence shard;
  2. leader P2P: every source leader sends its shard to the one destination leader (tp0, cp0, dp0,
     first stage), which assembles the whole [batch, seq, hidden] tensor;
  3. TP-row broadcast: the destination leader broadcasts it over its TP group;
  4. column broadcast: each TP position of that row broadcasts it down its DP x CP group;
  5. every destination rank selects its own blocks.
  Every broadcast source belongs to the group it broadcasts in.
backward (inverse):
  1. the destination ranks of TP position 0 send their gradient blocks to the destination leader
     (TP replicas hold identical gradients; only one copy travels);
  2. the leader sends each source leader the gradient of its shard;
  3. each source leader broadcasts it over its TP x CP group; every source rank selects its chunks.
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_hetero.plan.boundary import Block, BoundaryPlan
from megatron_hetero.plan.placement import coord_of, rank_of
from megatron_hetero.runtime.wire import BoundaryTimeout, p2p

if TYPE_CHECKING:
    from megatron_hetero.runtime.boundary import Boundary
    from megatron_hetero.runtime.topology import Topology


def _select(full: torch.Tensor, blocks: tuple[Block, ...], base: Block) -> torch.Tensor:
    """Concatenate `blocks` (global coordinates) of `full`, which covers `base`, along seq."""
    return torch.cat([full[b.b0 - base.b0:b.b1 - base.b0, b.s0 - base.s0:b.s1 - base.s0] for b in blocks], dim=1)


def _place(full: torch.Tensor, blocks: tuple[Block, ...], base: Block, local: torch.Tensor) -> None:
    offset = 0
    for b in blocks:
        n = b.s1 - b.s0
        full[b.b0 - base.b0:b.b1 - base.b0, b.s0 - base.s0:b.s1 - base.s0] = local[:, offset:offset + n]
        offset += n


class HierarchicalRoute:
    """Executes the leader path of one disjoint edge on this rank (see module docstring)."""

    def __init__(self, boundary: "Boundary", topology: "Topology") -> None:
        self.b = boundary
        self.topo = topology
        src, dst = boundary.src, boundary.dst
        self.src_leaders = [rank_of(src, dp=d, pp=src.pp - 1) for d in range(src.dp)]
        self.dst_leader = rank_of(dst)

    def _bcast(self, t: torch.Tensor, root: int, group, what: str) -> None:
        work = dist.broadcast(t, src=root, group=group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=self.b.timeout_s))
        except RuntimeError as exc:
            raise BoundaryTimeout(
                f"edge {self.b.edge}: rank {self.b.rank} waited for the {what} broadcast from rank {root} and gave "
                f"up (timeout {self.b.timeout_s:g} s): {str(exc).splitlines()[0][:200]}"
            ) from None

    def _p2p(self, sends, recvs, what):
        p2p(sends, recvs, what=what, edge=str(self.b.edge), timeout_s=self.b.timeout_s, tag=self.b.tag)
        return sum(v.numel() * v.element_size() for v in sends.values())

    def forward(self, plan: BoundaryPlan, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
        """Returns (this rank's destination tensor or None, payload bytes this rank sent)."""
        b, rank = self.b, self.b.rank
        src, dst, sh = b.src, b.dst, plan.shape
        per_src = sh.batch // src.dp
        sent = 0
        shard: Optional[torch.Tensor] = None
        if b.is_src:
            c = coord_of(src, rank)
            leader = rank_of(src, dp=c.dp, pp=src.pp - 1)
            base = Block(c.dp * per_src, (c.dp + 1) * per_src, 0, sh.seq)
            if src.cp > 1 and c.tp == 0:
                if rank == leader:
                    shard = torch.empty(per_src, sh.seq, sh.hidden, dtype=b.dtype, device=b.device)
                    _place(shard, plan.holds[rank], base, x)
                    peers = [rank_of(src, cp=k, dp=c.dp, pp=src.pp - 1) for k in range(1, src.cp)]
                    bufs = {p: torch.empty(per_src, sh.seq // src.cp, sh.hidden, dtype=b.dtype, device=b.device)
                            for p in peers}
                    self._p2p({}, bufs, "source CP gather")
                    for p, buf in bufs.items():
                        _place(shard, plan.holds[p], base, buf)
                else:
                    sent += self._p2p({leader: x.contiguous()}, {}, "source CP gather")
            elif rank == leader:
                shard = x
            if rank == leader:
                sent += self._p2p({self.dst_leader: shard.contiguous()}, {}, "leader send")
        if not b.is_dst:
            return None, sent
        c = coord_of(dst, rank)
        pgs = self.topo.pg_collection(dst.name)
        full = torch.empty(sh.batch, sh.seq, sh.hidden, dtype=b.dtype, device=b.device)
        if rank == self.dst_leader:
            bufs = {p: full[d * per_src:(d + 1) * per_src] for d, p in enumerate(self.src_leaders)}
            tmp = {p: torch.empty_like(v) for p, v in bufs.items()}
            self._p2p({}, tmp, "leader receive")
            for p, v in tmp.items():
                bufs[p].copy_(v)
        if c.cp == 0 and c.dp == 0 and dst.tp > 1:
            self._bcast(full, self.dst_leader, pgs.tp, "TP-row")
            if rank == self.dst_leader:
                sent += full.numel() * full.element_size() * (dst.tp - 1)
        if dst.cp * dst.dp > 1:
            root = rank_of(dst, tp=c.tp)
            self._bcast(full, root, pgs.dp_cp, "DP x CP column")
            if rank == root:
                sent += full.numel() * full.element_size() * (dst.cp * dst.dp - 1)
        whole = Block(0, sh.batch, 0, sh.seq)
        need = plan.needs[rank]
        y = _select(full, need, whole) if need else torch.empty(0, 0, sh.hidden, dtype=b.dtype, device=b.device)
        return y.contiguous(), sent

    def backward(self, plan: BoundaryPlan, grad_y: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
        """Returns (gradient of this rank's source tensor or None, payload bytes this rank sent)."""
        b, rank = self.b, self.b.rank
        src, dst, sh = b.src, b.dst, plan.shape
        per_src = sh.batch // src.dp
        sent = 0
        if b.is_dst:
            c = coord_of(dst, rank)
            if rank == self.dst_leader:
                full = torch.zeros(sh.batch, sh.seq, sh.hidden, dtype=b.dtype, device=b.device)
                whole = Block(0, sh.batch, 0, sh.seq)
                if plan.needs[rank]:
                    _place(full, plan.needs[rank], whole, grad_y)
                peers = [r for r in plan.dst_ranks if r != rank and coord_of(dst, r).tp == 0 and plan.needs[r]]
                bufs = {p: torch.empty(sh.batch // dst.dp, sum(x.s1 - x.s0 for x in plan.needs[p]), sh.hidden,
                                       dtype=b.dtype, device=b.device) for p in peers}
                self._p2p({}, bufs, "gradient gather")
                for p, buf in bufs.items():
                    _place(full, plan.needs[p], whole, buf)
                sends = {p: full[d * per_src:(d + 1) * per_src].contiguous() for d, p in enumerate(self.src_leaders)}
                sent += self._p2p(sends, {}, "gradient leader send")
            elif c.tp == 0 and plan.needs[rank]:
                sent += self._p2p({self.dst_leader: grad_y.contiguous()}, {}, "gradient gather")
        if not b.is_src:
            return None, sent
        c = coord_of(src, rank)
        leader = rank_of(src, dp=c.dp, pp=src.pp - 1)
        shard = torch.empty(per_src, sh.seq, sh.hidden, dtype=b.dtype, device=b.device)
        if rank == leader:
            self._p2p({}, {self.dst_leader: shard}, "gradient leader receive")
        if src.tp * src.cp > 1:
            self._bcast(shard, leader, self.topo.pg_collection(src.name).tp_cp, "source TP x CP")
            if rank == leader:
                sent += shard.numel() * shard.element_size() * (src.tp * src.cp - 1)
        base = Block(c.dp * per_src, (c.dp + 1) * per_src, 0, sh.seq)
        return _select(shard, plan.holds[rank], base).contiguous(), sent
