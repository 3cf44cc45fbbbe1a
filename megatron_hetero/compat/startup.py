"""Process start-up: import Megatron-core without compiling anything yet.

Megatron-core 0.19 sets ``megatron.core.jit.jit_fuser = torch.compile`` when it is imported, and its
fused-kernel modules (``fusions.fused_bias_gelu``, ``fused_bias_geglu``, ``fused_bias_swiglu``, ...)
decorate their functions with it at import time. Each ``torch.compile(fn)`` call imports
``torch._dynamo`` and its dependencies: about 2.5 s of CPU in every fresh process (measured on these
2-core machines: ``import torch, megatron.core`` plus the GPT and CLIP model modules took 6.9-7.0 s of
user CPU, 4.3-4.7 s with this), although most processes never call a fused kernel (the CLI refusing a
layout, the planner, a CPU run with the fusions off).

:func:`import_megatron_core` imports ``megatron.core`` with ``torch.compile`` replaced, for the
duration of that import only, by :func:`deferred_compile`: the decorated function is returned wrapped,
and the real ``torch.compile`` is called, with the same arguments, when the function is first called.
What runs is the same compiled function; only the moment of compilation moves. ``jit_fuser`` keeps
the deferring wrapper, so the fusion modules imported later defer too. Everything else that calls
``torch.compile`` gets the real one (it is restored before this function returns).

Called first by the entry points that import Megatron-core (``compat.apply_compat``,
``compat.megatron_lm.apply_megatron_lm_cpu_compat``); it does nothing once ``megatron.core`` is
imported. Removal condition: Megatron-core binding ``jit_fuser`` lazily upstream.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for `compile_fn` (``torch.compile``) that compiles on the first call instead of at
    decoration. Accepts both ``deferred(fn, **options)`` and ``deferred(**options)(fn)``."""

    def deferred(model: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: deferred(fn, **options)
        compiled: Optional[Callable[..., Any]] = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


def import_megatron_core() -> None:
    """Import ``megatron.core`` with its ``torch.compile`` decorations deferred (module docstring).
    Idempotent; a no-op when ``megatron.core`` is already imported."""
    if "megatron.core" in sys.modules:
        return
    import torch

    real = torch.compile
    torch.compile = deferred_compile(real)  # type: ignore[assignment]  # restored below
    try:
        import megatron.core  # noqa: F401
        import megatron.core.jit  # noqa: F401  # binds jit_fuser to the deferring stand-in
    finally:
        torch.compile = real  # type: ignore[assignment]
