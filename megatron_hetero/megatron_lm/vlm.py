"""`pretrain_vlm.py --hetero-*`: Megatron-LM's VLM script trained with per-module layouts.

The patched `pretrain_vlm.py` hands its dataset provider, model provider and extra arguments to
:func:`pretrain_vlm`, which runs them through the shared driver (`driver.py`: argument parsing,
validation, `initialize_megatron`, reference weights, the schedule, Megatron's log lines) with the
VLM's `ScriptModel`: modules `vision` (CLIP ViT + projector) and `language` (GPT language model),
Megatron's `LLaVAModel` with `add_encoder`/`add_decoder` split, built from Megatron's arguments on
each module's own `ProcessGroupCollection` (`build.py`), driven by `MegatronVlmRunner` (`runner.py`).
Features a layout refuses are listed in `check_vlm` and `driver.check_common` (each with the flag
named, exit 2 before any process group or model exists).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.megatron_lm.driver import ScriptModel, pretrain_with_layout, uneven_pp_flags
from megatron_hetero.megatron_lm.build import build_vlm_module, vlm_sizes
from megatron_hetero.megatron_lm.runner import MegatronVlmRunner

VISION, LANGUAGE = "vision", "language"


# -- validation (pure on parsed arguments; before any group or model) ------------------------------
def check_vlm(args: Any, layout: HeteroLayout) -> None:
    """What `pretrain_vlm.py` needs beyond `driver.check_common`; ValueError naming the flag otherwise."""
    if getattr(args, "num_experts", None):
        raise ValueError(
            "--num-experts is not supported with pretrain_vlm.py and a layout: the unpatched script cannot build "
            "it either (megatron-core 0.19's LLaVA projector takes the MLP submodules of the language layer "
            "spec, which with experts are MoESubmodules: AttributeError 'linear_fc1'); pretrain_gpt.py and "
            "megatron-hetero train have MoE"
        )
    if getattr(args, "sequence_parallel", False):
        raise ValueError(
            "--sequence-parallel is not supported with pretrain_vlm.py and a layout: Megatron's LLaVAModel "
            "needs Transformer Engine attention for sequence parallelism (megatron-hetero train has it)"
        )
    names = set(layout.names)
    if names != {VISION, LANGUAGE}:
        raise ValueError(
            f"pretrain_vlm.py with a layout needs exactly the modules 'vision' and 'language' "
            f"(CLIP ViT + projector, GPT language model); the layout has {sorted(names)}"
        )
    if [(e.src, e.dst) for e in layout.edges] != [(VISION, LANGUAGE)]:
        raise ValueError(
            f"pretrain_vlm.py needs exactly the edge 'vision -> language'; the layout has "
            f"{[str(e) for e in layout.edges]}"
        )
    vis, lang = layout.module(VISION), layout.module(LANGUAGE)
    for m in (vis, lang):
        if m.cp != 1:
            raise ValueError(
                f"module {m.name}: cp={m.cp}; LLaVA's context parallelism needs Transformer Engine "
                f"attention and packed sequences, not supported with a layout (use cp=1)"
            )
        if m.ep != 1 or m.layers is not None:
            raise ValueError(f"module {m.name}: ep/layers are not supported with pretrain_vlm.py")
    if (args.save or args.load) and args.ckpt_format != "torch":
        raise ValueError(
            f"pretrain_vlm.py takes only --ckpt-format torch (its model provider asserts it); got {args.ckpt_format}"
        )
    if vis.pp != 1:
        raise ValueError(
            f"module vision: pp={vis.pp}; Megatron's LLaVA vision encoder runs on one pipeline stage (pp=1)"
        )
    for attr, flag in {"use_packed_sequence": "--use-packed-sequence", "pixel_shuffle": "--pixel-shuffle"}.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with a layout (yet)")
    dec_layers = args.decoder_num_layers if args.decoder_num_layers is not None else args.num_layers
    if dec_layers % lang.pp and not uneven_pp_flags(args):  # else driver.check_uneven_pipeline
        raise ValueError(f"module language: {dec_layers} decoder layers do not split over pp({lang.pp})")


def _build(args: Any, layout: HeteroLayout, m, pgs, model_provider: Callable):
    return build_vlm_module(args, m, pgs)


def _prepare(args: Any) -> None:
    vlm_sizes(args)


def _runner(args, plan, states, datasets_provider):
    return MegatronVlmRunner(args, plan, states, datasets_provider)


VLM = ScriptModel(script="pretrain_vlm.py", check=check_vlm, build=_build, runner=_runner, prepare=_prepare)


# -- the entry point the patch calls ---------------------------------------------------------------
def pretrain_vlm(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[dict] = None,
    get_embedding_ranks: Optional[Callable] = None,
    get_position_embedding_ranks: Optional[Callable] = None,
) -> int:
    """Train Megatron-LM's VLM with the layout of the `--hetero-*` flags; returns the exit code
    (2: invalid input, printed as one paragraph)."""
    return pretrain_with_layout(
        VLM,
        train_valid_test_datasets_provider,
        model_provider,
        extra_args_provider,
        args_defaults,
        get_embedding_ranks,
        get_position_embedding_ranks,
    )
