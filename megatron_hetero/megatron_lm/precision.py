"""Megatron's mixed precision (`--bf16`, `--fp16`) for the layout runs of Megatron-LM's scripts.

What the unpatched script does, and where the layout run does the same:

  * model: `core_transformer_config_from_args` sets `params_dtype` (and `pipeline_dtype`) to bf16 or
    fp16, so each module's part is built in that dtype (`build.module_config` derives from it), and
    `get_model` wraps the model in `Float16Module`, which casts every floating parameter and buffer
    (`module.bfloat16()` / `.half()`: :func:`to_model_dtype`), converts the float inputs of the first
    pipeline stage (the VLM's image) to that dtype and the last stage's output to fp32 (the
    runners' loss sums are taken in fp32);
  * optimizer: each module's Megatron optimizer with `bf16`/`fp16` (Megatron's mixed-precision
    optimizer: fp32 main weights copied from the module's half-precision parameters, which start as
    the reference model's, `weights.ReferenceSource`) and Megatron's loss-scale flags
    (:func:`optim_fields`); gradients accumulate and are reduced in fp32 where Megatron's
    `--accumulate-allreduce-grads-in-fp32` says so (always with --bf16, `validate_args`);
  * the loss scale: with --fp16 ONE scaler for the whole model on every rank
    (`runtime.loss_scale.LossScaler`: :func:`loss_scaler`), shared by every module optimizer of the
    rank, updated once per step with the non-finite flag agreed over the world
    (`runtime.optimizer_step`); a non-finite gradient anywhere skips the step on every module, the
    learning-rate schedule does not advance (Megatron's `train_step` steps it only after a successful
    update), and the log line counts it (`log.IntervalLog`);
  * checkpoints (`--save`/`--load`): the fp32 main weights, the moments keyed by them and (--fp16)
    the loss scale go through the reference optimizer (`checkpoints.py`, `weights.py`,
    :func:`restore_loss_scale`), as Megatron's own mixed-precision optimizer saves them.

Activations crossing module boundaries and between pipeline stages go over the wire in the module
dtype (2 bytes per element with bf16/fp16; `runner.py`, `gpt.py`). Nothing of this module itself
goes over the wire.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.runtime.loss_scale import LossScaler


def model_dtype(args: Any) -> torch.dtype:
    """The dtype of the model's parameters and activations (Megatron's `args.params_dtype`)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def optim_fields(args: Any) -> dict[str, Any]:
    """The `OptimConfig` fields of Megatron's precision and loss-scale flags (`--bf16`, `--fp16`,
    `--loss-scale`, `--initial-loss-scale`, `--min-loss-scale`, `--loss-scale-window`,
    `--hysteresis`, `--accumulate-allreduce-grads-in-fp32`) from Megatron's parsed arguments."""
    half = bool(args.bf16 or args.fp16)
    return dict(
        bf16=bool(args.bf16),
        fp16=bool(args.fp16),
        loss_scale=args.loss_scale if args.fp16 else None,
        initial_loss_scale=float(args.initial_loss_scale),
        min_loss_scale=float(args.min_loss_scale),
        loss_scale_window=float(args.loss_scale_window),
        hysteresis=int(args.hysteresis),
        # Megatron's DDP reduces in the parameters' dtype unless this is set (validate_args sets it for
        # bf16); fp32 parameters have fp32 gradients either way
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32) or not half,
    )


def loss_scaler(optim: OptimConfig):
    """This rank's one loss scaler for every module it serves (--fp16), or None."""

    return LossScaler(optim) if optim.fp16 else None


def restore_loss_scale(scaler, grad_scaler_state: Optional[dict]) -> None:
    """--fp16 with --load: set the rank's one loss scaler from the reference optimizer's grad scaler
    as Megatron's `load_checkpoint` left it (the checkpoint's `grad_scaler`: scale, growth and
    hysteresis trackers; `weights.ReferenceSource.grad_scaler`). Nothing without either."""
    if scaler is None or not grad_scaler_state:
        return
    sd = grad_scaler_state
    scale = sd.get("scale")
    rec = {
        "scale": float(scale.item()) if isinstance(scale, torch.Tensor) else scale,
        "growth_tracker": sd.get("growth_tracker"),
        "hysteresis_tracker": sd.get("hysteresis_tracker"),
    }
    scaler.restore(rec)  # a constant scaler (--loss-scale) keeps the flag's value


def to_model_dtype(model: torch.nn.Module, args: Any) -> torch.nn.Module:
    """`model` with every floating parameter and buffer in the model dtype, as `Float16Module` casts
    the module it wraps (`module.bfloat16()` / `module.half()`); unchanged in fp32."""
    dtype = model_dtype(args)
    return model if dtype == torch.float32 else model.to(dtype)
