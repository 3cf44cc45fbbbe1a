"""`python -m megatron_hetero ...` (and `torchrun -m megatron_hetero ...`): the `megatron-hetero` command."""

import sys

from megatron_hetero.cli import main

if __name__ == "__main__":
    sys.exit(main())
