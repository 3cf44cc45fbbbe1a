"""The one layer that changes Megatron-core (0.19) where the project needs it, and the only code that
asks torch about CUDA. Removable piece by piece: every patch is an entry of one table with the
versions it targets, the upstream spots it relies on and its removal condition (:mod:`.table`).

Split by reason:

* :mod:`.cpu` (reason ``cpu``): ``PATCHES``, the redirections that make CUDA-only calls and
  ``device="cuda"`` work on CPU/gloo; applied only where CUDA is absent (``apply_cpu_compat()``).
  :mod:`.torch_on_cpu` holds the stand-ins they swap in; the entries themselves are in ``cpu_*``
  modules by the subsystem they redirect (``cpu_rng``, ``cpu_layers``, ``cpu_training``, ``cpu_moe``,
  ``cpu_checkpoint``; ``cpu_entry`` builds them).
* :mod:`.megatron_lm` (reason ``cpu``): the same for Megatron-LM's ``megatron.training``, applied by
  the Megatron-LM launcher only (``apply_megatron_lm_cpu_compat()``).
* :mod:`.fixes` (reason ``fix``): ``FIXES``, upstream bugs and limitations worked around on every
  machine, GPU included (explicit ``pg_collection`` groups, no Transformer Engine, the checkpoint
  reader swaps of ``checkpoint/safe_unpickle.py``), and the helpers ``ensure_global_memory_buffer``,
  ``clip_vit_norm_kwargs``, ``param_groups_gathered_over``.
* :mod:`.device` (no Megatron import, not a patch): ``get_device``, ``default_backend``,
  ``set_local_device``, ``synchronize``.

``apply_compat()`` checks the installed Megatron-core against the targets of every entry it is about
to apply (``UnsupportedMegatronVersion``, and nothing patched, on an untargeted version), then applies
the fixes and, without CUDA, the CPU set. It is called once, at the entry points only: the CLI
(``megatron_hetero.cli.run_command``, for the subcommands that build Megatron models; under
torchrun/srun too, since every rank runs the CLI), the Megatron-LM launcher
(``megatron_hetero.megatron_lm.run``), ``tests/conftest.py``, and the ``main`` of the benchmark
modules run as scripts. Library code assumes it ran (``require_compat()`` says so where it matters);
the fork launcher's ranks inherit it from their parent. Idempotent.

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
    "apply_fixes": "fixes",
    "FIXES": "fixes",
    "param_groups_gathered_over": "fixes",
    "clip_vit_norm_kwargs": "fixes",
    "ensure_global_memory_buffer": "fixes",
    "UnsupportedMegatronVersion": "table",
    "check_targets": "table",
    "every_patch": "catalog",
    "megatron_core_version": "table",
}

__all__ = [
    "apply_compat",
    "compat_applied",
    "require_compat",
    "get_device",
    "default_backend",
    "set_local_device",
    "synchronize",
    *_LAZY,
]

_APPLIED = False


def apply_compat() -> None:
    """Check the targets of every entry this machine needs (the fixes; without CUDA also the CPU set)
    against the installed Megatron-core, then ``apply_fixes()`` and ``apply_cpu_compat()`` (which
    does nothing where CUDA is available). Raises ``UnsupportedMegatronVersion`` (a RuntimeError
    naming the version found, the versions supported and the patch) before patching anything on an
    untargeted version. Idempotent."""
    global _APPLIED
    if _APPLIED:
        return
    import torch

    from .startup import import_megatron_core

    import_megatron_core()  # first: its fused kernels compile on first call, not at import
    from .cpu import PATCHES, apply_cpu_compat
    from .fixes import FIXES, apply_fixes
    from .table import check_targets

    check_targets([*FIXES, *([] if torch.cuda.is_available() else PATCHES)])
    apply_fixes()
    apply_cpu_compat()
    _APPLIED = True


def compat_applied() -> bool:
    """Whether :func:`apply_compat` has run in this process (or in the parent it was forked from)."""
    return _APPLIED


def require_compat(what: str) -> None:
    """RuntimeError unless :func:`apply_compat` has run: for library code that builds or runs Megatron
    models (``what`` names it), which assumes the entry point applied compat."""
    if not _APPLIED:
        raise RuntimeError(
            f"{what} needs megatron_hetero.compat.apply_compat() applied first: call it once at the program's "
            f"entry point, before building Megatron models (the megatron-hetero CLI, the Megatron-LM launcher and "
            f"tests/conftest.py do; library code does not apply it itself)"
        )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
