"""Fixes for Megatron-core 0.19 that act on every machine, GPU included (reason :data:`~.table.FIX`).

Not CPU-specific; each works around an upstream bug or limitation the project meets wherever it runs:

* spots that read Megatron's *global* ``parallel_state`` groups although the model was built with
  ``pg_collection=`` (without ``initialize_model_parallel`` they fail, with it they would silently
  use the wrong group whenever two modules in one process have different layouts):
  ``fix.optimizer_param_groups_gather`` (:func:`param_groups_gathered_over`, scoped),
  ``fix.global_memory_buffer`` (:func:`ensure_global_memory_buffer`, a helper). (0.16.1 also needed
  ``fix.loss_tp_group``: its vocab-parallel cross entropy read the global TP group; 0.19 passes the
  model's ``tp_group``);
* spots that fail without Transformer Engine: ``fix.clip_vit_norm`` (:func:`clip_vit_norm_kwargs`),
  and for Megatron-LM's ``LLaVAModel`` ``fix.clip_vit_default_norm`` (:data:`NO_TE_PATCHES`, applied by
  the Megatron-LM launcher). (0.16.1 also needed ``fix.moe_router_without_te``: its MoE router read
  ``te_general_gemm``, unbound without TE; 0.19 binds it to None);
* ``fix.checkpoint_reader``: the reader and common-state swaps of ``checkpoint/safe_unpickle.py``
  (:func:`checkpoint_reads_swapped`, scoped), so that a torch_dist checkpoint load (0.19's format or
  0.16.1's, with ``common.pt``) runs no code from the checkpoint;
* ``fix.distributed_optimizer_fresh_state`` (:mod:`.fix_distopt`): a fresh ``DistributedOptimizer``
  with torch's Adam cannot describe its state for a checkpoint load
  (:func:`materialize_distributed_optimizer_state`, a helper), and ``fix.distributed_optimizer_load_step``:
  nor load the per-parameter state it describes, and ``fix.distributed_optimizer_reshardable_buckets``:
  nor save the state of a module in several gradient buckets at the right offsets;
* ``fix.sgd_load_state``: Megatron's SGD optimizers cannot describe their momentum buffers for a
  checkpoint load (:func:`materialize_sgd_state`, a helper);
* ``megatron_lm.datasets_on_every_rank`` (:mod:`.fix_megatron_lm_data`): Megatron-LM's scripts build
  their datasets on TP rank 0 only (:func:`datasets_built_on_every_rank`, scoped).

:data:`FIXES` lists the entries :func:`megatron_hetero.compat.apply_compat` gates (and applies,
where they have ``apply``); the scoped swaps and the helpers check their targets again when used.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable, Dict, Iterator, List

import torch

from .table import FIX, MCORE_0_19, Patch, Spot, check_targets
from .fix_distopt import (
    DISTOPT_FRESH_STATE,
    DISTOPT_LOAD_STEP,
    DISTOPT_RESHARDABLE_BUCKETS,
    materialize_distributed_optimizer_state,
)
from .fix_megatron_lm_ckpt import MEGATRON_LM_DISTOPT_LOAD
from .fix_megatron_lm_data import DATASETS_ON_EVERY_RANK, datasets_built_on_every_rank

__all__ = [
    "FIXES",
    "NO_TE_PATCHES",
    "apply_fixes",
    "apply_megatron_lm_no_te_fixes",
    "checkpoint_reads_swapped",
    "clip_vit_norm_kwargs",
    "datasets_built_on_every_rank",
    "ensure_global_memory_buffer",
    "fixes_applied",
    "materialize_distributed_optimizer_state",
    "materialize_sgd_state",
    "param_groups_gathered_over",
]

_APPLIED = False
_NO_TE_APPLIED = False
_NORM_MARK = "__megatron_hetero_clip_vit_norm__"  # in table.WRAPPER_MARKS

_MC = "megatron.core"
_LM = f"{_MC}.models.common.language_module.language_module"
_CLIP = f"{_MC}.models.vision.clip_vit_model"
_DCP_TORCH = f"{_MC}.dist_checkpointing.strategies.torch"


# --------------------------------------------------------------------------------------------
# fix.optimizer_param_groups_gather (scoped)
# --------------------------------------------------------------------------------------------

PARAM_GROUPS_GATHER = Patch(
    name="fix.optimizer_param_groups_gather",
    reason=FIX,
    spot=f"{_MC}.optimizer: _get_param_groups aligns param-group keys with torch.distributed.all_gather_object "
    "on the default (world) group (once for dense and once for expert parameters)",
    action="inside param_groups_gathered_over(group), a gather on the default group runs over `group` "
    "(this module's pipeline stage)",
    targets=MCORE_0_19,
    removal="remove when get_megatron_optimizer aligns param groups over a group from its pg_collection",
    spots=(
        Spot(
            f"{_MC}.optimizer:_get_param_groups",
            params=("model_chunks", "config"),
            uses=("torch.distributed.all_gather_object(gathered_params_key, params_key)",),
        ),
        Spot("torch.distributed:all_gather_object", params=("object_list", "obj", "group")),
    ),
    use="scoped: param_groups_gathered_over() around get_megatron_optimizer (runtime/module_state.py)",
)


@contextlib.contextmanager
def param_groups_gathered_over(group):
    """Megatron-core's `get_megatron_optimizer` aligns param-group keys with an `all_gather_object`
    on the default (world) group (optimizer/__init__.py `_get_param_groups`, once for dense and once
    for expert parameters). Only ranks that build this module's optimizer call it, so with disjoint
    islands or frozen stages the world-wide gather never completes. Inside this context a gather on
    the default group runs over `group` (this module's pipeline stage) instead
    (``fix.optimizer_param_groups_gather``)."""
    import torch.distributed as dist

    check_targets([PARAM_GROUPS_GATHER])
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


# --------------------------------------------------------------------------------------------
# fix.checkpoint_reader (scoped; used by checkpoint/safe_unpickle.py)
# --------------------------------------------------------------------------------------------

_DCP_SERIALIZATION = f"{_MC}.dist_checkpointing.serialization"
_DCP_COMMON = f"{_MC}.dist_checkpointing.strategies.common"

CHECKPOINT_READER = Patch(
    name="fix.checkpoint_reader",
    reason=FIX,
    spot=f"{_DCP_TORCH}: TorchDistLoadShardedStrategy makes its reader with the module function "
    "_get_filesystem_reader, and torch's FileSystemReader.read_metadata reads .metadata with a plain "
    f"pickle.load; {_DCP_SERIALIZATION}: load reads the common state with load_common_state_dict, which "
    "decodes the 'common_state' bytes entry through torch's DefaultLoadPlanner.load_bytes "
    "(torch.load(weights_only=False)) or reads a legacy common.pt with torch.load's default (a crafted "
    "checkpoint runs code when it is loaded)",
    action="during each load of checkpoint/safe_unpickle.py, _get_filesystem_reader returns its "
    "SafeFileSystemReader (a FileSystemReader whose read_metadata uses a restricted unpickler and whose "
    "read_data refuses bytes entries) and load_common_state_dict is its read_common_state (common.pt or the "
    "'common_state' bytes decoded with torch.load(weights_only=True)); undone on exit",
    targets=MCORE_0_19,
    removal="remove when Megatron-core's torch_dist load takes a storage reader and decodes the common state "
    "with weights_only=True (or torch's FileSystemReader reads .metadata with a restricted unpickler)",
    spots=(
        Spot(f"{_DCP_TORCH}:_get_filesystem_reader", params=("checkpoint_dir", "cache_metadata", "async_strategy")),
        Spot(
            f"{_DCP_TORCH}:TorchDistLoadShardedStrategy.load",
            "method",
            params=("self", "sharded_state_dict", "checkpoint_dir", "async_strategy"),
            uses=("_get_filesystem_reader(",),
        ),
        Spot(
            f"{_DCP_TORCH}:TorchDistLoadShardedStrategy.load_tensors_metadata",
            "method",
            params=("self", "checkpoint_dir", "metadata"),
        ),
        Spot(
            f"{_DCP_TORCH}:TorchDistLoadShardedStrategy.load_sharded_metadata",
            "method",
            params=("self", "checkpoint_dir"),
            uses=("_get_filesystem_reader(checkpoint_dir)",),
        ),
        Spot(
            f"{_DCP_SERIALIZATION}:load",
            params=("sharded_state_dict", "checkpoint_dir", "sharded_strategy"),
            uses=("load_common_state_dict(checkpoint_dir)", "sharded_strategy.load("),
        ),
        Spot(
            f"{_DCP_SERIALIZATION}:load_common_state_dict",
            params=("checkpoint_dir",),
            uses=(
                'ShardedObject("common_state", None, (1,), (0,)).unique_key',
                "storage_reader=_get_filesystem_reader(checkpoint_dir)",
                "load_common(checkpoint_dir)",
            ),
        ),
        Spot(f"{_DCP_SERIALIZATION}:save", uses=('key="common_state"',)),
        Spot(f"{_DCP_COMMON}:COMMON_STATE_FNAME", "value"),
        Spot(f"{_DCP_COMMON}:load_common", uses=('torch.load(load_path, map_location="cpu")',)),
        Spot(
            "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.load_bytes",
            "method",
            uses=("torch.load(value, weights_only=False)",),
        ),
        Spot(
            "torch.distributed.checkpoint.filesystem:FileSystemReader.read_metadata",
            "method",
            uses=("pickle.load(", "self.load_id"),
        ),
        Spot("torch.distributed.checkpoint.filesystem:FileSystemReader.read_data", "method", params=("self", "plan")),
    ),
    use="scoped: checkpoint_reads_swapped() during each load (checkpoint/safe_unpickle.py)",
)


@contextlib.contextmanager
def checkpoint_reads_swapped(
    make_reader: Callable[[Any], Any], load_common_state: Callable[[Any], Dict[str, Any]]
) -> Iterator[None]:
    """During the block, Megatron's torch_dist load strategy makes its checkpoint reader with
    ``make_reader(checkpoint_dir)`` instead of ``strategies.torch._get_filesystem_reader``, and
    ``dist_checkpointing.load`` reads the common state with ``load_common_state(checkpoint_dir)``
    instead of ``serialization.load_common_state_dict`` (swaps of those two module attributes, undone
    on exit; ``fix.checkpoint_reader``)."""
    check_targets([CHECKPOINT_READER])
    mtorch = importlib.import_module(_DCP_TORCH)
    mser = importlib.import_module(_DCP_SERIALIZATION)
    real_reader, real_common = mtorch._get_filesystem_reader, mser.load_common_state_dict
    mtorch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False, async_strategy="mcore": make_reader(
        checkpoint_dir
    )
    mser.load_common_state_dict = load_common_state
    try:
        yield
    finally:
        mtorch._get_filesystem_reader = real_reader
        mser.load_common_state_dict = real_common


# --------------------------------------------------------------------------------------------
# Helpers the model code calls (fix.global_memory_buffer, fix.clip_vit_norm)
# --------------------------------------------------------------------------------------------

GLOBAL_MEMORY_BUFFER = Patch(
    name="fix.global_memory_buffer",
    reason=FIX,
    spot=f"{_MC}.transformer.dot_product_attention: DotProductAttention.forward takes its score buffer from "
    "parallel_state.get_global_memory_buffer(), which only initialize_model_parallel creates",
    action="ensure_global_memory_buffer() creates it (parallel_state._set_global_memory_buffer) once per "
    "process for models built from explicit pg_collection groups",
    targets=MCORE_0_19,
    removal="remove when DotProductAttention allocates its buffer without Megatron's global parallel state",
    spots=(
        Spot(f"{_MC}.parallel_state:_set_global_memory_buffer", params=()),
        Spot(f"{_MC}.parallel_state:_GLOBAL_MEMORY_BUFFER", "value"),
        Spot(
            f"{_MC}.transformer.dot_product_attention:DotProductAttention.forward",
            "method",
            uses=("parallel_state.get_global_memory_buffer()",),
        ),
    ),
    use="helper: ensure_global_memory_buffer() before building models (training/trainer.py, ...)",
)


def ensure_global_memory_buffer() -> None:
    """Create Megatron's global memory buffer if ``initialize_model_parallel`` did not.

    ``DotProductAttention.forward`` (local spec) takes its score buffer from
    ``parallel_state.get_global_memory_buffer()``, which only ``initialize_model_parallel`` creates;
    a model built from explicit ``pg_collection`` groups needs this call once per process
    (``fix.global_memory_buffer``).
    """
    from megatron.core import parallel_state

    check_targets([GLOBAL_MEMORY_BUFFER])
    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()


CLIP_VIT_NORM = Patch(
    name="fix.clip_vit_norm",
    reason=FIX,
    spot=f"{_CLIP}: without TE the default ln_pre_impl/ln_post_impl is torch.nn.LayerNorm (NORM_IMPL), which "
    "build_module calls with config= and fails (upstream bug)",
    action="clip_vit_norm_kwargs() gives ln_pre_impl=ln_post_impl=WrappedTorchNorm when NORM_IMPL is "
    "torch.nn.LayerNorm (nothing with TE)",
    targets=MCORE_0_19,
    removal="remove when CLIPViTModel's default norm without TE accepts config= (e.g. WrappedTorchNorm)",
    spots=(
        Spot(f"{_CLIP}:NORM_IMPL", "value"),
        Spot(
            f"{_CLIP}:CLIPViTModel.__init__",
            "method",
            params=("self", "transformer_config", "transformer_layer_spec", "ln_pre_impl", "ln_post_impl"),
            uses=("config=transformer_config",),
        ),
        Spot(f"{_MC}.transformer.torch_norm:WrappedTorchNorm", "class"),
    ),
    use="helper: clip_vit_norm_kwargs() in CLIPViTModel(...) calls (models/clip_encoder.py)",
)


def clip_vit_norm_kwargs() -> Dict[str, Any]:
    """Keyword arguments for ``CLIPViTModel(...)`` when Transformer Engine is absent.

    Upstream bug (megatron/core/models/vision/clip_vit_model.py): without TE the default
    ``ln_pre_impl``/``ln_post_impl`` is ``torch.nn.LayerNorm``, which ``build_module`` calls with
    ``config=`` and fails. ``WrappedTorchNorm`` accepts that signature. With TE: no override
    (``fix.clip_vit_norm``).
    """
    from megatron.core.models.vision import clip_vit_model

    check_targets([CLIP_VIT_NORM])
    if clip_vit_model.NORM_IMPL is not torch.nn.LayerNorm:
        return {}
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {"ln_pre_impl": WrappedTorchNorm, "ln_post_impl": WrappedTorchNorm}


# --------------------------------------------------------------------------------------------
# fix.sgd_load_state (helper: checkpoint/sharded.py before a checkpoint load)
# --------------------------------------------------------------------------------------------

_OPT = f"{_MC}.optimizer"

SGD_LOAD_STATE = Patch(
    name="fix.sgd_load_state",
    reason=FIX,
    spot=f"{_OPT}: get_megatron_optimizer gives SGD init_state_fn=None, and FP32Optimizer / "
    "Float16OptimizerWithFloat16Params.sharded_state_dict(is_loading=True) call self.init_state_fn(...) "
    "(a checkpoint load of --optimizer sgd: TypeError 'NoneType' object is not callable)",
    action="materialize_sgd_state(optimizer) gives each such optimizer an init_state_fn that creates SGD's "
    "momentum buffers (zeros, where momentum != 0) for the load to fill, as Megatron's Adam one does the moments",
    targets=MCORE_0_19,
    removal="remove when get_megatron_optimizer gives SGD an init_state_fn (or sharded_state_dict skips a None one)",
    spots=(
        Spot(
            f"{_OPT}:_get_megatron_optimizer_based_on_param_groups",
            uses=('elif config.optimizer == "sgd":', "init_state_fn = None"),
        ),
        Spot(
            f"{_OPT}.optimizer:FP32Optimizer.sharded_state_dict",
            "method",
            uses=("self.init_state_fn(self.optimizer, self.config)",),
        ),
        Spot(
            f"{_OPT}.optimizer:Float16OptimizerWithFloat16Params.sharded_state_dict",
            "method",
            uses=("self.init_state_fn(self.optimizer, self.config)",),
        ),
    ),
    use="helper: materialize_sgd_state() before a checkpoint load (checkpoint/sharded.py)",
)


def _sgd_init_state(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """SGD's per-parameter state as its step creates it: a momentum buffer (zeros here, which a load then
    overwrites) for every parameter of a param group with momentum; none without momentum."""
    for group in opt.param_groups:
        if group.get("momentum", 0) == 0:
            continue
        for p in group["params"]:
            if opt.state[p].get("momentum_buffer") is None:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def materialize_sgd_state(optimizer: Any) -> None:
    """Give every Megatron optimizer around torch's SGD inside ``optimizer`` (chained or not) the
    ``init_state_fn`` Megatron leaves None (:data:`SGD_LOAD_STATE`), so that its
    ``sharded_state_dict(is_loading=True)`` describes the momentum buffers a checkpoint holds. Local: no
    collective; Adam's optimizers and the distributed optimizer are left as they are."""
    check_targets([SGD_LOAD_STATE])
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "init_state_fn", _sgd_init_state) is None and isinstance(
            getattr(opt, "optimizer", None), torch.optim.SGD
        ):
            opt.init_state_fn = _sgd_init_state


