"""TensorBoard and Weights & Biases writers of the training loop (`training/loop.py` hands them each
iteration's record after its evaluation), with Megatron-LM's scalar names.

As in Megatron-LM (`megatron/training/global_vars.py`), only the last rank (global rank world - 1)
writes: `--tensorboard-dir DIR` opens torch's `SummaryWriter` there; `--wandb-project P
[--wandb-exp-name N] [--wandb-save-dir DIR]` opens a W&B run in DIR (default `--save`/wandb, as
Megatron), offline unless WANDB_MODE says otherwise (no network is ever needed). Every
`--tensorboard-log-interval` iterations (Megatron's default 1) they write what Megatron's
`training_log` writes, by its names:

    lm loss, learning-rate, batch-size, loss-scale (1.0 without --fp16, as Megatron), grad-norm,
    iteration-time (seconds, the slowest rank's), throughput (--log-throughput: TFLOP/s per rank),
    TensorBoard also `<name> vs samples` against the consumed samples, W&B `samples vs steps`;

and beside them the per-module figures: `grad-norm/<module>`, `throughput/<module>`,
`mem-state-bytes[/<module>]` (resident parameters, gradients and optimizer state: the largest rank's)
and with --log-memory `mem-activation-peak-bytes[/<module>]`. An evaluated iteration adds
`lm loss validation` (and `lm loss validation ppl` with --log-validation-ppl-to-tensorboard,
Megatron's exp(min(20, loss))) and `caption accuracy validation` on caption data (`answer accuracy
validation` on conversations), whatever the interval. `num-zeros` and `params-norm` are not measured, so not written.

`check_logging(job)` rejects (ValueError: exit 2) a flag whose package is missing or whose folder
cannot be made, before any rank starts. Importing this module imports neither torch nor the packages.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.training.iteration_log import memory_maxima

# Megatron's scalars that TensorBoard also gets `vs samples`
VS_SAMPLES = ("lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm", "lm loss validation")


def _need_package(name: str, flag: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(
            f"{flag} needs the `{name}` package, which is not installed ({exc}); install it with "
            f"`pip install {name}` or `pip install megatron-hetero[logging]`"
        ) from None


def _check_folder(path: str, flag: str) -> None:
    """`path` is a folder or can be made one: its nearest existing ancestor is a writable folder."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a directory, so the folder cannot be made")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {parent} is not writable")


def wandb_dir(job: Any) -> Optional[str]:
    """Where the W&B run goes: --wandb-save-dir, else `--save`/wandb (Megatron's default); None
    without --wandb-project."""
    if not job.wandb_project:
        return None
    return job.wandb_save_dir or (os.path.join(job.save, "wandb") if job.save else None)


def check_logging(job: Any) -> None:
    """ValueError for the writers' flags of `job` (a `config.job.JobConfig`) that cannot work."""
    if not isinstance(job.tensorboard_log_interval, int) or job.tensorboard_log_interval < 1:
        raise ValueError(f"--tensorboard-log-interval must be a positive integer, got {job.tensorboard_log_interval!r}")
    if job.log_validation_ppl_to_tensorboard and not job.tensorboard_dir:
        raise ValueError("--log-validation-ppl-to-tensorboard needs --tensorboard-dir DIR")
    if job.tensorboard_dir is not None:
        if not job.tensorboard_dir:
            raise ValueError("--tensorboard-dir needs a folder name")
        _need_package("tensorboard", "--tensorboard-dir")
        _check_folder(job.tensorboard_dir, "--tensorboard-dir")
    if not job.wandb_project:
        for flag, value in (("--wandb-exp-name", job.wandb_exp_name), ("--wandb-save-dir", job.wandb_save_dir)):
            if value is not None:
                raise ValueError(f"{flag} {value}: needs --wandb-project NAME")
        if job.wandb_project is not None:
            raise ValueError("--wandb-project needs a project name")
        return
    if job.wandb_exp_name == "":
        raise ValueError("--wandb-exp-name: please specify the wandb experiment name (empty)")  # Megatron's check
    folder = wandb_dir(job)
    if folder is None:
        raise ValueError("--wandb-project needs --wandb-save-dir DIR, or --save DIR (the run goes into DIR/wandb)")
    _need_package("wandb", "--wandb-project")
    _check_folder(folder, "--wandb-save-dir" if job.wandb_save_dir else "--save")


