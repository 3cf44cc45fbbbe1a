"""CPU bring-up of Megatron-LM's `examples/mimo` training script, for `bench peer` only.

The MIMO example's own start-up asks for a GPU in three spots; in the one process that runs the
script for the benchmark (`bench/mimo_bringup.py`), and nowhere else, they are redirected:
- `examples/mimo/training/distributed.py` `initialize_distributed`: `torch.cuda.set_device` (a no-op
  here) and `init_process_group(backend="nccl", device_id=...)` (gloo, no device binding);
- `megatron.core.hyper_comm_grid.HyperCommGrid(backend="nccl")` (the example's module grids) and the
  bridge communicator's `new_group(backend="nccl")`: the default (gloo) backend.
Not part of the compat table (`catalog.every_patch`): nothing in the package applies it; a failure
after these is the script's own, which the benchmark records.
"""

from __future__ import annotations

from typing import Any


def mimo_example_cpu_bringup() -> None:
    """Redirect the MIMO example's GPU bring-up to CPU/gloo in this process (module docstring)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from megatron.core import hyper_comm_grid

    torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    init, new_group = dist.init_process_group, c10d.new_group

    def init_gloo(*args: Any, backend: Any = None, device_id: Any = None, **kw: Any) -> Any:
        return init(*args, backend="gloo", **kw)

    def group_default(*args: Any, backend: Any = None, **kw: Any) -> Any:
        return new_group(*args, backend=None if backend == "nccl" else backend, **kw)

    dist.init_process_group = init_gloo  # type: ignore[assignment]
    dist.new_group = c10d.new_group = group_default  # type: ignore[assignment]
    grid_init = hyper_comm_grid.HyperCommGrid.__init__

    def grid_gloo(self: Any, *args: Any, backend: Any = None, **kw: Any) -> None:
        grid_init(self, *args, backend=None if backend == "nccl" else backend, **kw)

    hyper_comm_grid.HyperCommGrid.__init__ = grid_gloo  # type: ignore[method-assign]
