"""Run Megatron-LM's `examples/mimo/pretrain_mimo.py` (unpatched) as one rank on CPU for `bench peer`:

    torchrun --nproc-per-node 4 -m megatron_hetero.bench.mimo_bringup TREE/examples/mimo/pretrain_mimo.py ARGS...

The project's Megatron-LM launcher (`megatron_lm.run.run_script`: the tree on `sys.path`, the CPU
redirections of `compat.megatron_lm`) plus, in this process only, the three spots where the MIMO
example's own bring-up asks for a GPU, so that the bench sees how far the script gets on CPU:
- `examples/mimo/training/distributed.py` `initialize_distributed`: `torch.cuda.set_device` and
  `init_process_group(backend="nccl", device_id=cuda:N)` -> no device binding, gloo;
- `megatron.core.hyper_comm_grid.HyperCommGrid(backend="nccl")` (the example's module grids) and the
  bridge communicator's `new_subgroups_by_enumeration(backend="nccl")` -> the default (gloo) backend.
Nothing else is changed; a failure after these is the script's own (the bench records it).
"""

from __future__ import annotations

import sys
from typing import Any


def _cpu_bringup() -> None:
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


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip())
        return 2
    from megatron_hetero.compat.startup import import_megatron_core
    from megatron_hetero.megatron_lm.run import run_script

    import_megatron_core()  # the launcher's first step, before anything imports megatron.core
    _cpu_bringup()
    run_script(sys.argv[1], sys.argv[2:])  # its errors propagate with their traceback (the bench keeps them)
    return 0


if __name__ == "__main__":
    sys.exit(main())
