"""Opt-in CPU redirections for Megatron-LM's *training* package (``megatron.training``, the tree a
user checks out, tag ``core_v0.16.1``), on top of the Megatron-core set in :mod:`.cpu`.

Nothing here is applied on import. :func:`apply_megatron_lm_cpu_compat` is called by
``megatron_hetero.megatron_lm.run`` (the launcher that runs a Megatron-LM script, patched or not)
only when no GPU is present; with CUDA it does nothing. It never copies Megatron-LM code: each
entry swaps the name ``torch`` inside one module for a CPU redirect, or wraps one function so that
a CUDA-only call inside it has a CPU meaning while that function runs. :data:`MEGATRON_LM_PATCHES`
lists every entry with its upstream spot (each was checked to be needed by running the scripts
on CPU; docs/compat.md lists them).

Requires the tree's ``megatron/training`` importable (the launcher appends the tree to the END of
``sys.path``, so the pip Megatron-core wins in the merged ``megatron`` namespace package).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from typing import Any, List

import torch

from ._patching import MARK, Patch, rebind_function, wrap_call
from .cpu import apply_cpu_compat
from .torch_on_cpu import _CudaOnCpu, _TorchOnCpu, _tensor_cuda_is_identity

__all__ = ["apply_megatron_lm_cpu_compat", "apply_megatron_lm_no_te_fixes", "MEGATRON_LM_PATCHES",
           "NO_TE_PATCHES"]

_APPLIED = False
_NO_TE_APPLIED = False
_NORM_MARK = "__megatron_hetero_clip_vit_norm__"


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
    rebind_function(["megatron.training.utils", "megatron.training.arguments"], "get_device_arch_version",
                    lambda fn: (lambda: 0))


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


def _fused_kernels_noop() -> None:
    rebind_function(["megatron.legacy.fused_kernels"], "load", lambda fn: (lambda *a, **k: None))


def _cuda_identity_in(module_name: str, attr: str):
    def apply() -> None:
        rebind_function([module_name], attr, lambda fn: wrap_call(fn, _tensor_cuda_is_identity))

    return apply


def _broadcast_data_on_cpu() -> None:
    _redirect_torch("megatron.core.tensor_parallel.data", _TorchOnCpu())()
    rebind_function(["megatron.core.tensor_parallel.data"], "broadcast_data",
                    lambda fn: wrap_call(fn, _tensor_cuda_is_identity))
    # `tensor_parallel.broadcast_data` is re-exported by the package: rebind that name too.
    tp = importlib.import_module("megatron.core.tensor_parallel")
    data = importlib.import_module("megatron.core.tensor_parallel.data")
    tp.broadcast_data = data.broadcast_data


MEGATRON_LM_PATCHES: List[Patch] = [
    Patch("sys.modules['triton'] (megatron.core.transformer.custom_layers.batch_invariant_kernels "
          "imports triton at module level, reached from megatron.training.initialize)",
          "a stub module when triton is not installed", _triton_stub),
    Patch("megatron.training.initialize: initialize_megatron asserts torch.cuda.is_available() "
          "unless allow_no_cuda=True (pretrain() does not pass it)",
          "allow_no_cuda=True (rebound in initialize and training)", _allow_no_cuda),
    Patch("megatron.training.initialize: _initialize_distributed / _set_random_seed "
          "(torch.cuda.device_count() > 0 guards initialize_model_parallel and the tracker seeds; "
          "set_device, ones(device=current_device()))",
          "torch -> CPU redirect with one device", _redirect_torch("megatron.training.initialize")),
    Patch("megatron.training.training: pretrain (cuda tensors), get_model (torch.cuda.Stream for DDP), "
          "train (synchronize, memory statistics)",
          "torch -> CPU redirect with one device", _redirect_torch("megatron.training.training")),
    Patch("megatron.training.utils: get_batch_on_this_tp_rank, report_memory, "
          "reduce_max_stat_across_model_parallel_group (device=torch.cuda.current_device())",
          "torch -> CPU redirect with one device", _redirect_torch("megatron.training.utils")),
    Patch("megatron.training.checkpointing: read_metadata (device='cuda'), get_rng_state "
          "(torch.cuda.get_rng_state), load_checkpoint (torch.cuda.set_rng_state) -- --save/--load",
          "torch -> CPU redirect with one device (the CUDA RNG state is the CPU generator's)",
          _redirect_torch("megatron.training.checkpointing")),
    Patch("megatron.core.timers: _get_elapsed_time_all_ranks, Timer.start/stop (cuda tensors, synchronize)",
          "torch -> CPU redirect", _redirect_torch("megatron.core.timers")),
    Patch("megatron.core.rerun_state_machine: _save_state (torch.cuda.get_rng_state), "
          "validate_result (device='cuda')",
          "torch -> CPU redirect", _redirect_torch("megatron.core.rerun_state_machine")),
    Patch("megatron.training.utils: get_device_arch_version (torch.cuda.get_device_properties; "
          "called from arguments.validate_args)",
          "returns 0 (rebound in utils and arguments)", _device_arch_zero),
    Patch("megatron.core.datasets.utils: compile_helpers runs make (pip ships helpers_cpp prebuilt, "
          "without a Makefile)",
          "no-op when the prebuilt helpers_cpp imports", _compile_helpers_prebuilt),
    Patch("megatron.legacy.fused_kernels: load runs nvcc -V", "no-op", _fused_kernels_noop),
    Patch("megatron.training.training: get_model (model_module.cuda(...))",
          "tensor.cuda() is the identity during the call",
          _cuda_identity_in("megatron.training.training", "get_model")),
    Patch("megatron.training.training: evaluate (total_loss_dict tensors .cuda(); --eval-iters > 0)",
          "tensor.cuda() is the identity during the call",
          _cuda_identity_in("megatron.training.training", "evaluate")),
    Patch("megatron.training.utils: get_batch_on_this_tp_rank (tensor.cuda())",
          "tensor.cuda() is the identity during the call",
          _cuda_identity_in("megatron.training.utils", "get_batch_on_this_tp_rank")),
    Patch("megatron.core.tensor_parallel.data: broadcast_data (device='cuda', .cuda(); "
          "pretrain_vlm.get_batch)",
          "torch -> CPU redirect and tensor.cuda() identity during the call", _broadcast_data_on_cpu),
]


def _clip_vit_torch_norm() -> None:
    """``CLIPViTModel`` built by ``LLaVAModel`` gets no ``ln_pre_impl``/``ln_post_impl``: without TE
    the default ``torch.nn.LayerNorm`` is called with ``config=`` and fails. Default them to
    ``WrappedTorchNorm`` (``compat.specs.clip_vit_norm_kwargs``)."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    from .specs import clip_vit_norm_kwargs

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
    Patch("megatron.core.models.vision.clip_vit_model: CLIPViTModel.__init__ default "
          "ln_pre_impl/ln_post_impl = torch.nn.LayerNorm, called with config= (fails without TE; "
          "LLaVAModel passes no norm)",
          "default both to WrappedTorchNorm", _clip_vit_torch_norm),
]


def apply_megatron_lm_no_te_fixes() -> None:
    """The fixes every machine without Transformer Engine needs for Megatron-LM's VLM script."""
    global _NO_TE_APPLIED
    if _NO_TE_APPLIED:
        return
    for p in NO_TE_PATCHES:
        p.apply()
    _NO_TE_APPLIED = True


def apply_megatron_lm_cpu_compat() -> None:
    """Megatron-core's CPU set (:func:`.cpu.apply_cpu_compat`, plus the pg_collection fixes), then
    :data:`MEGATRON_LM_PATCHES`; a no-op where CUDA is available. Idempotent."""
    global _APPLIED
    apply_megatron_lm_no_te_fixes()
    if _APPLIED or torch.cuda.is_available():
        return
    from . import apply_compat

    _triton_stub()  # before anything imports megatron.training
    apply_compat()
    for p in MEGATRON_LM_PATCHES:
        p.apply()
    _APPLIED = True
