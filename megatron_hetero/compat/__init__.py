"""The one layer that makes Megatron-core 0.16.1 run on CPU/gloo, and the only code that asks torch
about CUDA.

* :mod:`.device` (no Megatron import): ``get_device``, ``default_backend``, ``set_local_device``,
  ``synchronize``.
* :mod:`.cpu`: ``apply_cpu_compat()`` (no-op with CUDA, idempotent) and ``PATCHES``, the list of
  upstream spots it redirects.
* :mod:`.pg_collection`: ``apply_pg_collection_fixes()`` (every device, idempotent): upstream spots
  that read global ``parallel_state`` groups although the model got a ``pg_collection``.
* ``apply_compat()``: both of the above; call it once in the launcher's parent process, before
  building Megatron models.
* :mod:`.specs`: ``clip_vit_norm_kwargs``, ``ensure_global_memory_buffer``, ``ensure_moe_without_te``.

(The CP core attention and the CP layer spec are model code: ``megatron_hetero.models.cp_attention``
and ``megatron_hetero.models.layer_specs``.)

Names from the Megatron-importing submodules are loaded on first access, so importing this package
(e.g. for ``get_device``) stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

from .device import default_backend, get_device, set_local_device, synchronize

_LAZY = {
    "apply_cpu_compat": "cpu",
    "cpu_compat_applied": "cpu",
    "PATCHES": "cpu",
    "apply_pg_collection_fixes": "pg_collection",
    "PG_COLLECTION_PATCHES": "pg_collection",
    "clip_vit_norm_kwargs": "specs",
    "ensure_global_memory_buffer": "specs",
    "ensure_moe_without_te": "specs",
}

__all__ = [
    "apply_compat",
    "get_device",
    "default_backend",
    "set_local_device",
    "synchronize",
    *_LAZY,
]


def apply_compat() -> None:
    """``apply_pg_collection_fixes()`` on every machine, then ``apply_cpu_compat()`` (which does
    nothing where CUDA is available). Idempotent."""
    from .cpu import apply_cpu_compat
    from .pg_collection import apply_pg_collection_fixes

    apply_pg_collection_fixes()
    apply_cpu_compat()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