def train_scalars(rec: dict[str, Any], global_batch: int) -> dict[str, float]:
    """The training scalars of one record, by Megatron's names (see the module docstring)."""
    # an iteration without loss tokens has no loss to write (its record's is NaN)
    out: dict[str, float] = {} if rec.get("no_loss_tokens") else {"lm loss": float(rec["loss"])}
    if rec.get("lr") is not None:
        out["learning-rate"] = float(rec["lr"])
    out["batch-size"] = float(global_batch)
    out["loss-scale"] = float(rec["loss_scale"]) if rec.get("loss_scale") is not None else 1.0
    if rec.get("grad_norm") is not None:
        out["grad-norm"] = float(rec["grad_norm"])
        for m, v in (rec.get("grad_norm_per_module") or {}).items():
            out[f"grad-norm/{m}"] = float(v)
    if rec.get("iteration_time_s") is not None:
        out["iteration-time"] = float(rec["iteration_time_s"])
    if rec.get("tflops_per_rank") is not None:
        out["throughput"] = float(rec["tflops_per_rank"])
        for m, v in (rec.get("tflops_per_rank_per_module") or {}).items():
            out[f"throughput/{m}"] = float(v)
    peaks = memory_maxima(rec)
    if peaks["state"] is not None:
        out["mem-state-bytes"] = float(peaks["state"][0])
        for m, v in peaks["state_per_module"].items():
            out[f"mem-state-bytes/{m}"] = float(v)
    if peaks["activations"] is not None:
        out["mem-activation-peak-bytes"] = float(peaks["activations"][0])
        for m, v in peaks["activations_per_module"].items():
            out[f"mem-activation-peak-bytes/{m}"] = float(v)
    return out


def validation_scalars(rec: dict[str, Any], ppl: bool) -> dict[str, float]:
    """An evaluated record's `lm loss validation` (+ `ppl`, + the caption accuracy); {} otherwise."""
    if rec.get("eval_loss") is None:
        return {}
    loss = float(rec["eval_loss"])
    out = {"lm loss validation": loss}
    if ppl:
        out["lm loss validation ppl"] = math.exp(min(20.0, loss))  # Megatron's perplexity
    if rec.get("eval_accuracy") is not None:
        out[f"{rec.get('eval_accuracy_name', 'caption accuracy')} validation"] = float(rec["eval_accuracy"])
    return out


class LogWriters:
    """The last rank's TensorBoard and W&B writers (either may be absent); `write(rec)` after each
    iteration, `close()` at the end (flushes both)."""

    def __init__(self, job: Any, config: Optional[dict[str, Any]] = None) -> None:
        """Opens the writers `job` asks for (call on the writing rank only); `config`: what the W&B
        run records as its configuration (default: the job's fields)."""
        self.job = job
        self.tensorboard = None
        self.wandb_run = None
        if job.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=job.tensorboard_dir, max_queue=1000)  # Megatron's queue size
        if job.wandb_project:
            import wandb

            folder = wandb_dir(job)
            assert folder is not None  # check_logging
            os.makedirs(folder, exist_ok=True)
            self.wandb_run = wandb.init(
                dir=folder,
                name=job.wandb_exp_name,
                project=job.wandb_project,
                config=config if config is not None else job_config(job),
                mode=os.environ.get("WANDB_MODE", "offline"),
                settings=wandb.Settings(
                    console="off",  # the iteration lines stay the ranks' own
                    silent=True,
                    x_disable_stats=True,
                    x_disable_meta=True,
                    x_disable_machine_info=True,
                    x_save_requirements=False,
                ),
            )

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def write(self, rec: dict[str, Any]) -> None:
        """The scalars of iteration `rec["iteration"]` (the training ones every
        --tensorboard-log-interval iterations, the validation ones whenever evaluated)."""
        job, it = self.job, int(rec["iteration"])
        scalars = train_scalars(rec, job.global_batch_size) if it % job.tensorboard_log_interval == 0 else {}
        scalars.update(validation_scalars(rec, job.log_validation_ppl_to_tensorboard))
        if not scalars:
            return
        samples = int(rec.get("consumed_samples", it * job.global_batch_size))
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, it)
                if tag in VS_SAMPLES:
                    self.tensorboard.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb_run is not None:
            self.wandb_run.log({"samples vs steps": samples, **scalars}, step=it)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def job_config(job: Any) -> dict[str, Any]:
    """The job's fields (a dataclass's, or a namespace's such as Megatron's args) as plain JSON values:
    what a W&B run records as its config."""
    fields = dataclasses.asdict(job) if dataclasses.is_dataclass(job) else dict(vars(job))
    return json.loads(json.dumps(fields, default=str))


def open_writers(job: Any, rank: int, world_size: int) -> Optional[LogWriters]:
    """The writers on the last rank when the job asks for any; None elsewhere."""
    if rank != world_size - 1 or not (job.tensorboard_dir or job.wandb_project):
        return None
    return LogWriters(job)
