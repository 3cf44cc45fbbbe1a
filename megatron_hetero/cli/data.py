"""`megatron-hetero data`: build training data.

    megatron-hetero data digits --out DIR [--held-out 200] [--seed 0] [--train-shards 4] [--force]
    megatron-hetero data digits --chat --out DIR [--samples 4000] [--val-samples 400] [--sizes 8,16] [...]
    megatron-hetero data check PATH [--trust-dataset-code] [--json]

`digits` writes scikit-learn's bundled handwritten digits (1,797 8x8 grey images, nothing downloaded)
as an energon-prepared WebDataset of captioning samples ("a handwritten seven"): a `train` split and
a stratified held-out split (`val`, also registered as `test`), deterministic in --seed; `energon
info DIR` and `energon lint DIR` accept it. Train on it with `megatron-hetero train --data-path DIR`.
With `--chat` it writes conversations instead (`data.digits_chat`): multi-turn questions about one or
two digit images at several sizes, and text-only arithmetic, as an energon crude dataset that
`data.chat_data` reads (train and val; val's images are the held-out digits only).
Needs the `data` extra (megatron-energon, scikit-learn, pillow, tokenizers).

`check` reads an energon dataset (or metadataset) as data and lists what in it would run code
(`data.dataset_trust`); exit 2 when it names any and --trust-dataset-code is not given.
"""

from __future__ import annotations

import argparse
import json

from megatron_hetero.cli import CommandFailed
from megatron_hetero.cli.data_speech import add_speech_flags, run_speech
from megatron_hetero.cli.data_write import write_conversations
from megatron_hetero.data.digits import write_digits_dataset
from megatron_hetero.data.digits_chat import write_digits_chat_dataset

NAME = "data"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="build training data (digits: a small real image-caption dataset, offline)")
    kinds = p.add_subparsers(dest="data_command", required=True, metavar="DATASET")
    d = kinds.add_parser("digits", help="scikit-learn's handwritten digits as energon captioning shards")
    d.add_argument("--out", required=True, help="output folder (created; must be empty unless --force)")
    d.add_argument(
        "--held-out",
        type=int,
        default=200,
        help="held-out samples, the same count of each digit (a multiple of 10; default 200)",
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the held-out choice (default 0)")
    d.add_argument("--train-shards", type=int, default=4, help="tar shards of the train split (default 4)")
    d.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.add_argument(
        "--chat",
        action="store_true",
        help="write conversations (visual instruction data: questions about 1 or 2 digit images, text-only turns)",
    )
    d.add_argument("--samples", type=int, default=4000, help="--chat: conversations in train (default 4000)")
    d.add_argument("--val-samples", type=int, default=400, help="--chat: conversations in val (default 400)")
    d.add_argument(
        "--sizes",
        default="8,16",
        help="--chat: image sizes in pixels, multiples of 8, comma-separated (default 8,16: upscaled digits)",
    )
    add_speech_flags(d)
    c = kinds.add_parser("check", help="what in a dataset would run code (exit 2 unless --trust-dataset-code)")
    c.add_argument("path", help="an energon dataset folder or metadataset YAML")
    c.add_argument("--json", action="store_true", help="print the findings as JSON")
    add_trust_flag(c)
    return p


def run_check(args: argparse.Namespace) -> int:
    """`data check PATH`: the findings of `dataset_trust.inspect_dataset`, read as data (no energon)."""
    from megatron_hetero.data.dataset_trust import check_dataset, inspect_dataset, trusted_message

    if args.json:
        found = inspect_dataset(args.path)
        print(json.dumps({"path": args.path, "findings": [vars(f) for f in found]}, indent=2))
        return 2 if found and not args.trust_dataset_code else 0
    found = check_dataset(args.path, trust=args.trust_dataset_code, flag="data check")  # refused: exit 2
    print(trusted_message(args.path, [f.line() for f in found]))
    return 0


def add_train_data_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`train`'s data flags (Megatron-LM's names where it has them), generated from the fields that
    declare them (`config.data.data_flag_fields`); read by
    `models.caption_runner.caption_job_data`."""
    from megatron_hetero.layout.flags import add_flags
    from megatron_hetero.config.data import data_flag_fields

    add_flags(parser, data_flag_fields(), {"data": "data"})
    return parser


def add_trust_flag(parser) -> None:
    """`--trust-dataset-code` (`data.dataset_trust`), for every command that opens a dataset."""
    from megatron_hetero.layout.flags import add_flags, flags_of
    from megatron_hetero.config.data import CaptionDataConfig

    add_flags(parser, flags_of(CaptionDataConfig, ["trust_code"]))


def run_chat(args: argparse.Namespace) -> int:
    """`data digits --chat`: the conversation dataset of `data.digits_chat`."""

    summary = write_conversations(args, write_digits_chat_dataset, CommandFailed)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    k = summary["kinds"]
    print(
        f"megatron-hetero data digits --chat: wrote {summary['path']}: train {summary['train']} conversations "
        f"({len(summary['shards']) - 1} shards), val {summary['val']} (splits val and test; held-out digits); "
        f"{k['one']} with one image, {k['two']} with two, {k['text']} text-only; image sizes "
        f"{', '.join(f'{s}x{s}' for s in summary['sizes'])}; energon-prepared (CrudeWebdataset: read with "
        f"megatron_hetero.data.chat_data)"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.data_command == "check":
        return run_check(args)
    import importlib.util

    for mod in ("megatron.energon", "sklearn", "PIL"):  # the prepare step runs energon in a subprocess
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise CommandFailed(f"{mod} is not installed: pip install 'megatron-hetero[data]'")
    if args.speech:
        return run_speech(args, CommandFailed)
    if args.chat:
        return run_chat(args)
    try:
        summary = write_digits_dataset(
            args.out, held_out=args.held_out, seed=args.seed, train_shards=args.train_shards, force=args.force
        )
    except RuntimeError as exc:
        raise CommandFailed(str(exc)) from None
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"megatron-hetero data digits: wrote {summary['path']}: train {summary['train']} samples "
        f"({len(summary['shards']) - 1} shards), held-out {summary['heldout']} (splits val and test), "
        f"8x8 grey PNG + caption; energon-prepared (CaptioningSample)"
    )
    print(f"train on it: megatron-hetero train --data-path {summary['path']} --hetero-layout LAYOUT.yaml")
    return 0
