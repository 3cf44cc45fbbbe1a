"""Megatron-LM's own training scripts with per-module layouts (docs/megatron-lm.md).

The patches in ``patches/megatron-lm/core_v0.19.0/`` make ``pretrain_vlm.py`` hand over to
:func:`pretrain_vlm` and ``pretrain_gpt.py`` to :func:`pretrain_gpt` when a ``--hetero-*`` flag is
given; everything else stays upstream's. ``driver.py`` holds what both share.
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


def pretrain_gpt(*args, **kwargs):
    """See :func:`megatron_hetero.megatron_lm.gpt.pretrain_gpt`."""
    from megatron_hetero.megatron_lm.gpt import pretrain_gpt as _impl

    return _impl(*args, **kwargs)


__all__ = ["pretrain_gpt", "pretrain_vlm", "requested"]
