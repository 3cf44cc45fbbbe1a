"""`pretrain_vlm.py --hetero-* --hetero-autotune`: the patched script measures itself, re-plans and
moves to a faster layout in the same processes, as `megatron-hetero train --hetero-autotune` does
(`training/autotune_run.py` runs the rounds for both; docs/autotune.md).

What is the script's own here:
  * the flags (`add_autotune_args`: train's `--hetero-autotune`/`--autotune-*`, the same names and
    defaults) and their checks before any process group exists (`check_script_autotune`: VLM only,
    `--save` needed, the settings, the cost model's view of the model);
  * the model the cost model prices (`cost_spec`: Megatron's LLaVA of `pretrain_vlm.py` from
    Megatron's arguments: the language model's sizes, the CLIP ViT encoder of `--encoder-num-layers`
    layers at the language model's width, its image tokens) and the job it prices (`cost_job`);
  * which candidate layouts the script can train (`candidate_check`: the script's and the driver's
    checks, the batch arithmetic, the vocabulary over TP; the degrees the script's model cannot
    change, vision PP 1 and CP 1 everywhere, are pinned in the search: `script_fixes`);
  * the session: `session.script_session` (Megatron's reference model, the layout's modules, schedule and
    log lines); a switch writes Megatron's own checkpoint of the reference model into `--save`
    (`save_checkpoint`) and the next session reads it back with Megatron's `load_checkpoint`
    (`--load` set to `--save`), as a run restarted on the new layout would.

The decision lines (`autotune: ...`) are printed by global rank 0, Megatron's log lines by the last
rank; `autotune.json` and `autotune-layout.yaml` go into `--save` next to Megatron's `iter_*` folders.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.autotune import AutotuneConfig, parse_fix
from megatron_hetero.config.job import Job, JobConfig, JobDraft
from megatron_hetero.layout.flags import add_flags, flags_of, values
from megatron_hetero.megatron_lm.build import num_image_embeddings
from megatron_hetero.megatron_lm.checks import check_common, decoder_layers
from megatron_hetero.megatron_lm.log import print_last
from megatron_hetero.plan.rank_plan import check_rank_plans
from megatron_hetero.config.model import EncoderSpec, LlavaSpec
from megatron_hetero.training.autotune_checks import check_autotune
from megatron_hetero.training.autotune_run import train_autotuned
from megatron_hetero.training.signals import ExitSignal

#: the degrees Megatron's LLaVA in `pretrain_vlm.py` keeps with a layout (`vlm.check_vlm`)
VLM_FIXES = {"vision": {"pp": 1, "cp": 1}, "language": {"cp": 1}}


def add_autotune_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """train's `--hetero-autotune` and `--autotune-*` flags (`AutotuneConfig`) on Megatron's parser."""

    add_flags(parser, flags_of(AutotuneConfig), {"autotune": "megatron-hetero auto-layout (--hetero-autotune)"})
    return parser


def autotune_config(args: Any) -> Optional[AutotuneConfig]:
    """The run's `AutotuneConfig`, or None without --hetero-autotune."""

    if not getattr(args, "hetero_autotune", False):
        return None
    return AutotuneConfig(**values(AutotuneConfig, args))


def script_fixes(tune: AutotuneConfig) -> str:
    """`--autotune-fix` with the degrees the script's model keeps (`VLM_FIXES`) added where the user
    pinned none of their own."""

    given = parse_fix(tune.autotune_fix)
    items = [] if not tune.autotune_fix else [tune.autotune_fix]
    for module, fields in VLM_FIXES.items():
        for field, n in fields.items():
            if field not in given.get(module, {}):
                items.append(f"{module}.{field}={n}")
    return ",".join(items)


def cost_spec(args: Any):
    """The cost model's `LlavaSpec` of `pretrain_vlm.py`'s model from Megatron's arguments (before or
    after `build.vlm_sizes` rewrote the sequence lengths)."""

    n_img = num_image_embeddings(args)
    text = args.dataloader_seq_length if getattr(args, "dataloader_seq_length", None) is not None else args.seq_length
    encoder = EncoderSpec(
        num_layers=args.encoder_num_layers,
        hidden_size=args.hidden_size,  # pretrain_vlm.py's ViT config is the language model's, deep-copied
        num_attention_heads=args.num_attention_heads,
        tokens=n_img,
        feature_dim=3 * args.patch_dim**2,
        kind="clip",
        patch_size=args.patch_dim,
        ffn_hidden_size=args.ffn_hidden_size,
    )
    return LlavaSpec(
        num_layers=decoder_layers(args),
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=getattr(args, "padded_vocab_size", None) or args.vocab_size,
        seq_length=text + n_img,
        encoders={"vision": encoder},
        bf16=bool(args.bf16),
        fp16=bool(args.fp16),
        swiglu=bool(args.swiglu),
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
    )


