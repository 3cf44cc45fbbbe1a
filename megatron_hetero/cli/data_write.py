"""What `data digits --chat` and `data digits --speech` share: `--sizes` read, the writer called with
the common flags, its failure turned into the CLI's exit-1 error."""

from __future__ import annotations

import argparse
from typing import Any, Callable


def write_conversations(
    args: argparse.Namespace, write: Callable[..., dict[str, Any]], failed: type[Exception], **extra: Any
) -> dict[str, Any]:
    """Call `write(out, samples=..., val_samples=..., held_out=..., seed=..., sizes=..., train_shards=...,
    force=..., **extra)` with the parsed flags and return its summary. A `RuntimeError` of the writer
    (energon prepare's output, a missing synthesiser's install hint) is raised as `failed`."""
    try:
        sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sizes {args.sizes}: expected comma-separated integers such as 8,16") from None
    try:
        return write(
            args.out,
            samples=args.samples,
            val_samples=args.val_samples,
            held_out=args.held_out,
            seed=args.seed,
            sizes=sizes,
            train_shards=args.train_shards,
            force=args.force,
            **extra,
        )
    except RuntimeError as exc:
        raise failed(str(exc)) from None
