"""Run Megatron-LM's `examples/mimo/pretrain_mimo.py` (unpatched) as one rank on CPU for `bench peer`:

    torchrun --nproc-per-node 4 -m megatron_hetero.bench.mimo_bringup TREE/examples/mimo/pretrain_mimo.py ARGS...

The project's Megatron-LM launcher (`megatron_lm.run.run_script`: the tree on `sys.path`, the CPU
redirections of `compat.megatron_lm`) plus, in this process only, the CPU bring-up of the MIMO
example's own GPU start-up (`compat.mimo_example`), so that the bench sees how far the script gets on
CPU. Nothing else is changed; a failure after these is the script's own (the bench records it).
"""

from __future__ import annotations

import sys
from megatron_hetero.megatron_lm.run import run_script


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip())
        return 2
    from megatron_hetero.compat.startup import import_megatron_core

    import_megatron_core()  # the launcher's first step, before anything imports megatron.core
    from megatron_hetero.compat.mimo_example import mimo_example_cpu_bringup

    mimo_example_cpu_bringup()
    run_script(sys.argv[1], sys.argv[2:])  # its errors propagate with their traceback (the bench keeps them)
    return 0


if __name__ == "__main__":
    sys.exit(main())
