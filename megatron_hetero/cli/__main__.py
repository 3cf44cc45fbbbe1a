"""`python -m megatron_hetero.cli ...`: the `megatron-hetero` command."""

import sys

from megatron_hetero.cli import main

if __name__ == "__main__":
    sys.exit(main())
