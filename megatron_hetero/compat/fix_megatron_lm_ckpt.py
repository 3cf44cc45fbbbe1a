"""Fix entry (:data:`~.table.FIX`, a part of :data:`.fixes.NO_TE_PATCHES`, applied by the Megatron-LM
launcher on every machine) for Megatron-LM's own `--load` of a `--ckpt-format torch_dist` checkpoint
into a ``DistributedOptimizer`` with torch's Adam (no Transformer Engine or Apex).

``megatron.training.checkpointing.generate_state_dict`` asks the optimizer for its
``sharded_state_dict``, which starts with ``DistributedOptimizer.state_dict``: that reads Adam's
``step`` of every per-parameter state, and before the first step (a resume) there is none
(``assert len(steps) == 1`` fails on the empty list). The wrapper runs the project's
:func:`.fix_distopt.materialize_distributed_optimizer_state` (upstream's own
``_init_optimizer_states_with_dummy_values``) on the optimizer first; the load then overwrites the
dummy moments, the main weights and the step. Where the optimizer already has state (every save
after a step) it does nothing.

The load itself then writes the fp32 main weights through ``_set_main_param_and_optimizer_states``,
whose ``param`` entry is, in fp32, a view of the model parameter (a leaf that requires grad): the
in-place copy fails ("a view of a leaf Variable that requires grad is being used in an in-place
operation") unless autograd is off. ``load_checkpoint`` runs under ``torch.no_grad()`` here (a load
records no graph).
"""

from __future__ import annotations

import functools

import torch

from ._patching import rebind_function, wrap_call
from .fix_distopt import DISTOPT_FRESH_STATE, materialize_distributed_optimizer_state
from .table import FIX, MCORE_0_19, Patch, Spot

_CK = "megatron.training.checkpointing"


def _wrap_generate_state_dict() -> None:
    def make(fn):
        @functools.wraps(fn)
        def generate_state_dict(args, model, optimizer, *rest, **kwargs):
            if optimizer is not None and not getattr(optimizer, "is_stub_optimizer", False):
                materialize_distributed_optimizer_state(optimizer)
            return fn(args, model, optimizer, *rest, **kwargs)

        return generate_state_dict

    rebind_function([_CK], "generate_state_dict", make)
    rebind_function([_CK, "megatron.training.training"], "load_checkpoint", lambda fn: wrap_call(fn, torch.no_grad))


MEGATRON_LM_DISTOPT_LOAD = Patch(
    name="megatron_lm.distopt_fresh_state_on_load",
    reason=FIX,
    spot=f"{_CK}: generate_state_dict calls optimizer.sharded_state_dict, whose DistributedOptimizer.state_dict "
    "reads s['step'] of every per-parameter state; a resume's fresh optimizer has none (torch Adam, no TE/Apex), "
    "so load_checkpoint of a torch_dist checkpoint with --use-distributed-optimizer fails",
    action="materialize_distributed_optimizer_state(optimizer) (upstream's _init_optimizer_states_with_dummy_values) "
    "before generate_state_dict (the load overwrites the dummy values); load_checkpoint under torch.no_grad() (in "
    "fp32 the main weights it writes are views of the model parameters)",
    targets=MCORE_0_19,
    removal="remove with fix.distributed_optimizer_fresh_state (DistributedOptimizer.sharded_state_dict initialises "
    "its state itself)",
    spots=(
        Spot(
            f"{_CK}:generate_state_dict",
            params=("args", "model", "optimizer", "opt_param_scheduler"),
            uses=("optimizer.sharded_state_dict(",),
        ),
        Spot(f"{_CK}:load_checkpoint", params=("ddp_model", "optimizer", "opt_param_scheduler")),
        Spot("megatron.training.training:load_checkpoint"),
        *DISTOPT_FRESH_STATE.spots,
    ),
    apply=_wrap_generate_state_dict,
    use="applied once by apply_megatron_lm_no_te_fixes() (the Megatron-LM launcher, every machine)",
)
