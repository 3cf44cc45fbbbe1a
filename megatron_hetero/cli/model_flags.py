"""The Megatron-style model flags every subcommand shares (names of Megatron-LM's arguments),
generated from the fields that declare them: the model's sizes (`config.model.LlavaSpec`, each
encoder's `EncoderSpec`) and the batch (`config.job.JobConfig`). Their defaults and help live
on those fields.

Every flag defaults to None in the parser, so a subcommand can tell a given value from a default
(`layout.flags.given`); a door reads them once (`cli.train_door.model_flags`: a
`config.model.ModelFlags`), and `config.model.spec_from_flags` fills in the fields' defaults. A subcommand that needs only some of them passes `names` (e.g. `plan`: the edge
shape).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

from megatron_hetero.layout.flags import add_flags, dest, flags_of, option
from megatron_hetero.config.model import size_flags
from megatron_hetero.config.job import JobConfig

GROUPS = {"language": "model (language model)", "encoder": "model (each encoder)", "batch": "batch"}


def model_flag_fields() -> list[dataclasses.Field]:
    """The fields of the shared model flags, in --help order: sizes, then the batch."""
    return size_flags() + flags_of(JobConfig, ("global_batch_size", "micro_batch_size"))


# dest -> the field that declares it
MODEL_FLAGS: dict[str, dataclasses.Field] = {dest(f): f for f in model_flag_fields()}


def flag(name: str) -> str:
    """'--hidden-size' for the dest 'hidden_size'."""
    return option(MODEL_FLAGS[name]) if name in MODEL_FLAGS else "--" + name.replace("_", "-")


def add_model_flags(
    parser: argparse.ArgumentParser, names: Optional[Sequence[str]] = None, help: Optional[dict[str, str]] = None
) -> argparse.ArgumentParser:
    """Add the model flags `names` (dests; default: all of MODEL_FLAGS) to `parser`, grouped; `help`
    overrides the help text of some. Every default is None."""
    names = list(MODEL_FLAGS) if names is None else list(names)
    unknown = [n for n in names if n not in MODEL_FLAGS]
    assert not unknown, f"not model flags: {unknown}"
    add_flags(parser, [MODEL_FLAGS[n] for n in names], GROUPS, help)
    return parser
