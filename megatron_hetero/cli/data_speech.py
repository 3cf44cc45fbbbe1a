"""`megatron-hetero data digits --speech`: the spoken-digits dataset of `data.digits_speech`."""

from __future__ import annotations

import argparse
import json

from megatron_hetero.cli.data_write import write_conversations
from megatron_hetero.data.digits_speech import write_digits_speech_dataset


def add_speech_flags(d: argparse.ArgumentParser) -> None:
    d.add_argument(
        "--speech",
        action="store_true",
        help="write spoken-digit conversations (an image and a spoken question, speech only, text only; "
        "eSpeak NG voices, Whisper log-mel features; needs the espeak-ng program)",
    )
    d.add_argument("--mel-bins", type=int, default=80, help="--speech: log-mel bins per frame (default 80, Whisper's)")


def run_speech(args: argparse.Namespace, failed: type[Exception]) -> int:
    """Write the dataset; `failed` (the CLI's exit-1 error) carries a missing synthesiser's install
    hint or energon's failure."""

    if args.chat:
        raise ValueError("--speech and --chat are two datasets: give one")
    # failed: a missing synthesiser (how to install it) or energon prepare's output
    summary = write_conversations(args, write_digits_speech_dataset, failed, mel_bins=args.mel_bins)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    k = summary["kinds"]
    print(
        f"megatron-hetero data digits --speech: wrote {summary['path']}: train {summary['train']} conversations "
        f"({len(summary['shards']) - 1} shards, {summary['voices']['train']} voices), val {summary['val']} "
        f"(held-out digits, {summary['voices']['val']} held-out voices); {k['image_speech']} image + spoken "
        f"question, {k['speech']} speech only, {k['text']} text only; {summary['clips']} clips of "
        f"{summary['frames'][0]}-{summary['frames'][1]} log-mel frames x {summary['mel_bins']} bins; energon-prepared"
    )
    return 0
