"""The job a training run executes, described once (`JobConfig`): the model (`spec`, the model's
description `config.model.LlavaSpec`), the batch, the loop, the optimizer
(`config.optim.OptimConfig`) and the learning-rate schedule (`config.lr_schedule.LRSchedule`),
checkpoints, evaluation, logging, the data and the runtime's settings; and `LaunchFlags`, how
`train` starts the job's ranks. Their fields carry the defaults; those with a `train` flag carry its
name and help too (`layout.flags`), and `train`'s parser is generated from them (`cli.train`;
`train_flag_fields` lists them in --help order); `JobDraft`, a JobConfig on its layout as asked, and
`Job`, as validated once.
Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_hetero.layout.degrees import DEFAULT_COMM_TIMEOUT_S
from megatron_hetero.layout.flags import flag_field, flags_of
from megatron_hetero.layout.spec import HeteroLayout, Recompute
from megatron_hetero.config.model import MOE_FLAGS, LlavaSpec
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.config.autotune import AutotuneConfig
from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.config.lr_schedule import LRSchedule


@dataclass(frozen=True)
class JobConfig:
    """What a training job needs besides the layout (Megatron flag names), in sections: the model
    (`spec`), the batch, the loop, the optimizer (`optim`) and its schedule (`schedule`), the data
    (`data`), checkpoints, evaluation, logging, the runtime. The nested sections are dataclasses of
    their own; the fields of this one are grouped by their flags' `group` (the argument groups of
    `train --help`). A field without a flag is set by the code that builds the job."""

    # the model: its description (config.model; train: `cli.train_door.job_from_args` from the model,
    # architecture, MoE and data flags, or the model a checkpoint under --load records)
    spec: LlavaSpec = field(default_factory=LlavaSpec)
    # the batch (the shared model flags, `cli.model_flags`; None in the parser: not given)
    global_batch_size: int = flag_field(8, "samples per step (default {default})", group="batch", given=True)
    # train without --micro-batch-size: `training.job.default_micro_batch_size` (per layout)
    micro_batch_size: int = flag_field(
        1,
        "samples per micro-batch on a rank of the (first) language module (default: 1, or for disjoint layouts the "
        "smallest size whose micro-batches every module's DP divides)",
        group="batch",
        given=True,
    )
    # the loop and the optimizer (its learning-rate schedule: `schedule`)
    train_iters: int = flag_field(5, group="training")
    optim: OptimConfig = field(default_factory=OptimConfig)
    # activation recompute of every module's transformer layers (Megatron's flags; `recompute`); a
    # module's own `recompute:` in the layout file takes precedence
    recompute_granularity: Optional[str] = flag_field(
        None,
        "activation recompute of every module's transformer layers: full (whole layers) or selective "
        "(core attention); a module's `recompute:` in the layout file overrides it",
        group="training",
        choices=["full", "selective"],
    )
    recompute_method: Optional[str] = flag_field(
        None,
        "with full: uniform (chunks of --recompute-num-layers layers) or block (that many layers per stage)",
        group="training",
        choices=["uniform", "block"],
    )
    recompute_num_layers: Optional[int] = flag_field(None, "layers per recompute unit (full)", group="training")
    # Megatron's sequence parallelism on every language module with tp > 1 (the encoders and their
    # projectors, and output heads, keep it off, as Megatron-LM's LLaVA does): `models.llava`
    sequence_parallel: bool = flag_field(
        False,
        "sequence parallelism (Megatron's) in every language module with tp > 1: activations outside the TP "
        "regions sharded along the sequence over the module's TP group; ignored at tp 1",
        group="training",
    )
    # the runtime: its flags are the layout's (`layout.args.add_hetero_args`: --hetero-offload-encoder,
    # --hetero-comm-timeout), a Megatron-LM extra_args_provider
    offload_encoder: bool = False
    comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S
    hetero_schedule: str = "1f1b"  # --hetero-schedule: the disjoint schedule's tables (1f1b or zb)
    schedule: LRSchedule = field(default_factory=LRSchedule)
    # checkpoints (Megatron's flags): save every save_interval iterations and at the end into `save`;
    # resume from the latest checkpoint under `load`
    save: Optional[str] = flag_field(
        None, "save checkpoints here (and after the last iteration)", metavar="DIR", group="checkpoints"
    )
    save_interval: int = flag_field(0, "save every N iterations", metavar="N", group="checkpoints")
    load: Optional[str] = flag_field(
        None,
        "resume from the latest checkpoint under DIR (any layout of the same model), or start from converted "
        "weights (convert hf-to-checkpoint); without model flags: the recorded model",
        metavar="DIR",
        group="checkpoints",
    )
    # an incomplete/damaged newest save: resume from the one before (else exit 2)
    load_fallback: bool = flag_field(
        False,
        "if the newest save under --load is incomplete or damaged, resume from the newest complete checkpoint "
        "before it (and say so) instead of exiting 2",
        group="checkpoints",
    )
    # Megatron-LM's --finetune / --no-load-optim / --no-load-rng (`checkpoint.loadable`)
    finetune: bool = flag_field(
        False,
        "on --load, take the model weights only: start at iteration 0 with a fresh optimizer, learning-rate "
        "schedule, data position and RNG (any --global-batch-size, --train-iters, schedule, data, precision)",
        group="checkpoints",
    )
    no_load_optim: bool = flag_field(
        False,
        "on --load, do not restore the optimizer and its learning-rate scheduler (they start afresh; the fp32 "
        "main weights come from the loaded weights)",
        group="checkpoints",
    )
    no_load_rng: bool = flag_field(False, "on --load, do not restore the RNG states", group="checkpoints")
    # Megatron-LM's --pretrained-checkpoint: where a job starts when --load holds no checkpoint yet
    # (`cli.train_door.resolve_pretrained`), so a requeued fine-tuning job resumes its own saves
    pretrained_checkpoint: Optional[str] = flag_field(
        None,
        "when --load holds no checkpoint (or is not given): --finetune from this one (Megatron-LM's flag; a "
        "requeued job then resumes from its own --load)",
        metavar="DIR",
        group="checkpoints",
    )
    override_opt_param_scheduler: bool = flag_field(
        False,
        "on --load, use this job's learning-rate schedule instead of requiring the checkpoint's",
        group="training",
    )
    # iteration lines: every log_interval iterations on global rank 0 (0: none; train's flag: 1), and
    # a carriage-return progress line in between when `progress` (train: stdout is a terminal)
    log_interval: int = flag_field(0, "iteration lines every N iterations", cli=1, group="launch")
    progress: bool = False
    # real data, captions, conversations or speech (`CaptionDataConfig.kind`); None: the synthetic data.
    # train: from the data flags (config.data.DataRequest, models.job_data.job_data)
    data: Optional[CaptionDataConfig] = None
    # held-out evaluation every eval_interval iterations and after the last (0: none), over eval_iters
    # global batches (None: the whole held-out split once, without repeats; 1 on synthetic data)
    eval_interval: int = flag_field(
        0, "evaluate every N iterations and after the last one (default 0: never)", metavar="N", group="evaluation"
    )
    eval_iters: Optional[int] = flag_field(
        None,
        "global batches per evaluation (default: the held-out split once, N // global batch; synthetic data: 1)",
        metavar="K",
        group="evaluation",
    )
    # --exit-signal-handler (Megatron-LM's flag): SIGTERM stops every rank after the same step, saves
    # (with --save) and returns normally (training/signals.py)
    exit_signal_handler: bool = flag_field(
        False,
        "on SIGTERM (SLURM's warning before the time limit, scancel): every rank finishes the current step, "
        "saves a checkpoint (with --save) and exits 0 (Megatron-LM's flag)",
        group="checkpoints",
    )
    # TensorBoard and W&B (Megatron-LM's flags; `training/writers.py`): the last rank writes Megatron's
    # scalars every tensorboard_log_interval iterations; W&B offline unless WANDB_MODE says otherwise
    tensorboard_dir: Optional[str] = flag_field(
        None,
        "write TensorBoard scalars here (the last rank; needs the tensorboard package)",
        metavar="DIR",
        group="logging",
    )
    tensorboard_log_interval: int = flag_field(
        1, "write the TensorBoard / W&B scalars every N iterations (default {default})", metavar="N", group="logging"
    )
    log_validation_ppl_to_tensorboard: bool = flag_field(
        False, "also write the validation perplexity (lm loss validation ppl)", group="logging"
    )
    wandb_project: Optional[str] = flag_field(
        None,
        "log the same scalars to a W&B run of this project (the last rank; offline unless WANDB_MODE is set; "
        "needs the wandb package)",
        metavar="NAME",
        group="logging",
    )
    wandb_exp_name: Optional[str] = flag_field(None, "the W&B run's name", metavar="NAME", group="logging")
    wandb_save_dir: Optional[str] = flag_field(
        None, "where the W&B run is written (default: --save DIR/wandb)", metavar="DIR", group="logging"
    )
    # --log-throughput: TFLOP/s per rank by Megatron's formula, per module (`training/throughput.py`);
    # --log-memory: resident state and activation peaks per rank (`training/memory_log.py`)
    log_throughput: bool = flag_field(
        False,
        "TFLOP/s per rank (Megatron's formula, per module and for the whole model) in lines and records",
        group="logging",
    )
    log_memory: bool = flag_field(
        False,
        "per-rank resident state (params, grads, optimizer) and peak activation bytes, measured, in lines and records",
        group="logging",
    )
    # --trace FILE: every rank records its spans, global rank 0 writes the merged trace there (train:
    # the absolute path)
    trace: Optional[str] = flag_field(
        None,
        "write a Chrome/Perfetto trace of every rank's spans (view: ui.perfetto.dev, or megatron-hetero timeline "
        "FILE.json --out FILE.png)",
        metavar="FILE.json",
    )

    # --hetero-autotune: measure, re-plan and move to a faster layout (`training/autotune_run.py`);
    # None: the run keeps its layout
    autotune: Optional[AutotuneConfig] = None


@dataclass(frozen=True)
class LaunchFlags:
    """How `megatron-hetero train` starts the job's ranks and what it writes besides the lines."""

    nproc_per_node: Optional[int] = flag_field(
        None, "ranks to spawn on this machine (default: what the layout uses)", group="launch"
    )
    log_jsonl: Optional[str] = flag_field(None, "one JSON object per iteration", group="launch")
    launch_timeout: float = flag_field(3600.0, "seconds before hung ranks are killed", group="launch")


