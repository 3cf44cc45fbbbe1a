"""`train`'s door: its flags, read once into typed objects, and the job built from them (a `JobDraft`).

Only this file (with `layout.args` for the layout) reads a namespace of train's parser (`dryrun`
takes the same flags); the floors below take what it reads:

- `model_flags(args)`: the size, MoE flags and --seed given (`config.model.ModelFlags`);
- `arch_flags(args)`: Megatron-LM's architecture flags (`config.arch.ArchFlags`);
- `data_request(args)`: the data flags and the model flags the data fills or checks
  (`config.data.DataRequest`);
- `batch_from_args(args, layout)`: (global batch, micro-batch), the layout's default micro-batch;
- `job_from_args(args, layout)`: the job as asked, a `config.job.JobDraft` of `layout` and the
  whole `config.job.JobConfig`: the model
  (`config.model.spec_from_flags`, the architecture, --load without model flags: the model the
  checkpoint records, `training.job.recorded_spec`; the data: `models.job_data.job_data`, captions
  or conversations), the batch, the optimizer (--bf16 and --fp16 also set the model's precision),
  the schedule, the layout's runtime flags (--hetero-offload-encoder, --hetero-comm-timeout,
  --hetero-schedule) and JobConfig's own (`config.job.plain_job_flags`).

Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Optional

from megatron_hetero.layout.flags import flags_of, given, value, values
from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.data import DataRequest, data_flag_fields
from megatron_hetero.config.model import LlavaSpec, ModelFlags, spec_from_flags
from megatron_hetero.config.arch import ArchFlags, apply_arch_flags
from megatron_hetero.config.job import JobConfig, plain_job_flags, JobDraft
from megatron_hetero.training.job import default_micro_batch_size, recorded_spec
from megatron_hetero.checkpoint.files import TRACKER
from megatron_hetero.config.optim import OptimConfig
from megatron_hetero.config.autotune import AutotuneConfig
from megatron_hetero.config.lr_schedule import LRSchedule


def model_flags(args: Any) -> ModelFlags:
    """The model flags given in `args` (a namespace of a parser with the shared model flags,
    `cli.model_flags`; the MoE flags and --seed where the parser has them)."""
    return ModelFlags.from_dests(vars(args))


def arch_flags(args: Any) -> ArchFlags:
    """Megatron-LM's architecture flags in `args` (`cli.arch_flags.add_arch_flags`); None: not given."""
    return ArchFlags(**values(ArchFlags, args))


def data_request(args: Any) -> DataRequest:
    """train's data flags in `args` (`config.data.data_flag_fields`; a flag not given: its
    field's default), --seed, and the model flags the data fills or checks (None: not given)."""
    data = {f.name: value(args, f) for f in data_flag_fields()}
    return DataRequest(
        **data,
        seed=int(args.seed),
        vocab_size=args.vocab_size,
        encoder_tokens=args.encoder_tokens,
        encoder_feature_dim=args.encoder_feature_dim,
        audio_model_type=getattr(args, "audio_model_type", None),
        seq_length_given=given(args, flags_of(LlavaSpec, ["seq_length"])[0]),
    )


def batch_from_args(args: Any, layout: HeteroLayout) -> tuple[int, int]:
    """(global batch size, micro-batch size) of the batch flags in `args` on `layout`: a flag not
    given takes JobConfig's default, the micro-batch size the layout's (`default_micro_batch_size`)."""
    gbs, mbs = flags_of(JobConfig, ("global_batch_size", "micro_batch_size"))
    g = value(args, gbs)
    return g, value(args, mbs) if given(args, mbs) else default_micro_batch_size(layout, g)


def resolve_pretrained(load: Optional[str], finetune: bool, pretrained: Optional[str]) -> tuple[Optional[str], bool]:
    """Megatron-LM's `--pretrained-checkpoint DIR`: (load, finetune). When `--load` is not given or
    holds no checkpoint yet (no `latest_checkpointed_iteration.txt`), the job starts from DIR with
    `--finetune` (the weights only); once `--load` holds a save of this job (a requeue), that one
    resumes."""
    if not pretrained:
        return load, finetune

    if load and (Path(load) / TRACKER).is_file():
        return load, finetune
    return pretrained, True


def job_from_args(args: argparse.Namespace, layout: HeteroLayout) -> JobDraft:
    """The job of `train`'s flags on `layout`, not validated yet (`training.setup.validate_job` does):
    `layout` and the `JobConfig` of the flags (see the module docstring). `args`: a namespace
    of train's parser (every flag it declares is there, with the default of the field that declares
    it: `cli.train`). `progress` stays False (the CLI sets it when stdout is a terminal). ValueError
    for invalid sizes."""
    from megatron_hetero.models.job_data import job_data

    load, finetune = resolve_pretrained(args.load, bool(args.finetune), getattr(args, "pretrained_checkpoint", None))
    global_batch_size, micro_batch_size = batch_from_args(args, layout)
    model, arch, data = model_flags(args), arch_flags(args), data_request(args)
    spec = spec_from_flags(model, layout)  # the sizes; then the seed and Megatron's MoE flags
    spec = dataclasses.replace(spec, seed=model.seed, **model.moe)
    spec = apply_arch_flags(arch, spec, model)  # Megatron-LM's architecture flags (RMSNorm, swiglu, rope, CLIP, ...)
    recorded = recorded_spec(spec, load, finetune, model, arch)  # --load without model flags: the recorded model
    if recorded is not spec:  # the data keeps the recorded vocabulary (a pretrained LM's) and sequence length
        data = dataclasses.replace(data, vocab_size=recorded.vocab_size, seq_length_given=True)
    spec = dataclasses.replace(recorded, transformer_impl=getattr(args, "transformer_impl", "local"))
    spec, data_config = job_data(data, spec, global_batch_size)  # (spec, None) without --data-path
    optim = OptimConfig(**values(OptimConfig, args))
    if optim.bf16 or optim.fp16:
        spec = dataclasses.replace(spec, bf16=optim.bf16, fp16=optim.fp16)
    job = {f.name: value(args, f) for f in plain_job_flags()}
    job.update(load=load, finetune=finetune)
    tune = AutotuneConfig(**values(AutotuneConfig, args)) if getattr(args, "hetero_autotune", False) else None
    config = JobConfig(
        spec=spec,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        optim=optim,
        schedule=LRSchedule(**values(LRSchedule, args)),
        offload_encoder=args.hetero_offload_encoder,
        comm_timeout_s=args.hetero_comm_timeout,
        hetero_schedule=getattr(args, "hetero_schedule", "1f1b"),
        data=data_config,
        trace=_trace_path(args.trace),
        autotune=tune,
        **job,
    )
    return JobDraft(layout, config)


def _trace_path(path: Optional[str]) -> Optional[str]:
    """`--trace FILE`: the absolute path (every rank writes into the same file's folder), its folder made."""
    if not path:
        return None
    p = Path(path).resolve()
    p.parent.mkdir(parents=True, exist_ok=True)
    return str(p)
