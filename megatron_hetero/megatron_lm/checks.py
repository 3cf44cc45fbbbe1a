"""What a patched Megatron-LM script refuses with a layout, and the uneven pipeline split it takes
(pure on Megatron's parsed arguments: before any process group or model exists). Each check raises
ValueError naming the flag or the module; `driver.parse_and_validate` runs them on every rank and
`megatron_lm/autotune.py` runs them on each candidate layout of --hetero-autotune.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.layout.validate import check_heads
from megatron_hetero.plan.schedule import check_schedule_choice
from megatron_hetero.config.optim import check_optimizer_flags
from megatron_hetero.plan.roles import language_modules

#: Megatron flags no layout supports yet (attribute -> flag).
REFUSED = {
    "virtual_pipeline_model_parallel_size": "--num-layers-per-virtual-pipeline-stage",
    "decoder_tp_comm_overlap": "--decoder-tp-comm-overlap",
    "use_legacy_models": "--use-legacy-models",
    "mtp_num_layers": "--mtp-num-layers",
}

#: Megatron's other pipeline-layout flags (attribute -> (flag, why a layout refuses it)); the uneven
#: split of `--decoder-first/last-pipeline-num-layers` is supported (`check_uneven_pipeline`)
PIPELINE_REFUSED = {
    "num_layers_per_virtual_pipeline_stage": (
        "--num-layers-per-virtual-pipeline-stage",
        "virtual (interleaved) pipeline stages: each module's pipeline stage holds one model chunk (the "
        "layout's schedules are 1F1B without interleaving)",
    ),
    "num_virtual_stages_per_pipeline_rank": (
        "--num-virtual-stages-per-pipeline-rank",
        "virtual (interleaved) pipeline stages: each module's pipeline stage holds one model chunk (the "
        "layout's schedules are 1F1B without interleaving)",
    ),
    "pipeline_model_parallel_layout": (
        "--pipeline-model-parallel-layout",
        "it lays out Megatron's own pipeline, which stays PP 1 with a layout; split the language module's "
        "own pipeline with --decoder-first/last-pipeline-num-layers, or cut GPT segments with `layers:`",
    ),
    "account_for_embedding_in_pipeline_split": (
        "--account-for-embedding-in-pipeline-split",
        "the embedding counted as a layer of Megatron's own pipeline split (PP 1 with a layout); use "
        "--decoder-first-pipeline-num-layers on the language module's own pipeline",
    ),
    "account_for_loss_in_pipeline_split": (
        "--account-for-loss-in-pipeline-split",
        "the loss counted as a layer of Megatron's own pipeline split (PP 1 with a layout); use "
        "--decoder-last-pipeline-num-layers on the language module's own pipeline",
    ),
}


#: the --ckpt-format values --load/--save take with a layout
CKPT_FORMATS = ("torch", "torch_dist")

#: Megatron's uneven pipeline split (attribute -> flag): with a layout, the language module's own
#: pipeline (Megatron's --pipeline-model-parallel-size stays 1, the reference layout's)
UNEVEN_PP = {
    "decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
    "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
}


def uneven_pp_flags(args: Any) -> dict[str, int]:
    """The uneven pipeline flags given ({flag: layers}); the driver moves them off Megatron's
    arguments to `hetero_<attribute>` before the reference model is built (`pretrain_with_layout`)."""
    out = {}
    for attr, flag in UNEVEN_PP.items():
        value = getattr(args, attr, None)
        if value is None:
            value = getattr(args, "hetero_" + attr, None)
        if value is not None:
            out[flag] = value
    return out


def decoder_layers(args: Any) -> int:
    """The language model's decoder layers (`--decoder-num-layers`, else `--num-layers`)."""
    return args.decoder_num_layers if getattr(args, "decoder_num_layers", None) is not None else args.num_layers


def pipeline_split(num_layers: int, pp: int, first: Optional[int], last: Optional[int], who: str) -> list[int]:
    """Layers per pipeline stage of a module with `pp` stages and `num_layers` layers, as Megatron
    splits them (`TransformerConfig.num_layers_in_first_pipeline_stage` / `..._last_...`,
    `get_num_layers_to_build`): `first` layers on stage 0 and `last` on stage pp-1 where given, the
    rest evenly over the other (middle) stages. ValueError naming the flags, with the arithmetic."""
    flags = " ".join(
        f"{f} {v}"
        for f, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last))
        if v is not None
    )
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"{who}: {num_layers} layers do not split over pp({pp})")
        return [num_layers // pp] * pp
    if pp < 2:
        raise ValueError(
            f"{flags}: {who} has pp({pp}); the flags split its own pipeline, which needs pp > 1 (e.g. pp=2 "
            f"on the module; Megatron's --pipeline-model-parallel-size stays 1 with a layout)"
        )
    for flag, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} {v}: a pipeline stage needs at least 1 layer")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle == 0 and rest) or (middle and rest < middle):
        raise ValueError(
            f"{flags}: {who} has {num_layers} layers over pp({pp}): {rest} layers are left for its "
            f"{middle} other stage(s)" + (", which must get at least 1 each" if middle else ", which must be 0")
        )
    if middle and rest % middle:
        raise ValueError(
            f"{flags}: {who} has {num_layers} layers over pp({pp}): the remaining {rest} layers do not "
            f"split evenly over its {middle} middle stage(s) ({rest} % {middle} = {rest % middle})"
        )
    even = rest // middle if middle else 0
    return ([first] if first is not None else []) + [even] * middle + ([last] if last is not None else [])


