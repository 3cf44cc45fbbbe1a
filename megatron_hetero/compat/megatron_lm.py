"""Opt-in CPU redirections (reason :data:`~.table.CPU`) for Megatron-LM's *training* package (``megatron.training``, the tree a
user checks out, tag ``core_v0.19.0``), on top of the Megatron-core set in :mod:`.cpu`.

Nothing here is applied on import. :func:`apply_megatron_lm_cpu_compat` is called by
``megatron_hetero.megatron_lm.run`` (the launcher that runs a Megatron-LM script, patched or not)
only when no GPU is present; with CUDA it does nothing. It never copies Megatron-LM code: each
entry swaps the name ``torch`` inside one module for a CPU redirect, or wraps one function so that
a CUDA-only call inside it has a CPU meaning while that function runs. :data:`MEGATRON_LM_PATCHES`
lists every entry with its upstream spot (each was checked to be needed by running the scripts
on CPU; docs/compat.md lists them).

Requires the tree's ``megatron/training`` importable (the launcher appends the tree to the END of
``sys.path``, so the pip Megatron-core wins in the merged ``megatron`` namespace package, and binds
``megatron.training`` to the tree's package: ``megatron_lm.run.use_tree``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from typing import Any, List, Tuple

import torch

from ._patching import MARK, rebind_function, wrap_call
from .fixes import NO_TE_PATCHES, apply_megatron_lm_no_te_fixes
from .table import CPU, MCORE_0_19, Patch, Spot, check_targets
from .torch_on_cpu import _CudaOnCpu, _TorchOnCpu, _tensor_cuda_is_identity

__all__ = ["apply_megatron_lm_cpu_compat", "apply_megatron_lm_no_te_fixes", "MEGATRON_LM_PATCHES", "NO_TE_PATCHES"]

_APPLIED = False


class _NullStream:
    """``torch.cuda.Stream()`` / ``current_stream()`` on CPU: waits are no-ops."""

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CudaForTraining(_CudaOnCpu):
    """``torch.cuda`` inside ``megatron.training``: one "device" (so ``_initialize_distributed`` and
    ``_set_random_seed`` do not silently skip model-parallel initialisation and the tracker seeds),
    no-op device binding and streams, zero memory statistics."""

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> _NullStream:  # noqa: N802 - torch's name
        return _NullStream()

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    @staticmethod
    def stream(s: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def memory_stats(*args: Any, **kwargs: Any) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(*args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("memory_", "max_memory_")) or name == "device_memory_used":
            return lambda *a, **k: 0
        return super().__getattr__(name)


class _TorchForTraining(_TorchOnCpu):
    _FACTORIES = _TorchOnCpu._FACTORIES + ("rand", "randn", "empty_like", "zeros_like", "ones_like")

    def __init__(self) -> None:
        super().__init__()
        self.cuda = _CudaForTraining()


_TORCH_FOR_TRAINING = _TorchForTraining()


def _redirect_torch(module_name: str, redirect: types.ModuleType = _TORCH_FOR_TRAINING):
    def apply() -> None:
        module = importlib.import_module(module_name)
        if not hasattr(module.torch, MARK):
            module.torch = redirect

    return apply


def _triton_stub() -> None:
    """``batch_invariant_kernels`` imports triton at module level (reached from
    ``megatron.training.initialize``); without triton a stub module stands in (never called on CPU)."""
    try:
        import triton  # noqa: F401

        return
    except ImportError:
        pass
    # Libraries that probe for triton with `importlib.util.find_spec` at import time (transformers,
    # which Megatron's tokenizers import when it is installed) must see the truth first: with the stub
    # in sys.modules find_spec raises "triton.__spec__ is None".
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        with contextlib.suppress(Exception):
            importlib.import_module("transformers.utils.import_utils")

    class _Anything(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)

            def _decorator(*args: Any, **kwargs: Any) -> Any:
                if len(args) == 1 and callable(args[0]) and not kwargs:
                    return args[0]
                return _decorator

            return _decorator

    triton = _Anything("triton")
    lang = _Anything("triton.language")
    triton.language = lang
    setattr(triton, MARK, True)
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = lang


def _allow_no_cuda() -> None:
    def make(fn):
        @functools.wraps(fn)
        def initialize_megatron(*args, **kwargs):
            kwargs["allow_no_cuda"] = True
            return fn(*args, **kwargs)

        return initialize_megatron

    rebind_function(["megatron.training.initialize", "megatron.training.training"], "initialize_megatron", make)


def _device_arch_zero() -> None:
    rebind_function(
        ["megatron.training.utils.common_utils", "megatron.training.utils", "megatron.training.arguments"],
        "get_device_arch_version",
        lambda fn: lambda: 0,
    )


def _compile_helpers_prebuilt() -> None:
    def make(fn):
        @functools.wraps(fn)
        def compile_helpers():
            try:
                from megatron.core.datasets import helpers_cpp  # noqa: F401  (pip ships it prebuilt)

                return None
            except ImportError:
                return fn()

        return compile_helpers

    rebind_function(["megatron.core.datasets.utils"], "compile_helpers", make)


def _cuda_identity_in(module_name: str, attr: str):
    def apply() -> None:
        rebind_function([module_name], attr, lambda fn: wrap_call(fn, _tensor_cuda_is_identity))

    return apply


def _broadcast_data_on_cpu() -> None:
    _redirect_torch("megatron.core.tensor_parallel.data", _TorchOnCpu())()
    rebind_function(
        ["megatron.core.tensor_parallel.data"], "broadcast_data", lambda fn: wrap_call(fn, _tensor_cuda_is_identity)
    )
    # `tensor_parallel.broadcast_data` is re-exported by the package: rebind that name too.
    tp = importlib.import_module("megatron.core.tensor_parallel")
    data = importlib.import_module("megatron.core.tensor_parallel.data")
    tp.broadcast_data = data.broadcast_data


_TR = "megatron.training"
_MC = "megatron.core"


def _cpu(name: str, spot: str, action: str, removal: str, spots: Tuple[Spot, ...], apply) -> Patch:
    return Patch(
        name=name,
        reason=CPU,
        spot=spot,
        action=action,
        targets=MCORE_0_19,
        removal=removal,
        spots=spots,
        apply=apply,
        use="applied once by apply_megatron_lm_cpu_compat() (the Megatron-LM launcher, without CUDA)",
    )


#: Megatron-LM (tag core_v0.19.0, the tree matching megatron-core 0.19) spots redirected without
#: CUDA (reason CPU). Their targets are Megatron-core versions: the launcher runs the tree's
#: ``megatron.training`` against the pip Megatron-core, and the tree's tag is checked by
#: ``megatron_hetero.megatron_lm.tree``.
MEGATRON_LM_PATCHES: List[Patch] = [
    _cpu(
        "megatron_lm.triton_stub",
        "sys.modules['triton'] (megatron.core.transformer.custom_layers.batch_invariant_kernels imports triton "
        "at module level, reached from megatron.training.initialize)",
        "a stub module when triton is not installed",
        "remove when batch_invariant_kernels imports triton lazily (or only where triton is installed)",
        (Spot(f"{_MC}.transformer.custom_layers.batch_invariant_kernels", "source", uses=("import triton",)),),
        _triton_stub,
    ),
    _cpu(
        "megatron_lm.allow_no_cuda",
        f"{_TR}.initialize: initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda=True "
        "(pretrain() does not pass it)",
        "allow_no_cuda=True (rebound in initialize and training)",
        "remove when pretrain() initialises without CUDA (passes allow_no_cuda or drops the assert)",
        (
            Spot(
                f"{_TR}.initialize:initialize_megatron",
                params=("allow_no_cuda",),
                uses=('assert torch.cuda.is_available(), "Megatron requires CUDA."',),
            ),
            Spot(f"{_TR}.training:initialize_megatron"),
        ),
        _allow_no_cuda,
    ),
    _cpu(
        "megatron_lm.initialize",
        f"{_TR}.initialize: _initialize_distributed / _set_random_seed "
        "(torch.cuda.device_count() > 0 guards initialize_model_parallel and the tracker seeds; "
        "set_device, ones(device=current_device()))",
        "torch -> CPU redirect with one device",
        "remove when _initialize_distributed / _set_random_seed initialise model parallelism without a GPU",
        (Spot(f"{_TR}.initialize:torch", "torch", uses=("torch.cuda.device_count() > 0",)),),
        _redirect_torch(f"{_TR}.initialize"),
    ),
    _cpu(
        "megatron_lm.training",
        f"{_TR}.training: pretrain (cuda tensors), get_model (torch.cuda.Stream for DDP), "
        "train (synchronize, memory statistics)",
        "torch -> CPU redirect with one device",
        "remove when megatron.training.training takes its device and streams from the accelerator it runs on",
        (Spot(f"{_TR}.training:torch", "torch", uses=("torch.cuda.Stream()", 'device="cuda"')),),
        _redirect_torch(f"{_TR}.training"),
    ),
    _cpu(
        "megatron_lm.utils",
        f"{_TR}.utils.common_utils: report_memory, reduce_max_stat_across_model_parallel_group, "
        "logical_and_across_model_parallel_group (device=torch.cuda.current_device())",
        "torch -> CPU redirect with one device",
        "remove when megatron.training.utils allocates its statistics on the current device (CPU included)",
        (Spot(f"{_TR}.utils.common_utils:torch", "torch", uses=("torch.cuda.current_device()",)),),
        _redirect_torch(f"{_TR}.utils.common_utils"),
    ),
    _cpu(
        "megatron_lm.checkpointing",
        f"{_TR}.checkpointing: read_metadata (device='cuda'), get_rng_state "
        "(torch.cuda.get_rng_state), load_checkpoint (torch.cuda.set_rng_state) -- --save/--load",
        "torch -> CPU redirect with one device (the CUDA RNG state is the CPU generator's)",
        "remove when Megatron-LM's checkpointing saves the RNG state of the device it runs on",
        (Spot(f"{_TR}.checkpointing:torch", "torch", uses=('device="cuda"', "torch.cuda.get_rng_state()")),),
        _redirect_torch(f"{_TR}.checkpointing"),
    ),
    _cpu(
        "megatron_lm.timers",
        f"{_MC}.timers: _get_elapsed_time_all_ranks, Timer.start/stop (cuda tensors, synchronize)",
        "torch -> CPU redirect",
        "remove when Megatron-core's timers synchronise and gather on the current device (CPU included)",
        (Spot(f"{_MC}.timers:torch", "torch", uses=("torch.cuda.synchronize()", "torch.cuda.current_device()")),),
        _redirect_torch(f"{_MC}.timers"),
    ),
    _cpu(
        "megatron_lm.rerun_state_machine",
        f"{_MC}.rerun_state_machine: _save_state (torch.cuda.get_rng_state), validate_result (device='cuda')",
        "torch -> CPU redirect",
        "remove when the rerun state machine keeps the RNG state and flags of the device it runs on",
        (Spot(f"{_MC}.rerun_state_machine:torch", "torch", uses=("torch.cuda.get_rng_state()", 'device="cuda"')),),
        _redirect_torch(f"{_MC}.rerun_state_machine"),
    ),
    _cpu(
        "megatron_lm.device_arch",
        f"{_TR}.utils: get_device_arch_version (torch.cuda.get_device_properties; called from arguments.validate_args)",
        "returns 0 (rebound in utils and arguments)",
        "remove when validate_args asks the architecture only of a GPU",
        (
            Spot(
                f"{_TR}.utils.common_utils:get_device_arch_version",
                params=(),
                uses=("torch.cuda.get_device_properties",),
            ),
            Spot(f"{_TR}.utils:get_device_arch_version"),
            Spot(f"{_TR}.arguments:get_device_arch_version"),
        ),
        _device_arch_zero,
    ),
    _cpu(
        "megatron_lm.compile_helpers",
        f"{_MC}.datasets.utils: compile_helpers runs make (pip ships helpers_cpp prebuilt, without a Makefile)",
        "no-op when the prebuilt helpers_cpp imports",
        "remove when compile_helpers skips make where helpers_cpp is prebuilt",
        (Spot(f"{_MC}.datasets.utils:compile_helpers", params=(), uses=('command = ["make"',)),),
        _compile_helpers_prebuilt,
    ),
    _cpu(
        "megatron_lm.get_model_cuda",
        f"{_TR}.training: get_model (model_module.cuda(...))",
        "tensor.cuda() is the identity during the call",
        "remove when get_model moves the model to the current device only where it is a GPU",
        (
            Spot(
                f"{_TR}.training:get_model",
                params=("model_provider_func", "model_type", "wrap_with_ddp"),
                uses=("model_module.cuda(torch.cuda.current_device())",),
            ),
        ),
        _cuda_identity_in(f"{_TR}.training", "get_model"),
    ),
    _cpu(
        "megatron_lm.dist_utils",
        f"{_TR}.models.dist_utils: prepare_existing_model_chunks_for_distributed_training "
        "(model_module.cuda(torch.cuda.current_device())), _ddp_wrap (torch.cuda.Stream for DDP); "
        "the config-container model builder pretrain_gpt.py uses",
        "torch -> CPU redirect with one device",
        "remove when the model builders place the model and its DDP stream on the device they run on",
        (Spot(f"{_TR}.models.dist_utils:torch", "torch", uses=("torch.cuda.Stream()", "torch.cuda.current_device()")),),
        _redirect_torch(f"{_TR}.models.dist_utils"),
    ),
    _cpu(
        "megatron_lm.prepare_chunks_cuda",
        f"{_TR}.models.dist_utils: prepare_existing_model_chunks_for_distributed_training (model_module.cuda(...))",
        "tensor.cuda() is the identity during the call",
        "remove when the model builders move the model to the current device only where it is a GPU",
        (
            Spot(
                f"{_TR}.models.dist_utils:prepare_existing_model_chunks_for_distributed_training",
                params=("model_list", "transformer_config", "pg_collection"),
                uses=("model_module.cuda(torch.cuda.current_device())",),
            ),
        ),
        _cuda_identity_in(f"{_TR}.models.dist_utils", "prepare_existing_model_chunks_for_distributed_training"),
    ),
    _cpu(
        "megatron_lm.forward_step_cuda",
        f"{_MC}.pipeline_parallel.schedules: forward_step calls the script's forward_step_func, whose "
        "get_batch moves the batch with tensor.cuda() (pretrain_gpt.get_batch on TP rank 0)",
        "tensor.cuda() is the identity during the call",
        "remove when pretrain_gpt.get_batch moves the batch to the current device (CPU included)",
        (
            Spot(
                f"{_MC}.pipeline_parallel.schedules:forward_step",
                params=("forward_step_func", "data_iterator", "model"),
                uses=("forward_step_func(data_iterator, model",),
            ),
            Spot("pretrain_gpt", "source", uses=("batch[key].cuda(non_blocking=True)",)),
        ),
        _cuda_identity_in(f"{_MC}.pipeline_parallel.schedules", "forward_step"),
    ),
    _cpu(
        "megatron_lm.llava_sound_device",
        f"{_MC}.models.multimodal.llava_model: LLaVAModel.forward (an encoder without sound clips makes its "
        "empty sound embeddings on torch.cuda.current_device())",
        "torch -> CPU redirect",
        "remove when LLaVAModel.forward makes the empty sound embeddings on the images' device",
        (
            Spot(
                f"{_MC}.models.multimodal.llava_model:torch",
                "torch",
                uses=("device = torch.cuda.current_device()",),
            ),
        ),
        _redirect_torch(f"{_MC}.models.multimodal.llava_model", _TorchOnCpu()),
    ),
    _cpu(
        "megatron_lm.broadcast_data",
        f"{_MC}.tensor_parallel.data: broadcast_data (device='cuda', .cuda(); pretrain_vlm.get_batch)",
        "torch -> CPU redirect and tensor.cuda() identity during the call",
        "remove when broadcast_data allocates on the device of the TP group's backend",
        (
            Spot(f"{_MC}.tensor_parallel.data:torch", "torch", uses=("torch.cuda.current_device()",)),
            Spot(f"{_MC}.tensor_parallel.data:broadcast_data", params=("keys", "data", "datatype"), uses=(".cuda()",)),
            Spot(f"{_MC}.tensor_parallel:broadcast_data"),
        ),
        _broadcast_data_on_cpu,
    ),
]


def apply_megatron_lm_cpu_compat() -> None:
    """The no-TE fixes (:func:`.fixes.apply_megatron_lm_no_te_fixes`, every machine), then without CUDA
    Megatron-core's set (:func:`megatron_hetero.compat.apply_compat`: the CPU set plus the fixes) and
    :data:`MEGATRON_LM_PATCHES`; with CUDA only the former. Every set's targets are checked before
    it is applied. Idempotent."""
    global _APPLIED
    from .startup import import_megatron_core

    import_megatron_core()  # first: its fused kernels compile on first call, not at import
    apply_megatron_lm_no_te_fixes()
    if _APPLIED or torch.cuda.is_available():
        return
    from . import apply_compat

    check_targets(MEGATRON_LM_PATCHES)
    _triton_stub()  # before anything imports megatron.training
    apply_compat()
    for p in MEGATRON_LM_PATCHES:
        p.apply()
    _APPLIED = True
