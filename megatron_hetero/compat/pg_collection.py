"""Fixes for Megatron-core 0.16.1 spots that ignore an explicit ``pg_collection``.

Not CPU-specific: these spots read Megatron's *global* ``parallel_state`` groups even when the model
was built with ``pg_collection=``. Without ``initialize_model_parallel`` they fail
("tensor model parallel group is not initialized"); with it they would silently use the wrong
group whenever two modules in one process have different layouts. So
:func:`apply_pg_collection_fixes` is applied on every machine (GPU included), idempotently.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import List

from ._patching import Patch, wrap_method

__all__ = ["apply_pg_collection_fixes", "param_groups_gathered_over", "PG_COLLECTION_PATCHES"]

_APPLIED = False


@contextlib.contextmanager
def _cross_entropy_uses(tp_group):
    """During the block, ``tensor_parallel.cross_entropy`` takes its TP group from ``tp_group``."""
    module = importlib.import_module("megatron.core.tensor_parallel.cross_entropy")
    names = (
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_world_size",
    )
    replacements = (
        lambda *args, **kwargs: tp_group,
        lambda *args, **kwargs: tp_group.rank(),
        lambda *args, **kwargs: tp_group.size(),
    )
    saved = [getattr(module, name) for name in names]
    for name, value in zip(names, replacements):
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(module, name, value)


def _loss_uses_model_tp_group() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    def make(original):
        @functools.wraps(original)
        def compute_language_model_loss(self, labels, logits):
            tp_group = getattr(getattr(self, "pg_collection", None), "tp", None)
            if tp_group is None:
                return original(self, labels, logits)
            # _VocabParallelCrossEntropy communicates only in forward; backward is local.
            with _cross_entropy_uses(tp_group):
                return original(self, labels, logits)

        return compute_language_model_loss

    wrap_method(LanguageModule, "compute_language_model_loss", make)


PG_COLLECTION_PATCHES: List[Patch] = [
    Patch(
        "megatron.core.models.common.language_module.language_module: "
        "LanguageModule.compute_language_model_loss -> tensor_parallel.vocab_parallel_cross_entropy "
        "(tensor_parallel/cross_entropy.py: _VocabParallelCrossEntropy.forward reads "
        "parallel_state.get_tensor_model_parallel_group/rank/world_size)",
        "during the call, those three names in tensor_parallel.cross_entropy return the model's "
        "pg_collection.tp group",
        _loss_uses_model_tp_group,
    ),
]


@contextlib.contextmanager
def param_groups_gathered_over(group):
    """Megatron-core's `get_megatron_optimizer` aligns param-group keys with an `all_gather_object`
    on the default (world) group (optimizer/__init__.py `_get_param_groups`, once for dense and once
    for expert parameters). Only ranks that build this module's optimizer call it, so with disjoint
    islands or frozen stages the world-wide gather never completes. Inside this context a gather on
    the default group runs over `group` (this module's pipeline stage) instead."""
    import torch.distributed as dist

    orig = dist.all_gather_object

    def gather(object_list, obj, group_=None, **kw):
        group_ = kw.pop("group", group_)
        if group_ is not None:
            return orig(object_list, obj, group=group_, **kw)
        out = [None] * dist.get_world_size(group)
        orig(out, obj, group=group, **kw)
        object_list[:] = out

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = orig


def apply_pg_collection_fixes() -> None:
    """Apply :data:`PG_COLLECTION_PATCHES` (any device; idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    for patch in PG_COLLECTION_PATCHES:
        patch.apply()
    _APPLIED = True