@dataclass(frozen=True)
class Job:
    """A training job as validated, once per process, by `training.setup.validate_job` (`train`'s
    maker; a patched Megatron-LM script's `--hetero-autotune` makes its own with its candidate check,
    `megatron_lm.autotune.candidate_check`): the layout, its `JobConfig`, and `checked`, what every
    rank plan of the layout and batch rests on (`plan.rank_plan.check_rank_plans`: the roles, the micro-batching, the disjoint tables),
    so that a rank builds its plan from it without computing it again (`plan.rank_plan.rank_plan`'s
    `checked`). What the train path carries instead of a (layout, config) pair: `train_rank`, the
    session, the checkpoints and the autotune switches take it. The forked ranks inherit it; nothing
    of it goes over a wire."""

    layout: HeteroLayout
    #: None for a patched Megatron-LM script without --hetero-autotune (Megatron's args are its job)
    config: Optional[JobConfig]
    checked: tuple = field(repr=False, compare=False)


@dataclass(frozen=True)
class JobDraft:
    """A job as asked, before validation: what a front end's door makes from its flags
    (`cli.train_door.job_from_args`) and what `training.setup.validate_job` turns into a `Job`; also
    an autotune candidate (a layout under the run's config, `training.autotune_checks.job_on`) before
    it is checked. The layout and its `JobConfig`, nothing checked yet; nothing of it goes over a wire."""

    layout: HeteroLayout
    config: JobConfig


