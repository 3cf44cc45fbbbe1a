"""Executes the hierarchical (leader-based) route of a disjoint edge: the `RouteStep`s of
`plan/route.py` (where every leader, group and block is computed), one direction at a time.

Run by the Boundary of a layout with `boundary_mode: hierarchical` (the disjoint schedule) and by
`megatron-hetero bench boundary`, which compares it with the direct route. This file computes
no ranks: it takes the steps, this rank's tensor and blocks, and the process group of every
broadcast step it takes part in, and for each step (in route order) that names this rank:
- gather / scatter (point to point): sends the pieces it is the source of, one message per peer
  (`wire.pack`), receives into flat buffers, and, when the step gives it a rectangle, assembles
  that rectangle from its local copies and the received pieces;
- broadcast: broadcasts the root's rectangle over the step's process group (every member then
  holds it);
then selects the blocks it wants from what it holds last. Payload bytes credited to a rank: the
messages it sent, and for a broadcast root the rectangle times (group size - 1), as the plan prices.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_hetero.plan.blocks import Block, local_extent
from megatron_hetero.plan.route import RouteStep
from megatron_hetero.runtime.wire import broadcast, by_peer, copy_local, p2p, pack, select, unpack


def run_route(
    steps: tuple[RouteStep, ...],
    *,
    rank: int,
    have: Optional[torch.Tensor],
    have_blocks: tuple[Block, ...],
    want_blocks: Optional[tuple[Block, ...]],
    groups: dict[int, dist.ProcessGroup],
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    edge: str,
    tag: int,
    timeout_s: float,
) -> tuple[Optional[torch.Tensor], int]:
    """Run `steps` on this rank. `have` is this rank's tensor (made of `have_blocks`; None and () on
    a rank that starts with nothing); `groups[i]` is the process group of broadcast step `steps[i]`
    for every such step this rank is a member of. Returns (the `want_blocks` of what this rank holds
    at the end, concatenated along seq - None when `want_blocks` is None, a [0, 0, hidden] tensor
    when it is empty; payload bytes this rank sent)."""
    held, held_blocks = have, have_blocks
    sent = 0

    def empty(blocks: tuple[Block, ...]) -> torch.Tensor:
        return torch.empty(*local_extent(blocks), hidden, dtype=dtype, device=device)

    for i, step in enumerate(steps):
        if rank not in step.group:
            continue
        region = step.region_of(rank)
        if step.kind == "broadcast":
            assert region is not None, (step.label, rank)
            if rank == step.root:
                buf = held.contiguous() if held_blocks == (region,) else select(held, held_blocks, (region,))
                sent += buf.numel() * buf.element_size() * (len(step.group) - 1)
            else:
                buf = empty((region,))
            broadcast(buf, step.root, groups[i], what=step.label, edge=edge, timeout_s=timeout_s)
            held, held_blocks = buf, (region,)
            continue
        sends, recvs = by_peer(step.transfers, rank)
        payloads = {p: pack(held, held_blocks, ts) for p, ts in sends.items()}
        bufs = {
            p: torch.empty(sum(t.block.numel(hidden) for t in ts), dtype=dtype, device=device)
            for p, ts in recvs.items()
        }
        p2p(payloads, bufs, what=step.label, edge=edge, timeout_s=timeout_s, tag=tag)
        sent += sum(v.numel() * v.element_size() for v in payloads.values())
        if region is not None:
            buf = empty((region,))
            copy_local(buf, (region,), held, held_blocks, step.local_copies(rank))
            for p, ts in recvs.items():
                unpack(buf, (region,), ts, bufs[p])
            held, held_blocks = buf, (region,)
    if want_blocks is None:
        return None, sent
    if not want_blocks:
        return torch.empty(0, 0, hidden, dtype=dtype, device=device), sent
    return select(held, held_blocks, want_blocks), sent
