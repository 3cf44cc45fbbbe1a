"""The autograd side of a boundary (`runtime/boundary.py`'s `Boundary` calls them): the edge's
transform as one `torch.autograd.Function`, whose docstring lists exactly what goes over the wire in
each mode and direction, and the pass-through that sends nothing. Their `boundary` argument is the
calling `Boundary` (duck-typed here: this file does not import `boundary.py`, which imports it)."""

from __future__ import annotations

from typing import Any

import torch


class BoundaryFunction(torch.autograd.Function):
    """One edge's boundary as an autograd Function. Exactly what goes over the wire:

    direct mode, forward (`Boundary.forward_exchange`):
      1. header phase: every source rank sends each destination peer it has pieces for one int64
         tensor `[seq, hidden, dtype code, numel]` (its global sequence length, the hidden size,
         `wire.DTYPE_CODES[dtype]`, the element count of the payload that follows); every
         destination rank receives one from each source peer of the plan, checks dtype, hidden and
         numel (a mismatch raises ValueError naming the edge) and that all peers agree on seq;
         skipped when the Boundary was built with `headers=False` (fixed seq: the colocated schedule),
         where each source checks its tensor against the plan before sending;
      2. payload phase: one flat message per (source, destination) pair: the pieces of
         `plan.forward` from that source to that destination, each piece's [b, s, h] elements
         row-major, concatenated in plan order (`wire.pack`); pieces a rank already holds
         (colocated, src == dst) are local copies and never sent.
    direct mode, backward (`Boundary.backward_exchange`): no header phase (shapes are known); one
      flat message per (destination, source) pair with the pieces of `plan.backward`: every source
      rank (each TP replica) receives the gradient of each element it holds from exactly one
      destination rank (destination TP replicas hold identical gradients; nothing is summed);
      local copies as in forward.
    hierarchical mode (disjoint only, `plan.route`), no header phase (fixed seq):
      forward: source CP gather (source cp > 1: each TP-0 rank of CP rank c > 0 sends its two
      chunks, [B/dp_src, S/cp_src, H], as one message to its shard leader (tp0, cp0)); leader send
      (each source leader sends its full-sequence shard [B/dp_src, S, H] to the destination leader);
      TP-row broadcast of the whole [B, S, H] over the destination leader's TP group; DP x CP column
      broadcast of [B, S, H] from each (tp t, cp0, dp0) over its DP x CP group; then every
      destination rank selects its blocks locally.
      backward: gradient gather (each destination TP-0 rank other than the leader sends the
      gradient of its blocks, [B/dp_dst, tokens, H], as one message to the destination leader);
      gradient leader send (the leader sends each source leader the gradient of its shard,
      [B/dp_src, S, H]); source TP x CP broadcast of that shard over the shard's TP x CP group;
      then every source rank selects its blocks locally.

    Inputs and outputs: a source rank passes its local tensor `x`; a destination-only rank passes
    a 0-element anchor that requires grad (`Boundary.__call__` makes it), so that its backward runs.
    forward returns the destination tensor on a destination rank, and on a source-only rank a
    0-element token (`x.new_empty(0)`), whose backward receives an empty gradient and returns the
    gradient of `x`; a destination-only rank's backward returns no gradient for its anchor.
    """

    @staticmethod
    def forward(ctx, boundary: Any, x: torch.Tensor) -> torch.Tensor:
        src_x = x if boundary.is_src else None
        y, seq = boundary.forward_exchange(src_x)
        ctx.boundary, ctx.seq, ctx.x_shape = boundary, seq, tuple(x.shape)
        if y is None:
            return x.new_empty(0)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        boundary = ctx.boundary
        g = grad_y.contiguous() if boundary.is_dst else None
        grad_x = boundary.backward_exchange(g, ctx.seq)
        if not boundary.is_src:
            return None, None
        return None, grad_x


class PassThrough(torch.autograd.Function):
    """A pass-through boundary on this rank (`RankBoundaryPlan.pass_through`): nothing goes over the
    wire in either direction. forward returns `x` itself (autograd wraps it as a view: no copy);
    backward returns the destination's gradient unchanged as the source's. Both record a call of 0
    bytes in the boundary's `WireStats`, as a direct call that moves nothing would."""

    @staticmethod
    def forward(ctx, boundary: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.boundary = boundary
        boundary.stats["forward"].record_call(0, 0, 0)
        return x

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        ctx.boundary.stats["backward"].record_call(0, 0, 0)
        return None, grad_y
