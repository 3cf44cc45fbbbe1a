"""The wire under the boundaries: point-to-point exchange and broadcast with timeouts that name the
edge, the waiting rank and the peer, and the packing of plan blocks into messages.

A direct boundary phase moves one message per peer: a small int64 header (`[seq, hidden, dtype
code, numel]`) first, then the payload (the peer's pieces, packed flat in plan order). Every wait
has a timeout; on expiry (or when a peer died and the transport reports it) a `BoundaryTimeout` is
raised. Local tensors hold their plan blocks concatenated along seq (`plan.blocks.locate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_hetero.plan.blocks import Block, Transfer, locate

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
HEADER_LEN = 4


class BoundaryTimeout(RuntimeError):
    """A wait on the wire expired (or its peer went away); the message names edge, rank and peer."""


@dataclass
class WireStats:
    """Bytes this rank sent, per call and in total (payload only; headers are counted apart)."""

    payload_bytes: int = 0
    header_bytes: int = 0
    messages: int = 0
    per_call: list[int] = field(default_factory=list)

    def record_call(self, payload: int, headers: int, messages: int) -> None:
        self.payload_bytes += payload
        self.header_bytes += headers
        self.messages += messages
        self.per_call.append(payload)


def header(seq: int, hidden: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.tensor([seq, hidden, DTYPE_CODES[dtype], numel], dtype=torch.int64)


def where(edge: str) -> str:
    """'edge vision->language' for an edge name; a description ('pipeline link ...') as it is."""
    return edge if " " in edge.strip() else f"edge {edge}"


def _wait(work, label: str, edge: str, rank: int, peer: int, timeout_s: float) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise BoundaryTimeout(
            f"{where(edge)}: rank {rank} waited for the {label} rank {peer} and gave up (timeout "
            f"{timeout_s:g} s, --hetero-comm-timeout): {str(exc).splitlines()[0][:200]}"
        ) from None
    if ok is False:
        raise BoundaryTimeout(
            f"{where(edge)}: rank {rank} timed out after {timeout_s:g} s waiting for the {label} rank {peer}"
        )


def _post(fn, label: str, edge: str, rank: int, peer: int, *args, **kwargs):
    """Post one operation (`fn(*args, **kwargs)`: an isend, an irecv, a broadcast); posting on a
    connection to a peer that already died raises at once: re-raised naming edge, rank and peer."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        raise BoundaryTimeout(
            f"{where(edge)}: rank {rank} could not post the {label} rank {peer} (its connection failed): "
            f"{str(exc).splitlines()[0][:200]}"
        ) from None