def cost_job(args: Any, tune: AutotuneConfig):
    """The `JobConfig` the rounds price and move (`training/autotune_run.py`): the model
    (`cost_spec`), the batch, the loop, --save and the autotune settings with `script_fixes`."""
    import dataclasses

    return JobConfig(
        spec=cost_spec(args),
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        train_iters=args.train_iters,
        save=args.save,
        save_interval=args.save_interval or 0,
        offload_encoder=bool(args.hetero_offload_encoder),
        comm_timeout_s=args.hetero_comm_timeout,
        autotune=dataclasses.replace(tune, autotune_fix=script_fixes(tune)),
    )


def check_script_autotune(script: str, args: Any, layout: HeteroLayout) -> None:
    """ValueError (before any process group exists) for a run `--hetero-autotune` cannot tune: a script
    other than pretrain_vlm.py (the cost model prices an encoder and a language model), no --save,
    or what `training.autotune_checks.check_autotune` refuses (the settings, the model)."""

    tune = autotune_config(args)
    if tune is None:
        return
    if script != "pretrain_vlm.py":
        raise ValueError(
            f"--hetero-autotune is not supported with {script}: the cost model prices one encoder and a "
            "language model (pretrain_vlm.py, or megatron-hetero train)"
        )
    try:
        script_fixes(tune)
    except ValueError as exc:
        raise ValueError(f"--hetero-autotune: {exc}") from None
    check_autotune(JobDraft(layout, cost_job(args, tune)))


def candidate_check(model, args: Any) -> Callable:
    """`check(draft)` for the rounds' candidates and the layouts the run moves to: the
    `config.job.Job` of the `JobDraft` (a layout under the run's `JobConfig`), ValueError for a
    layout the script cannot train (its own checks and the driver's, the batch arithmetic of the
    config's micro-batch, the padded vocabulary over each module's TP)."""

    def check(draft: JobDraft) -> Job:
        layout, config = draft.layout, draft.config
        model.check(args, layout)
        check_common(args, layout)
        checked = check_rank_plans(layout, config.global_batch_size, config.micro_batch_size, config.offload_encoder)
        vocab = getattr(args, "padded_vocab_size", None)
        for m in layout.modules:
            if vocab and vocab % m.tp:
                raise ValueError(f"module {m.name}: padded vocabulary {vocab} is not divisible by tp({m.tp})")
        return Job(layout, config, checked)

    return check


class _RankZeroLog:
    """Where the rounds' lines go: global rank 0's stdout (`write` is None on the other ranks)."""

    def __init__(self) -> None:
        self.write = self._write if dist.get_rank() == 0 else None

    @staticmethod
    def _write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def train_autotuned_script(
    model, args: Any, layout: HeteroLayout, datasets_provider: Callable, model_provider: Callable
) -> None:
    """The script's run from `layout` with --hetero-autotune (module docstring). Collective."""
    from megatron_hetero.megatron_lm.session import PREFIX, reference_session_args, script_session

    tune = autotune_config(args)
    assert tune is not None
    job = cost_job(args, tune)

    lines: list = []  # the first session's IntervalLog: the lines of one run across the switches

    def make_session(run: Job, log, step_hook, tracer=None):
        j = run.config
        if j.load:  # a switch or a revert: the whole run from Megatron's checkpoint in --save
            reference_session_args(args, j.load)
        args.micro_batch_size = j.micro_batch_size  # samples per micro-batch on the first language module's ranks
        s = script_session(model, args, run, datasets_provider, model_provider, tracer=tracer)
        if lines:  # Megatron's log lines go on as one run's (no first-line averaging after a switch)
            s.front.interval_log = lines[0]
        else:
            lines.append(s.front.interval_log)
        if s.start < args.train_iters:
            s.announce()
        return s

    stop = ExitSignal(getattr(args, "exit_signal_handler", False)).install()
    session = None
    try:
        check = candidate_check(model, args)
        session, _ = train_autotuned(
            check(JobDraft(layout, job)), _RankZeroLog(), stop, None, make_session, check=check
        )
        if session.start >= args.train_iters:
            print_last(
                f"{PREFIX}: checkpoint iteration {session.start} >= --train-iters {args.train_iters}: nothing to do"
            )
            return
        session.finish()
    finally:
        stop.restore()
        if session is not None:
            session.destroy()
