"""`megatron-hetero slurm`: write (and optionally submit) an sbatch script that runs `train` on N nodes.

    megatron-hetero slurm --nodes N --gpus-per-node G --hetero-layout FILE [--partition P] [--time T]
        [--account A] [--job-name J] [--output PATTERN] [--container-image I] [--signal-seconds S]
        [--dry-run | --submit]
        -- <train arguments>

The checks are `launch/slurm.py`, the script `launch/sbatch.py`; the train arguments are parsed with
`train`'s own parser before anything is written, so a typo fails here and not after the queue wait.
"""

from __future__ import annotations

import argparse
from megatron_hetero.launch.slurm import add_arguments, run as run_slurm

NAME = "slurm"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from megatron_hetero.cli.train import add_parser as add_train_parser

    p = sub.add_parser(NAME, help="write/submit an sbatch script that runs train on N nodes")
    return add_arguments(p, add_train_parser=add_train_parser)


def run(args: argparse.Namespace) -> int:
    return run_slurm(args)
