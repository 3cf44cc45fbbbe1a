"""The learning-rate schedule section of a job (`LRSchedule`); what runs it: Megatron-core's
`OptimizerParamScheduler`, one per module optimizer (`training.lr_schedule.build_scheduler`).

Megatron's flags and semantics, counted in iterations (Megatron counts samples when it is given
iterations: `steps = iters * global_batch`; the ratios, and so the rates, are the same):
  --lr-warmup-iters W   linear warm-up from 0 to --lr over the first W iterations (iteration 1 runs
                        at lr 0 when W > 0, as in Megatron)
  --lr-decay-style S    constant | linear | cosine after the warm-up, down to --min-lr
  --lr-decay-iters D    iterations over which the rate decays (default: --train-iters)
Every module steps its own scheduler once per iteration after its optimizer step; all modules have
the same schedule, so they all run at the same rate. The scheduler's state is part of a checkpoint
(`checkpoint/scheduler_state.py` checks and restores it).
Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.flags import flag_field

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's learning-rate schedule flags (iterations; `train`'s flags are generated from the
    fields, `layout.flags`)."""

    lr_warmup_iters: int = flag_field(0, "linear warm-up from 0 to --lr over these iterations", group="training")
    lr_decay_style: str = flag_field("constant", group="training", choices=list(DECAY_STYLES))
    lr_decay_iters: Optional[int] = flag_field(
        None, "iterations to decay over (default: --train-iters)", group="training"
    )
    min_lr: float = flag_field(0.0, "the rate a decay ends at", group="training")

    def decay_iters(self, train_iters: int) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else train_iters

    def validate(self, lr: float, train_iters: int) -> None:
        """ValueError with the numbers for a schedule Megatron's scheduler would assert on."""
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {self.lr_decay_style!r}")
        if not isinstance(self.lr_warmup_iters, int) or self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters!r}")
        decay = self.decay_iters(train_iters)
        if not isinstance(decay, int) or decay < 1:
            raise ValueError(f"--lr-decay-iters must be >= 1, got {decay!r}")
        if self.lr_warmup_iters >= decay:
            raise ValueError(
                f"--lr-warmup-iters {self.lr_warmup_iters} must be smaller than the decay iterations "
                f"{decay} (--lr-decay-iters, default --train-iters)"
            )
        if not 0.0 <= self.min_lr <= lr:
            raise ValueError(f"--min-lr must satisfy 0 <= min-lr <= lr, got --min-lr {self.min_lr} --lr {lr}")

    def scheduler_config(self, lr: float, train_iters: int) -> dict:
        """The values a checkpoint records and a resumed job must match (Megatron's state-dict names)."""
        return {
            "max_lr": float(lr),
            "min_lr": float(self.min_lr),
            "lr_warmup_steps": self.lr_warmup_iters,
            "lr_decay_steps": self.decay_iters(train_iters),
            "lr_decay_style": self.lr_decay_style,
        }
