"""The Megatron-style model flags every subcommand shares (names of Megatron-LM's arguments).

Every flag defaults to None in the parser, so a subcommand can tell a given value from a default;
`ModelArgs.from_namespace(args)` (training/model_args.py) fills in `train`'s defaults. A subcommand
that needs only some of them passes `names` (e.g. `plan`: the edge shape).
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from megatron_hetero.training.model_args import ModelArgs

_DEFAULTS = ModelArgs()

# dest -> (group, help); the group is the language model, each encoder, or the batch.
MODEL_FLAGS: dict[str, tuple[str, str]] = {
    "num_layers": ("language", "language-model layers (default: 2, or what the layout's segments' `layers` cover)"),
    "hidden_size": ("language", f"language-model hidden size (default {_DEFAULTS.hidden_size})"),
    "num_attention_heads": ("language", f"language-model attention heads (default {_DEFAULTS.num_attention_heads})"),
    "ffn_hidden_size": ("language", "language-model MLP hidden size (default 4 * --hidden-size)"),
    "seq_length": ("language", f"tokens per sample (default {_DEFAULTS.seq_length})"),
    "vocab_size": ("language", f"vocabulary size (default {_DEFAULTS.vocab_size})"),
    "encoder_num_layers": ("encoder", f"layers of each encoder (default {_DEFAULTS.encoder_num_layers})"),
    "encoder_hidden_size": ("encoder", f"hidden size of each encoder (default {_DEFAULTS.encoder_hidden_size})"),
    "encoder_num_attention_heads": (
        "encoder",
        f"attention heads of each encoder (default {_DEFAULTS.encoder_num_attention_heads})",
    ),
    "encoder_tokens": (
        "encoder",
        f"encoder tokens per sample, e.g. image patches (default {_DEFAULTS.encoder_tokens})",
    ),
    "encoder_feature_dim": ("encoder", f"input features per encoder token (default {_DEFAULTS.encoder_feature_dim})"),
    "global_batch_size": ("batch", f"samples per step (default {_DEFAULTS.global_batch_size})"),
    "micro_batch_size": (
        "batch",
        "samples per micro-batch on a rank of the (first) language module (default: 1, or "
        "for disjoint layouts the smallest size whose micro-batches every module's DP "
        "divides)",
    ),
}
GROUPS = {"language": "model (language model)", "encoder": "model (each encoder)", "batch": "batch"}


def flag(dest: str) -> str:
    """'--hidden-size' for 'hidden_size'."""
    return "--" + dest.replace("_", "-")


def add_model_flags(
    parser: argparse.ArgumentParser, names: Optional[Sequence[str]] = None, help: Optional[dict[str, str]] = None
) -> argparse.ArgumentParser:
    """Add the model flags `names` (default: all of MODEL_FLAGS) to `parser`, grouped; `help`
    overrides the help text of some. Every default is None."""
    names = list(MODEL_FLAGS) if names is None else list(names)
    unknown = [n for n in names if n not in MODEL_FLAGS]
    assert not unknown, f"not model flags: {unknown}"
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dest in names:
        kind, text = MODEL_FLAGS[dest]
        if kind not in groups:
            groups[kind] = parser.add_argument_group(GROUPS[kind])
        groups[kind].add_argument(flag(dest), dest=dest, type=int, default=None, help=(help or {}).get(dest, text))
    return parser