def check_uneven_pipeline(args: Any, layout: HeteroLayout) -> Optional[tuple[str, list[int]]]:
    """--decoder-first/last-pipeline-num-layers with a layout: they split the one language module's
    own pipeline (`pipeline_split`); refused with GPT segments, whose `layers:` already say which
    layers each segment's pipeline holds (each segment splits its own evenly). Returns (module,
    layers per stage) when the flags are given, else None; ValueError naming the flag."""

    given = uneven_pp_flags(args)
    if not given:
        return None
    flags = " ".join(f"{f} {v}" for f, v in given.items())
    langs = language_modules(layout)
    if len(langs) != 1 or langs[0].layers is not None:
        raise ValueError(
            f"{flags} is not supported with GPT segments: each segment's `layers:` already place the layers "
            f"(its own pipeline splits them evenly); cut the model into segments where the stages should be"
        )
    m = langs[0]
    split = pipeline_split(
        decoder_layers(args),
        m.pp,
        given.get("--decoder-first-pipeline-num-layers"),
        given.get("--decoder-last-pipeline-num-layers"),
        f"module {m.name}",
    )
    return m.name, split


def check_common(args: Any, layout: HeteroLayout) -> None:
    """Megatron features every script's layout run supports; ValueError naming the flag otherwise."""
    check_schedule_choice(getattr(args, "hetero_schedule", "1f1b"), layout)
    for m in layout.modules:
        if m.cp != 1:
            raise ValueError(
                f"module {m.name}: cp={m.cp}; context parallelism needs Transformer Engine attention "
                f"in Megatron-LM's models, not supported with a layout (use cp=1)"
            )
        if (m.ep != 1 or m.expt_tp != 1) and not getattr(args, "num_experts", None):
            raise ValueError(
                f"module {m.name}: ep={m.ep}, expt_tp={m.expt_tp}; expert parallelism needs a model with "
                f"experts (--num-experts, pretrain_gpt.py)"
            )
        if m.recompute is not None:
            raise ValueError(
                f"module {m.name}: a layout's own recompute is for megatron-hetero train; with "
                f"Megatron-LM's scripts recompute is the whole model's (--recompute-granularity, "
                f"--recompute-method, --recompute-num-layers)"
            )
        check_heads(m, args.num_attention_heads, "--num-attention-heads")
    for attr, flag in REFUSED.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with a layout (yet)")
    for attr, (flag, why) in PIPELINE_REFUSED.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with a layout: {why}")
    check_uneven_pipeline(args, layout)
    check_optimizer_flags(args)  # the optimizer and precision rules train keeps too (OptimConfig.validate)
    if args.context_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise ValueError(
            "with a layout, Megatron's --context-parallel-size and --pipeline-model-parallel-size "
            "must stay 1 (they give the reference layout the weights start from; each module's "
            "own degrees come from the layout)"
        )
    if (args.load or args.save) and args.ckpt_format not in CKPT_FORMATS:
        raise ValueError(
            f"--ckpt-format {args.ckpt_format} is not supported with a layout and --load/--save (torch or "
            f"torch_dist: Megatron's own load_checkpoint/save_checkpoint on the layout of Megatron's parallel flags)"
        )
    if args.save:
        if args.hetero_init != "reference":
            raise ValueError(
                "--save with a layout needs --hetero-init reference (the checkpoint is written "
                "through Megatron's own model on the reference layout)"
            )
    if args.eval_iters and args.eval_iters > 0 and getattr(args, "full_validation", False):
        raise ValueError("--full-validation is not supported with a layout (use --eval-iters N)")
    if getattr(args, "multiple_validation_sets", False):
        raise ValueError("--multiple-validation-sets is not supported with a layout")
    if args.train_iters is None:
        raise ValueError("--train-iters is required with a layout (--train-samples is not supported)")
    if args.rampup_batch_size:
        raise ValueError("--rampup-batch-size is not supported with a layout")
