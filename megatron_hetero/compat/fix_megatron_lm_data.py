"""Fix entry (:data:`~.table.FIX`, scoped, every machine) for the datasets of Megatron-LM's scripts.

The scripts' ``train_valid_test_datasets_provider`` builds a dataset only where Megatron's *global*
``parallel_state.get_tensor_model_parallel_rank()`` is 0 (``pretrain_gpt.is_dataset_built_on_rank``,
``pretrain_vlm``'s ``lambda: parallel_state.get_tensor_model_parallel_rank() == 0``): Megatron reads
batches on TP rank 0 and broadcasts them over its TP group. The project's stage runners
(``megatron_lm/runner.py``) read every rank's own samples on that rank, with no broadcast, so every
rank needs the datasets. Inside :func:`datasets_built_on_every_rank` the global TP rank reads 0; the
original is back on exit (also on an error). Nothing else runs in that window: the provider is
called alone inside it, before any model step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .table import FIX, MCORE_0_19, Patch, Spot, check_targets

_PS = "megatron.core.parallel_state"

DATASETS_ON_EVERY_RANK = Patch(
    name="megatron_lm.datasets_on_every_rank",
    reason=FIX,
    spot="the scripts' dataset providers (pretrain_gpt.is_dataset_built_on_rank, pretrain_vlm's "
    f"train_valid_test_datasets_provider) build datasets only where {_PS}.get_tensor_model_parallel_rank() "
    "is 0; the project's stage runners read their own samples on every rank",
    action="inside datasets_built_on_every_rank(), parallel_state.get_tensor_model_parallel_rank returns 0; "
    "undone on exit",
    targets=MCORE_0_19,
    removal="remove when the stage runners read batches on TP rank 0 and broadcast them over TP as Megatron does "
    "(or the providers take whether to build as an argument)",
    spots=(
        Spot(f"{_PS}:get_tensor_model_parallel_rank", params=()),
        Spot("megatron.core:mpu", "value"),
        Spot("pretrain_gpt", "source", uses=("if mpu.get_tensor_model_parallel_rank() != 0:",)),
        Spot("pretrain_vlm", "source", uses=("lambda: parallel_state.get_tensor_model_parallel_rank() == 0",)),
    ),
    use="scoped: datasets_built_on_every_rank() around the script's dataset provider (megatron_lm/runner.py)",
)


def _tp_rank_zero() -> int:
    return 0


@contextlib.contextmanager
def datasets_built_on_every_rank() -> Iterator[None]:
    """Inside, Megatron's global TP rank reads 0, so the scripts' dataset providers build their
    datasets on this rank (see the module docstring; ``megatron_lm.datasets_on_every_rank``)."""
    check_targets([DATASETS_ON_EVERY_RANK])
    from megatron.core import parallel_state

    orig = parallel_state.get_tensor_model_parallel_rank
    parallel_state.get_tensor_model_parallel_rank = _tp_rank_zero
    try:
        yield
    finally:
        parallel_state.get_tensor_model_parallel_rank = orig
