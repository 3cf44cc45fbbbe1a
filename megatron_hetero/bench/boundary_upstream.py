"""Megatron-core 0.19's `ColocatedBridgeCommunicator` (`megatron/core/models/mimo/comm/
colocated_communicator.py`) run beside our boundary in `bench boundary`: the same layouts, the same
tensor, in the same process tree.

Upstream creates its gather groups with `backend='nccl'` hard-coded. When the world's backend is not
NCCL (CPU/gloo), :func:`upstream_on_this_machine` gives them the world's backend for the duration of
the bench's upstream part only. It does that by replacing the name `dist` inside that one Megatron
module with a thin stand-in. The stand-in's `new_subgroups_by_enumeration` passes the world's backend,
and its `all_gather_into_tensor` also counts the bytes this rank receives. Everything else is the real
`torch.distributed`, and the module's own `dist` is restored afterwards. On NCCL, only the byte count
changes.

Upstream refuses (ValueError, with its reason) PP != 1 or CP != 1 on either side, grids that do not span
the same ranks (disjoint placement), and at call time a fan-out whose local batch is not divisible by
the fan-out factor; :func:`build` returns the reason instead of raising.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator, Optional

import torch.distributed as dist

_MODULE = "megatron.core.models.mimo.comm.colocated_communicator"


class _Counter:
    """Bytes this rank received through upstream's all-gathers (its own piece excluded)."""

    def __init__(self) -> None:
        self.received = 0


def _stand_in(counter: _Counter, backend: Optional[str]) -> types.ModuleType:
    real, forced = dist, backend

    class _Dist(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    stand_in = _Dist("torch.distributed")

    def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None):
        return real.new_subgroups_by_enumeration(
            ranks_per_subgroup_list, timeout=timeout, backend=forced or backend, pg_options=pg_options
        )

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        counter.received += (output_tensor.numel() - input_tensor.numel()) * output_tensor.element_size()
        return real.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    stand_in.new_subgroups_by_enumeration = new_subgroups_by_enumeration
    stand_in.all_gather_into_tensor = all_gather_into_tensor
    return stand_in


@contextlib.contextmanager
def upstream_on_this_machine() -> Iterator[_Counter]:
    """Inside: upstream's communicator builds its groups on the world's backend (gloo on CPU) and
    counts the bytes its all-gathers deliver to this rank (the yielded counter). Scoped: the module's
    `dist` is restored on the way out."""
    import importlib

    module = importlib.import_module(_MODULE)
    counter = _Counter()
    original = module.dist
    world = dist.get_backend()
    module.dist = _stand_in(counter, None if world == "nccl" else world)
    try:
        yield counter
    finally:
        module.dist = original


def build(topo, src: str, dst: str) -> tuple[Optional[Any], Optional[str]]:
    """(communicator, None), or (None, upstream's refusal) for the edge src -> dst of `topo`'s layout.
    Call inside :func:`upstream_on_this_machine`, on every rank (it creates groups)."""
    from megatron.core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator

    try:
        comm = ColocatedBridgeCommunicator(
            topo.modules[src].grid, topo.modules[dst].grid, src_module_name=src, dest_module_name=dst
        )
    except ValueError as exc:
        return None, str(exc)
    return comm, None


def analytic_bytes(comm, src_local: tuple[int, ...], element_size: int, world: int) -> int:
    """Bytes one forward+backward moves between ranks, summed over the world: fan-in all-gathers the
    source tensors forward (every rank receives `scale - 1` sibling pieces; the backward narrows),
    fan-out all-gathers the gradients backward (every rank receives `scale - 1` pieces of its
    destination slice; the forward narrows), equal DP moves nothing."""
    numel = 1
    for n in src_local:
        numel *= n
    if comm.is_fan_in():
        return world * (comm.scale - 1) * numel * element_size
    if comm.is_fan_out():
        return world * (comm.scale - 1) * (numel // comm.scale) * element_size
    return 0
