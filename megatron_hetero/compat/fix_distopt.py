"""Fix entries (:data:`~.table.FIX`, a part of :data:`.fixes.FIXES`) for loading a checkpoint into a
Megatron-core ``DistributedOptimizer`` with torch's Adam (no Transformer Engine or Apex): its
per-parameter state holds a ``step`` tensor, which Megatron's checkpoint code does not expect.

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
"""

from __future__ import annotations

import torch

from ._patching import wrap_method
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