def p2p(
    sends: dict[int, torch.Tensor],
    recvs: dict[int, torch.Tensor],
    *,
    what: str,
    edge: str,
    timeout_s: float,
    tag: int = 0,
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Send each tensor to its peer and receive into each preallocated buffer; ranks are global.

    `tag` separates edges that exchange between the same pair of ranks. All receives and sends of the phase are posted before any wait, so the order of peers cannot
    deadlock; every wait has `timeout_s` and failures name the edge, this rank and the peer.
    """
    rank = dist.get_rank()
    pending = []
    for peer, buf in recvs.items():
        label = f"{what} from"
        pending.append((label, peer, _post(dist.irecv, label, edge, rank, peer, buf, src=peer, group=group, tag=tag)))
    for peer, tensor in sends.items():
        label = f"{what} to"
        pending.append(
            (label, peer, _post(dist.isend, label, edge, rank, peer, tensor, dst=peer, group=group, tag=tag))
        )
    for label, peer, work in pending:
        _wait(work, label, edge, rank, peer, timeout_s)


@dataclass(frozen=True)
class WireOp:
    """One message of a batch: send `tensor` to, or receive into `tensor` from, global rank `peer`.
    `what` and `edge` name it in errors (e.g. 'forward boundary payload', 'edge vision->language')."""

    send: bool
    peer: int
    tensor: torch.Tensor
    tag: int
    what: str
    edge: str


def exchange_batch(ops: list[WireOp], *, timeout_s: float) -> None:
    """Post every operation of `ops` at once (`torch.distributed.batch_isend_irecv`: one fused group
    on NCCL, independent isend/irecv on gloo, the same code path) and wait for all of them, each
    with `timeout_s`; a failure names the edge or link, this rank and the peer. The batch completes
    only when every peer has posted the matching operation (no buffering is assumed)."""
    post_batch(ops, timeout_s=timeout_s)()


def post_batch(ops: list[WireOp], *, timeout_s: float) -> Callable[[], None]:
    """`exchange_batch` in two halves: post every operation of `ops` now, and return the wait for
    all of them (call it once; failures as in `exchange_batch`)."""
    if not ops:
        return lambda: None
    rank = dist.get_rank()
    p2p_ops = [dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer, tag=op.tag) for op in ops]
    works = dist.batch_isend_irecv(p2p_ops)  # a failure to post: the caller names the batch's edges and peers

    def wait() -> None:
        if len(works) == len(ops):
            for op, work in zip(ops, works):
                _wait(work, f"{op.what} {'to' if op.send else 'from'}", op.edge, rank, op.peer, timeout_s)
        else:  # one coalesced work for the whole group (NCCL)
            labels = ", ".join(sorted({f"{op.edge} (rank {op.peer})" for op in ops}))
            for work in works:
                _wait(
                    work, f"batch of {len(ops)} messages on {labels}; peer", ops[0].edge, rank, ops[0].peer, timeout_s
                )

    return wait


def broadcast(
    tensor: torch.Tensor, root: int, group: dist.ProcessGroup, *, what: str, edge: str, timeout_s: float
) -> None:
    """`dist.broadcast` from global rank `root` over `group`, with a timeout naming edge, rank and root."""
    work = _post(
        dist.broadcast, f"{what} from", edge, dist.get_rank(), root, tensor, src=root, group=group, async_op=True
    )
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise BoundaryTimeout(
            f"{where(edge)}: rank {dist.get_rank()} waited for the {what} from rank {root} and gave up "
            f"(timeout {timeout_s:g} s): {str(exc).splitlines()[0][:200]}"
        ) from None


def pack(tensor: torch.Tensor, blocks: tuple[Block, ...], pieces: list[Transfer]) -> torch.Tensor:
    """The pieces' elements of `tensor` (made of `blocks`), flat and contiguous, in order: one message."""
    parts = []
    for t in pieces:
        b, s = locate(blocks, t.block)
        parts.append(tensor[b, s].reshape(-1))
    if len(parts) == 1:  # one piece (often the whole local tensor): no concatenation copy
        return parts[0].contiguous()
    return torch.cat(parts).contiguous()


def unpack(out: torch.Tensor, blocks: tuple[Block, ...], pieces: list[Transfer], flat: torch.Tensor) -> None:
    """Write a message made by `pack` into `out` (made of `blocks`)."""
    hidden = out.shape[-1]
    offset = 0
    for t in pieces:
        b, s = locate(blocks, t.block)
        n = t.block.numel(hidden)
        out[b, s] = flat[offset : offset + n].view(t.block.b1 - t.block.b0, t.block.s1 - t.block.s0, hidden)
        offset += n


def copy_local(
    out: torch.Tensor,
    out_blocks: tuple[Block, ...],
    src: torch.Tensor,
    src_blocks: tuple[Block, ...],
    pieces: list[Transfer],
) -> None:
    """Copy the pieces from `src` (made of `src_blocks`) into `out` (made of `out_blocks`): no bytes move."""
    for t in pieces:
        db, ds = locate(out_blocks, t.block)
        sb, ss = locate(src_blocks, t.block)
        out[db, ds] = src[sb, ss]


def select(src: torch.Tensor, src_blocks: tuple[Block, ...], blocks: tuple[Block, ...]) -> torch.Tensor:
    """A new contiguous tensor made of `blocks` (concatenated along seq), taken from `src` (made of
    `src_blocks`, which must contain every block)."""
    return torch.cat([src[locate(src_blocks, b)] for b in blocks], dim=1).contiguous()


def by_peer(pieces, rank: int) -> tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]:
    """(what `rank` sends, by destination peer; what it receives, by source peer), in plan order;
    local copies are left out."""
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}
    for t in pieces:
        if t.local:
            continue
        if t.src == rank:
            sends.setdefault(t.dst, []).append(t)
        if t.dst == rank:
            recvs.setdefault(t.src, []).append(t)
    return sends, recvs
