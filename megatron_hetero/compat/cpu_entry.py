"""How the CPU table's entries (:mod:`.cpu`) are built: the ``torch`` -> ``_TorchOnCpu`` redirect of one
Megatron module (:func:`_redirect`, :func:`_torch_in`) and the Megatron-core module prefixes the entries name.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Tuple

from ._patching import MARK
from .table import CPU, MCORE_0_19, Patch, Spot
from .torch_on_cpu import _TORCH_ON_CPU


def _redirect_torch_in(module_name: str) -> Callable[[], None]:
    def apply() -> None:
        module = importlib.import_module(module_name)
        if not hasattr(module.torch, MARK):
            module.torch = _TORCH_ON_CPU

    return apply


_MC = "megatron.core"
_RNG = f"{_MC}.tensor_parallel.random"
_EMB = f"{_MC}.models.common.embeddings"
_LM = f"{_MC}.models.common.language_module.language_module"
_CKPT = f"{_MC}.dist_checkpointing.strategies"


def _torch_in(module: str, *uses: str) -> Spot:
    """The global name ``torch`` of ``module``, whose source still holds ``uses``."""
    return Spot(f"{module}:torch", "torch", uses=uses)


def _redirect(name: str, module: str, spot: str, uses: Tuple[str, ...], removal: str, **extra: Any) -> Patch:
    """An entry that swaps the name ``torch`` in ``module`` for the CPU redirect."""
    return Patch(
        name=name,
        reason=CPU,
        spot=spot,
        action="torch -> _TorchOnCpu",
        targets=MCORE_0_19,
        removal=removal,
        spots=(_torch_in(module, *uses), *extra.pop("spots", ())),
        apply=_redirect_torch_in(module),
        **extra,
    )
