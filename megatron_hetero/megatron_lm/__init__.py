"""Megatron-LM's own training scripts with per-module layouts (issue 12).

The patches in ``patches/megatron-lm/core_v0.16.1/`` make ``pretrain_vlm.py`` hand over to
:func:`pretrain_vlm` when a ``--hetero-*`` flag is given; everything else stays upstream's.
Floor: training (imports models/runtime/plan/layout/compat; only the CLI imports it).
"""
from __future__ import annotations

import sys
from typing import Sequence


def requested(argv: Sequence[str] = None) -> bool:
    """Whether the command line asks for a heterogeneous layout (any ``--hetero-*`` flag)."""
    argv = sys.argv[1:] if argv is None else argv
    return any(a.startswith("--hetero-") for a in argv)


def pretrain_vlm(*args, **kwargs):
    """See :func:`megatron_hetero.megatron_lm.vlm.pretrain_vlm`."""
    from megatron_hetero.megatron_lm.vlm import pretrain_vlm as _impl

    return _impl(*args, **kwargs)


__all__ = ["pretrain_vlm", "refuse_single_module", "requested"]


def refuse_single_module(script: str) -> int:
    """What patched single-model scripts (pretrain_gpt.py) do with a `--hetero-*` flag: exit 2."""
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron-hetero megatron-lm: invalid input: {script} trains one model on one layout; per-module "
              f"layouts (--hetero-*) apply to pretrain_vlm.py (modules 'vision' and 'language')",
              file=sys.stderr, flush=True)
    return 2