def job_recompute(job: JobConfig) -> Optional[Recompute]:
    """The job's whole-model recompute (its --recompute-* flags), None without --recompute-granularity;
    ValueError for a method or layer count without a granularity (the values: `validate.check_recompute`)."""
    if job.recompute_granularity is None:
        if job.recompute_method is not None or job.recompute_num_layers is not None:
            raise ValueError("--recompute-method/--recompute-num-layers need --recompute-granularity full")
        return None
    return Recompute(job.recompute_granularity, job.recompute_method, job.recompute_num_layers)


# JobConfig's flags whose value a front end derives rather than takes as given: the batch (the
# micro-batch defaults to the layout's), the trace (made an absolute path)
DERIVED_JOB_FLAGS = ("global_batch_size", "micro_batch_size", "trace")


def plain_job_flags() -> list[dataclasses.Field]:
    """JobConfig's flags that take the value of their flag as it is: every field with a flag (the
    declaration says which) but `DERIVED_JOB_FLAGS`."""
    return [f for f in flags_of(JobConfig) if f.name not in DERIVED_JOB_FLAGS]


def train_flag_fields() -> list[dataclasses.Field]:
    """The fields of `train`'s own flags in --help order, after the shared model flags
    (`cli.model_flags`), the architecture's (`cli.arch_flags`) and the data's (`cli.data`), before the
    layout's (`layout.args`): the loop, the optimizer, the seed and the schedule; evaluation;
    checkpoints; mixture of experts; launch; logging; the trace; the autotune."""

    return (
        flags_of(JobConfig, ["train_iters"])
        + flags_of(
            OptimConfig,
            [
                "lr",
                "optimizer",
                "weight_decay",
                "clip_grad",
                "bf16",
                "fp16",
                "loss_scale",
                "initial_loss_scale",
                "min_loss_scale",
                "loss_scale_window",
                "hysteresis",
                "use_distributed_optimizer",
                "overlap_grad_reduce",
                "overlap_param_gather",
                "ddp_bucket_size",
                "adam_beta1",
                "adam_beta2",
                "adam_eps",
            ],
        )
        + flags_of(LlavaSpec, ["seed"])
        + flags_of(LRSchedule)
        + flags_of(
            JobConfig,
            [
                "override_opt_param_scheduler",
                "recompute_granularity",
                "recompute_method",
                "recompute_num_layers",
                "sequence_parallel",
                "eval_interval",
                "eval_iters",
                "save",
                "save_interval",
                "exit_signal_handler",
                "load",
                "load_fallback",
                "finetune",
                "no_load_optim",
                "no_load_rng",
                "pretrained_checkpoint",
            ],
        )
        + flags_of(LlavaSpec, MOE_FLAGS)
        + flags_of(LaunchFlags, ["nproc_per_node", "log_jsonl"])
        + flags_of(JobConfig, ["log_interval"])
        + flags_of(LaunchFlags, ["launch_timeout"])
        + flags_of(
            JobConfig,
            [
                "log_throughput",
                "log_memory",
                "tensorboard_dir",
                "tensorboard_log_interval",
                "log_validation_ppl_to_tensorboard",
                "wandb_project",
                "wandb_exp_name",
                "wandb_save_dir",
            ],
        )
        + flags_of(JobConfig, ["trace"])
        + flags_of(AutotuneConfig)
    )
