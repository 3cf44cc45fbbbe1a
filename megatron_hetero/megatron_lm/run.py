"""Run one of Megatron-LM's training scripts (patched or not) as one rank, e.g. under torchrun:

    torchrun --nproc-per-node 2 -m megatron_hetero.megatron_lm.run /path/to/Megatron-LM/pretrain_vlm.py ARGS...

The script's tree is appended to the END of ``sys.path`` (the pip Megatron-core wins in the merged
``megatron`` namespace package; the script's sibling modules such as ``pretrain_gpt`` import).
Without a GPU the opt-in CPU redirections for Megatron-LM (``compat.megatron_lm``) are applied
first; with one, only the fixes every machine without Transformer Engine needs. Then the script runs
as ``__main__`` with its own arguments; nothing else changes.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence


def run_script(script: str, argv: Sequence[str]) -> None:
    """Run `script` as `__main__` with `argv`, after the compat set (see the module docstring)."""
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script}")
    tree = os.path.dirname(script)
    if tree not in sys.path:
        sys.path.append(tree)
    from megatron_hetero.compat.megatron_lm import apply_megatron_lm_cpu_compat

    apply_megatron_lm_cpu_compat()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    try:
        run_script(argv[0], argv[1:])
    except ValueError as exc:
        print(f"megatron-hetero megatron-lm: invalid input: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
