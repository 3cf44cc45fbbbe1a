"""The one loss scale of the whole model under `--fp16` (Megatron's dynamic loss scaler).

A homogeneous Megatron fp16 run has one optimizer and so one grad scaler: the schedule multiplies the
loss by its scale (`config.grad_scale_func = optimizer.scale_loss`), the optimizer unscales the main
gradients, and the scaler halves the scale after `--hysteresis` steps with non-finite gradients
(skipping them) and doubles it after `--loss-scale-window` clean steps. Here every module has its
own Megatron optimizer, which would each hold their own scaler and update it from their own module's
found-inf. Instead every rank holds ONE :class:`LossScaler` (a Megatron `DynamicGradScaler`, or a
`ConstantGradScaler` with `--loss-scale`), shared by every module optimizer on the rank and held by
ranks without one too (a frozen module's island still computes the scaled loss):

- the optimizers unscale their main gradients by its inverse scale, but their own update of it inside
  `prepare_grads` is a no-op;
- `runtime.optimizer_step.step_modules` updates it once per step with the non-finite flag agreed over
  the world (the same on every rank), so every rank's scaler goes through the same states and holds
  the same scale;
- the schedules multiply the loss by `value()` before their backward.

Nothing of it goes over the wire (the agreed flag comes from step_modules' all-reduce). A checkpoint
records it in `train_state.json` (`record()` / `restore()`: plain numbers).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_hetero.config.optim import OptimConfig


class LossScaler:
    """This rank's loss scaler for the whole model (see the module docstring). Duck-types what
    Megatron's mixed-precision optimizers call on their `grad_scaler` (`scale`, `inv_scale`, `update`,
    `state_dict`, `load_state_dict`)."""

    def __init__(self, optim: OptimConfig) -> None:
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

        if not optim.fp16:
            raise ValueError("a loss scaler is for --fp16 only")
        self.dynamic = optim.loss_scale is None
        if self.dynamic:
            self._inner: Any = DynamicGradScaler(
                initial_scale=optim.initial_loss_scale,
                min_scale=optim.min_loss_scale,
                growth_factor=2.0,  # Megatron's (not a flag there either)
                backoff_factor=0.5,
                growth_interval=optim.loss_scale_window,
                hysteresis=optim.hysteresis,
            )
        else:
            self._inner = ConstantGradScaler(optim.loss_scale)

    # -- what the Megatron optimizers use ---------------------------------------------------------
    @property
    def scale(self) -> torch.Tensor:
        return self._inner.scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._inner.inv_scale

    def update(self, found_inf: bool) -> None:
        """A module optimizer's own update (inside its `prepare_grads`, from its module's flag alone):
        ignored; :meth:`agree` updates the scale once per step with the world's flag."""

    def state_dict(self) -> dict:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """A module optimizer's checkpoint load: ignored (the rank's scaler is restored once, from the
        train state: :meth:`restore`)."""

    # -- the whole model's ------------------------------------------------------------------------
    def agree(self, found_inf: bool) -> None:
        """The step's update, with the non-finite flag agreed over the world."""
        self._inner.update(found_inf)

    def value(self) -> float:
        """The scale the next backward multiplies the loss by."""
        return float(self._inner.scale.item())

    def record(self) -> dict:
        """The scaler's state as plain numbers (the checkpoint's `loss_scaler`)."""
        sd = self._inner.state_dict()
        out: dict = {"scale": float(sd["scale"].item())}
        if self.dynamic:
            out["growth_tracker"] = int(sd["growth_tracker"])
            out["hysteresis_tracker"] = int(sd["hysteresis_tracker"])
        return out

    def restore(self, rec: dict) -> None:
        """Set the scaler from :meth:`record`'s numbers (ValueError if they are not numbers). A constant
        scaler keeps this job's --loss-scale."""
        if not self.dynamic:
            return
        try:
            scale = float(rec["scale"])
            growth, hysteresis = int(rec["growth_tracker"]), int(rec["hysteresis_tracker"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint loss_scaler {rec!r} is not a loss scaler's state ({exc})") from exc
        if not scale > 0:
            raise ValueError(f"checkpoint loss_scaler: scale {scale} is not positive")
        self._inner.load_state_dict(
            {
                "scale": torch.tensor([scale], dtype=torch.float),
                "growth_tracker": growth,
                "hysteresis_tracker": hysteresis,
            }
        )


def rank_loss_scaler(states: dict) -> Optional[LossScaler]:
    """The loss scaler the ModuleStates of this rank share (None without --fp16, and for states that
    carry none: `convert` and its tests load checkpoints into plain module holders)."""
    held = [getattr(s, "loss_scaler", None) for s in states.values()]
    scalers = {id(sc): sc for sc in held if sc is not None}
    assert len(scalers) <= 1, "the modules of one rank hold different loss scalers"
    return next(iter(scalers.values()), None)


def loss_scale_of(states: dict) -> float:
    """The factor the next backward multiplies the loss by: the rank's loss scale, 1.0 without --fp16
    (multiplying by 1.0 is exact: fp32 and bf16 runs are bitwise unchanged)."""
    scaler = rank_loss_scaler(states)
    return scaler.value() if scaler is not None else 1.0