#: The fixes :func:`megatron_hetero.compat.apply_compat` gates on every machine (and applies, where an
#: entry has ``apply``; the others act where they are used).
FIXES: List[Patch] = [
    PARAM_GROUPS_GATHER,
    CHECKPOINT_READER,
    GLOBAL_MEMORY_BUFFER,
    CLIP_VIT_NORM,
    DISTOPT_FRESH_STATE,
    DISTOPT_LOAD_STEP,
    DISTOPT_RESHARDABLE_BUCKETS,
    SGD_LOAD_STATE,
    DATASETS_ON_EVERY_RANK,  # scoped, around a Megatron-LM script's dataset provider (fix_megatron_lm_data.py)
]


def apply_fixes() -> None:
    """Check :data:`FIXES`' targets, then apply those with ``apply`` (any device; idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    check_targets(FIXES)
    for patch in FIXES:
        if patch.apply is not None:
            patch.apply()
    _APPLIED = True


def fixes_applied() -> bool:
    """Whether :func:`apply_fixes` has run in this process."""
    return _APPLIED


# --------------------------------------------------------------------------------------------
# fix.clip_vit_default_norm (Megatron-LM's LLaVAModel; applied by the Megatron-LM launcher)
# --------------------------------------------------------------------------------------------


def _clip_vit_torch_norm() -> None:
    """``CLIPViTModel`` built by ``LLaVAModel`` gets no ``ln_pre_impl``/``ln_post_impl``: without TE
    the default ``torch.nn.LayerNorm`` is called with ``config=`` and fails. Default them to
    ``WrappedTorchNorm`` (:func:`clip_vit_norm_kwargs`)."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    if not clip_vit_norm_kwargs():
        return

    init = vars(CLIPViTModel)["__init__"]
    if getattr(init, _NORM_MARK, False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for k, v in clip_vit_norm_kwargs().items():
            kwargs.setdefault(k, v)
        return init(self, *args, **kwargs)

    # Its own marker: the CPU set's own wrapper of this __init__ (tensor.cuda() identity) may be
    # installed before or after this one, and both must stay.
    setattr(__init__, _NORM_MARK, True)
    CLIPViTModel.__init__ = __init__


NO_TE_PATCHES: List[Patch] = [
    Patch(
        name="fix.clip_vit_default_norm",
        reason=FIX,
        spot=f"{_CLIP}: CLIPViTModel.__init__ default ln_pre_impl/ln_post_impl = torch.nn.LayerNorm, called "
        "with config= (fails without TE; Megatron-LM's LLaVAModel passes no norm)",
        action="default both to WrappedTorchNorm (when TE is absent)",
        targets=MCORE_0_19,
        removal="remove with fix.clip_vit_norm (CLIPViTModel's default norm without TE accepts config=)",
        spots=CLIP_VIT_NORM.spots,
        apply=_clip_vit_torch_norm,
        use="applied once by apply_megatron_lm_no_te_fixes() (the Megatron-LM launcher, every machine)",
    ),
    MEGATRON_LM_DISTOPT_LOAD,  # --load torch_dist with --use-distributed-optimizer (fix_megatron_lm_ckpt.py)
]


def apply_megatron_lm_no_te_fixes() -> None:
    """The fixes every machine without Transformer Engine needs for Megatron-LM's VLM script
    (:data:`NO_TE_PATCHES`; targets checked first; idempotent)."""
    global _NO_TE_APPLIED
    if _NO_TE_APPLIED:
        return
    check_targets(NO_TE_PATCHES)
    for p in NO_TE_PATCHES:
        p.apply()
    _NO_TE_APPLIED = True
