"""A checkpoint's learning-rate scheduler state (`training.lr_schedule`): the schedule values it
recorded against this job's, and a scheduler continued at its step count. Pure: no torch."""

from __future__ import annotations


def schedule_mismatch(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between a checkpoint's schedule values and this job's."""
    flag = {
        "max_lr": "--lr",
        "min_lr": "--min-lr",
        "lr_warmup_steps": "--lr-warmup-iters",
        "lr_decay_steps": "--lr-decay-iters",
        "lr_decay_style": "--lr-decay-style",
    }
    keys = list(current)
    if current.get("lr_decay_style") == "constant" == saved.get("lr_decay_style"):
        keys = [k for k in keys if k not in ("lr_decay_steps", "min_lr")]  # no decay: they play no part
    return [
        f"{flag[k]} {saved.get(k)!r} in the checkpoint, {current[k]!r} now" for k in keys if saved.get(k) != current[k]
    ]


def restore_scheduler(scheduler, saved: dict) -> None:
    """Continue `scheduler` at a checkpoint's step count. Its values are this job's: the launcher
    checked they match the checkpoint's (`schedule_mismatch`) or --override-opt-param-scheduler
    was given (Megatron's override semantics)."""
    scheduler.num_steps = 0
    scheduler.step(increment=int(saved["num_steps"]))
