"""Fix entries (:data:`~.table.FIX`, a part of :data:`.fixes.FIXES`) for loading a checkpoint into a
Megatron-core ``DistributedOptimizer`` with torch's Adam (no Transformer Engine or Apex): its
per-parameter state holds a ``step`` tensor, which Megatron's checkpoint code does not expect; and
one for saving the ``fully_reshardable`` checkpoint of a ``DistributedOptimizer`` over several
gradient buckets (any inner optimizer).

* ``fix.distributed_optimizer_fresh_state``: ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` starts with ``state_dict()``, which reads
Adam's step from every per-parameter state (``s["step"]``); a fresh optimizer has no state, and the
``init_state_fn`` Megatron offers creates the moments but no ``step``: ``KeyError: 'step'``.
Megatron-core itself fills a fresh optimizer with dummy values for its FSDP path
(``_init_optimizer_states_with_dummy_values``: one step of the inner optimizer with zero gradients);
:func:`materialize_distributed_optimizer_state` does the same before a load. The dummy values are
overwritten by the load (moments, fp32 main weights and step all come from the checkpoint).
* ``fix.distributed_optimizer_load_step``: ``load_parameter_state_from_fully_reshardable`` hands
  ``_set_main_param_and_optimizer_states`` the checkpoint's tensors without ``step`` (it is restored
  from the param groups), and that method then copies every tensor of the per-parameter state,
  ``step`` included: ``KeyError: 'step'``. The wrapper passes ``step=None``, which the method skips
  (it copies only tensors), so the step stays the one ``load_state_dict`` set from the param groups.
  And ``load_state_dict`` sets that step as ONE tensor shared by every parameter's state
  (``s["step"] = step``; torch keeps a step tensor as given), so torch Adam's in-place ``step += 1``
  per parameter advanced it once per parameter in the first step after a resume (wrong bias
  corrections: measured 1.7e-3 relative loss difference one step later). After ``load_state_dict``
  every parameter gets its own copy.
* ``fix.distributed_optimizer_reshardable_buckets``: ``sharded_param_state_fully_reshardable`` (the
  save of the ``fully_reshardable`` format) cuts each parameter's state out of the gathered buffer
  tensors of ``get_parameter_state_dp_zero`` at the parameter's offsets in the DDP buffer
  (``param_index_map``), but ``get_parameter_state_dp_zero`` concatenates the buckets WITHOUT the
  padding at the end of each bucket (it pads a bucket to a multiple of the DP size). With one bucket
  the two agree; with several (``--overlap-grad-reduce`` with ``--ddp-bucket-size``) every parameter
  after the first bucket was saved from the wrong elements, shifted by the padding of the buckets
  before it (its neighbours' moments and main weights, the last ones zero-padded; measured: 3.2e-2
  relative loss difference in the first step after a resume). During the call the gathered tensors
  are laid out in buffer coordinates again (each bucket at its offset, zeros in the padding), which
  is what the slicing expects. The load side is unaffected (it slices whole per-parameter tensors).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ._patching import swapped, wrap_method
from .table import FIX, MCORE_0_19, Patch, Spot, check_targets

_DOPT = "megatron.core.optimizer.distrib_optimizer"

DISTOPT_FRESH_STATE = Patch(
    name="fix.distributed_optimizer_fresh_state",
    reason=FIX,
    spot=f"{_DOPT}: DistributedOptimizer.state_dict reads s['step'] of every per-parameter state; before the "
    "first step (a resume) there is none (torch Adam, no TE/Apex), so sharded_state_dict(is_loading=True) fails",
    action="materialize_distributed_optimizer_state(optimizer) runs Megatron's own "
    "_init_optimizer_states_with_dummy_values on each fresh DistributedOptimizer before the load",
    targets=MCORE_0_19,
    removal="remove when DistributedOptimizer.sharded_state_dict(is_loading=True) initialises its state itself "
    "(as its FSDP path does)",
    spots=(
        Spot(f"{_DOPT}:DistributedOptimizer.state_dict", "method", uses=('s["step"].item()',)),
        Spot(f"{_DOPT}:DistributedOptimizer._init_optimizer_states_with_dummy_values", "method", params=("self",)),
    ),
    use="helper: materialize_distributed_optimizer_state() before a checkpoint load (checkpoint/sharded.py)",
)


def materialize_distributed_optimizer_state(optimizer) -> None:
    """Give every fresh (stateless) ``DistributedOptimizer`` inside ``optimizer`` (a Megatron optimizer,
    chained or not) its per-parameter state, with dummy values a checkpoint load then overwrites.
    Local: no collective."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    check_targets([DISTOPT_FRESH_STATE])
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def _no_step_from_checkpoint(fn):
    def wrapper(self, model_param, tensors):
        return fn(self, model_param, {"step": None, **tensors})

    return wrapper


def _own_step_tensors(fn):
    def wrapper(self, state_dict):
        out = fn(self, state_dict)
        for st in self.optimizer.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
        return out

    return wrapper


