"""Point-to-point exchange with timeouts that name the edge, the waiting rank and the peer.

A boundary phase moves one message per peer: a small int64 header (`[seq, hidden, dtype code,
numel]`) first, then the payload. Every wait has a timeout; on expiry (or when a peer died and the
transport reports it) a `BoundaryTimeout` is raised.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.int64: 5, torch.int32: 6,
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


def _wait(work, label: str, edge: str, rank: int, peer: int, timeout_s: float) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise BoundaryTimeout(
            f"edge {edge}: rank {rank} waited for the {label} rank {peer} and gave up (timeout "
            f"{timeout_s:g} s, --hetero-comm-timeout): {str(exc).splitlines()[0][:200]}"
        ) from None
    if ok is False:
        raise BoundaryTimeout(f"edge {edge}: rank {rank} timed out after {timeout_s:g} s waiting for the {label} rank {peer}")


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
        pending.append((f"{what} from", peer, dist.irecv(buf, src=peer, group=group, tag=tag)))
    for peer, tensor in sends.items():
        pending.append((f"{what} to", peer, dist.isend(tensor, dst=peer, group=group, tag=tag)))
    for label, peer, work in pending:
        _wait(work, label, edge, rank, peer, timeout_s)
