"""Run one of Megatron-LM's training scripts (patched or not) as one rank, e.g. under torchrun:

    torchrun --nproc-per-node 2 -m megatron_hetero.megatron_lm.run /path/to/Megatron-LM/pretrain_vlm.py ARGS...

The script's tree is appended to the END of ``sys.path`` (the pip Megatron-core wins in the merged
``megatron`` namespace package; the script's sibling modules such as ``pretrain_gpt`` import), and
``megatron.training`` is the tree's own where the tree has one (the megatron-core 0.19 wheel ships a
``megatron/training`` too, which would otherwise win): :func:`use_tree`.
Without a GPU the opt-in CPU redirections for Megatron-LM (``compat.megatron_lm``) are applied
first; with one, only the fixes every machine without Transformer Engine needs. Then the script runs
as ``__main__`` with its own arguments; nothing else changes.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence


def use_tree(tree: str) -> None:
    """Make the Megatron-LM tree at `tree` importable as the launcher runs it: appended to the end of
    ``sys.path``, with ``megatron.training`` bound to the tree's package (before anything imports it)."""
    import importlib.util

    if tree not in sys.path:
        sys.path.append(tree)
    init = os.path.join(tree, "megatron", "training", "__init__.py")
    if not os.path.isfile(init) or "megatron.training" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "megatron.training", init, submodule_search_locations=[os.path.dirname(init)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["megatron.training"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["megatron.training"]
        raise
    import megatron

    megatron.training = module


def tree_of(script: str) -> str:
    """The Megatron-LM tree a script belongs to: the nearest folder above it that holds
    ``megatron/training`` (a script inside the tree, e.g. ``examples/mimo/pretrain_mimo.py``, which
    imports ``examples.mimo...`` from the tree's root), else the script's own folder."""
    here = os.path.dirname(os.path.abspath(script))
    d = here
    while True:
        if os.path.isdir(os.path.join(d, "megatron", "training")):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return here
        d = parent


def run_script(script: str, argv: Sequence[str]) -> None:
    """Run `script` as `__main__` with `argv`, after the compat set (see the module docstring)."""
    script = os.path.abspath(script)
    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script}")
    from megatron_hetero.compat.startup import import_megatron_core

    import_megatron_core()  # before the tree's megatron.training imports it (compat.startup)
    use_tree(tree_of(script))
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