def _apply_load_step() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrap_method(DistributedOptimizer, "_set_main_param_and_optimizer_states", _no_step_from_checkpoint)
    wrap_method(DistributedOptimizer, "load_state_dict", _own_step_tensors)


DISTOPT_LOAD_STEP = Patch(
    name="fix.distributed_optimizer_load_step",
    reason=FIX,
    spot=f"{_DOPT}: DistributedOptimizer._set_main_param_and_optimizer_states copies every tensor of the "
    "per-parameter state (torch Adam's step too) from the checkpoint's tensors, which "
    "load_parameter_state_from_fully_reshardable hands over without 'step' (KeyError on a resume); "
    "load_state_dict gives every parameter's state one shared step tensor (torch Adam then advances it "
    "once per parameter)",
    action="the checkpoint's tensors get step=None, which the method skips (it copies tensors only); after "
    "load_state_dict every parameter's state holds its own step tensor",
    targets=MCORE_0_19,
    removal="remove when the fully_reshardable load skips the state keys it does not load",
    spots=(
        Spot(
            f"{_DOPT}:DistributedOptimizer._set_main_param_and_optimizer_states",
            "method",
            params=("self", "model_param", "tensors"),
            uses=("if not isinstance(tensors[key], torch.Tensor):",),
        ),
        Spot(
            f"{_DOPT}:DistributedOptimizer.load_parameter_state_from_fully_reshardable",
            "method",
            uses=('if k == "step":',),
        ),
    ),
    apply=_apply_load_step,
)


def _buffer_coordinates(optimizer: Any, state: Optional[dict]) -> Optional[dict]:
    """``get_parameter_state_dp_zero``'s gathered state (per buffer and dtype: one tensor per state key,
    the buckets concatenated without their end padding) laid out like the DDP buffer: bucket ``b``'s
    unpadded elements at ``bucket.offset``, zeros in the padding. In place; returns ``state``."""
    if state is None:
        return None
    for gbuf_idx, buffer in enumerate(optimizer.buffers):
        for world in state[gbuf_idx].values():
            for key, compact in list(world.items()):
                if not isinstance(compact, torch.Tensor):  # numel_unpadded
                    continue
                if compact.numel() != buffer.numel_unpadded:  # not the gather this fix was written for
                    raise RuntimeError(
                        f"fix.distributed_optimizer_reshardable_buckets: gathered {key!r} of buffer {gbuf_idx} has "
                        f"{compact.numel()} elements, the buffer {buffer.numel_unpadded} unpadded "
                        f"({len(buffer.buckets)} buckets)"
                    )
                full = torch.zeros(buffer.numel, dtype=compact.dtype, device=compact.device)
                start = 0
                for bucket in buffer.buckets:
                    n = bucket.numel_unpadded
                    full[bucket.offset : bucket.offset + n] = compact[start : start + n]
                    start += n
                world[key] = full
    return state


def _reshardable_in_buffer_coordinates(fn: Callable) -> Callable:
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        gather = self.get_parameter_state_dp_zero  # bound (the class's, CPU wrapper included)

        def in_buffer_coordinates(*a: Any, **k: Any) -> Optional[dict]:
            return _buffer_coordinates(self, gather(*a, **k))

        with swapped(self, "get_parameter_state_dp_zero", in_buffer_coordinates):
            return fn(self, *args, **kwargs)

    return wrapper


def _apply_reshardable_buckets() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    wrap_method(DistributedOptimizer, "sharded_param_state_fully_reshardable", _reshardable_in_buffer_coordinates)


DISTOPT_RESHARDABLE_BUCKETS = Patch(
    name="fix.distributed_optimizer_reshardable_buckets",
    reason=FIX,
    spot=f"{_DOPT}: DistributedOptimizer.sharded_param_state_fully_reshardable slices the state gathered by "
    "get_parameter_state_dp_zero at the parameters' DDP buffer offsets (param_index_map), but that gather "
    "drops the padding at the end of every bucket: with several buckets every parameter after the first "
    "bucket is saved from shifted elements",
    action="during the call the gathered tensors are laid out in buffer coordinates (each bucket's unpadded "
    "elements at bucket.offset, zeros in the padding)",
    targets=MCORE_0_19,
    removal="remove when the fully_reshardable save maps param_index_map through the buckets' unpadded offsets "
    "(or the gather keeps the padding)",
    spots=(
        Spot(
            f"{_DOPT}:DistributedOptimizer.sharded_param_state_fully_reshardable",
            "method",
            params=("self", "model_sharded_state_dict", "is_loading", "metadata"),
            uses=(
                "dp_zero_state_dict = self.get_parameter_state_dp_zero(",
                "state_ten = world_tensors[state_key][param_world_start:param_world_end]",
            ),
        ),
        Spot(
            f"{_DOPT}:DistributedOptimizer.get_parameter_state_dp_zero",
            "method",
            uses=("offset_in_world_tensors += gbuf_world_numel_unpadded",),
        ),
    ),
    apply=_apply_reshardable_buckets,
)
