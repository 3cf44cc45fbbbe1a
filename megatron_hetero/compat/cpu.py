"""Redirections that make Megatron-core 0.19 run on CPU with gloo (reason :data:`~.table.CPU`).

:func:`apply_cpu_compat` (called by :func:`megatron_hetero.compat.apply_compat`) is the only entry
point. It does nothing when CUDA is available, refuses a Megatron-core that is not a target of every
entry (:mod:`.table`), and is idempotent. It never copies Megatron code: each patch either swaps the name ``torch`` inside one
Megatron module for a thin redirect (``_TorchOnCpu``), or wraps one Megatron function so that a
CUDA-only call inside it has a CPU meaning while that function runs (plus one logging filter).
:data:`PATCHES` lists every patch as a table entry (upstream spots, target versions, removal
condition); nothing else is touched, and
``torch`` itself is only modified (``Tensor.cuda``/``Tensor.type``) for the duration of the wrapped
Megatron calls.

The set is what a Megatron-core ``GPTModel`` (local spec, explicit ``pg_collection``) needs for
forward/backward with TP, SP, PP (1F1B via ``get_forward_backward_func``) and CP (with
:mod:`megatron_hetero.models.cp_attention`), Megatron ``DistributedDataParallel`` and the
Megatron optimizers (fp32, the float16 wrapper of ``--bf16``, and the ``DistributedOptimizer`` of
``--use-distributed-optimizer``), ``CLIPViTModel``, and ``dist_checkpointing.save`` (torch_dist
format; loading needs nothing); see
``tests/ranks/test_compat.py``. The stand-ins themselves live in :mod:`.torch_on_cpu`; the entries, by the
subsystem they redirect, in :mod:`.cpu_rng`, :mod:`.cpu_layers`, :mod:`.cpu_training`, :mod:`.cpu_moe` and
:mod:`.cpu_checkpoint` (built with :mod:`.cpu_entry`). Every entry was checked to be needed by one of those cases. Not covered
(they still fail on CPU): CUDA graphs, the upstream bridge communicator, and
interleaved (VPP) schedules were not verified (on gloo they need ``batch_p2p_comm=False``).

Side effect to know: on CPU the "CUDA" generator is the CPU generator, so
``model_parallel_cuda_manual_seed(seed)`` reseeds the CPU generator with ``seed`` (on GPU it leaves
the CPU generator alone).
"""

from __future__ import annotations

from typing import List

import torch

from .table import Patch, check_targets
from .cpu_rng import RNG_PATCHES
from .cpu_layers import LAYER_PATCHES
from .cpu_training import TRAINING_PATCHES
from .cpu_moe import MOE_PATCHES
from .cpu_checkpoint import CHECKPOINT_PATCHES

__all__ = ["apply_cpu_compat", "cpu_compat_applied", "PATCHES", "Patch"]

_APPLIED = False


#: Megatron-core spots redirected on a machine without CUDA (reason CPU), each with its targets,
#: its spots and its removal condition (:mod:`.table`), by the subsystem they redirect.
PATCHES: List[Patch] = [*RNG_PATCHES, *LAYER_PATCHES, *TRAINING_PATCHES, *MOE_PATCHES, *CHECKPOINT_PATCHES]


def apply_cpu_compat() -> None:
    """Apply every patch in :data:`PATCHES` when CUDA is not available; a no-op otherwise.

    Refuses (:class:`~.table.UnsupportedMegatronVersion`, nothing patched) when the installed
    Megatron-core is not a target of every patch. Idempotent: a second call (or a call after
    ``importlib.reload`` of this module) changes nothing. Called by
    :func:`megatron_hetero.compat.apply_compat` at the entry points (in the fork launcher's parent
    process: the patched modules are then inherited by every rank).
    """
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    check_targets(PATCHES)
    for patch in PATCHES:
        patch.apply()
    _APPLIED = True


def cpu_compat_applied() -> bool:
    """Whether :func:`apply_cpu_compat` has patched Megatron in this process."""
    return _APPLIED
