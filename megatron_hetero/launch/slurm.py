"""`megatron-hetero slurm`: write (and optionally submit) an sbatch script that runs `train` on N nodes.

    megatron-hetero slurm --nodes 2 --gpus-per-node 8 --hetero-layout L.yaml [--partition P] [--time T]
        [--account A] [--job-name J] [--output PATTERN] [--container-image I] [--signal-seconds S]
        [--dry-run | --submit]
        -- <train arguments>

The job: one `srun` task per node, each running `torchrun --nnodes N --nproc-per-node R --rdzv-backend c10d
--rdzv-endpoint HEAD:PORT -m megatron_hetero train --hetero-layout L <train arguments>`, with the
rendezvous on the first node of the allocation (`scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1`)
and the port derived from the job id (20000 + SLURM_JOB_ID % 20000, the rule `rank_env` uses too).
Each torchrun worker is one rank of `train` (torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*).

Ranks per node: the GPU count when `--gpus-per-node G` > 0 (one rank per GPU). With `--gpus-per-node 0`
the job runs on CPUs (gloo) and `--cpu-ranks-per-node R` says how many ranks each node runs (required).

Validated before anything is written: the layout must load, and its world size must equal
nodes x ranks per node (else exit 2 with the arithmetic); the train arguments must parse (when the
train parser is importable) and must not repeat what this command sets (`--hetero-layout`, the layout
flags, `--nproc-per-node`).

SIGTERM before the time limit (`--signal-seconds S`, default 120 when the train arguments have --save DIR):
`#SBATCH --signal=B:TERM@S --requeue --open-mode=append`; the batch shell passes the signal to the step's
tasks, and when global rank 0 confirms a checkpoint of the stop (training/signals.py's marker) requeues
the job, which resumes with --load DIR.

Safety: every user-supplied value is data inside the script, never shell code: values on shell lines
are `shlex.quote`d into variables and arrays; values on `#SBATCH` lines (which sbatch parses itself,
not the shell) must be free of whitespace, quotes, backslashes and control characters.
No user-specific paths: the python is `${MH_PYTHON:-python3}`; every value has an `MH_*` override
(listed at the top of the script), read from the environment sbatch passes to the job.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_hetero.launch.sbatch import DEFAULT_ENTRY_MODULE, DEFAULT_JOB_NAME, sbatch_script

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2

# train flags this command sets itself (the layout, and the local spawn count that torchrun replaces)
OWNED_TRAIN_FLAGS = ("--hetero-layout", "--hetero-module", "--hetero-placement", "--hetero-edge", "--nproc-per-node")


def add_arguments(
    parser: argparse.ArgumentParser, add_train_parser: Optional[Callable[[argparse._SubParsersAction], Any]] = None
) -> argparse.ArgumentParser:
    """The `slurm` subcommand's flags; the train arguments come after `--`.

    ADD_TRAIN_PARSER registers the `train` subparser on a subparsers action (the CLI's own function); the
    train arguments are parsed with it before anything is written, so typos fail now and not after the
    queue wait (the CLI passes `cli.train.add_parser`; without it the train arguments are not parsed here)."""
    parser.description = (parser.description or "") + (
        "Write an sbatch script that runs `megatron-hetero train` on NODES nodes (one srun task per node, "
        "torchrun inside, rendezvous on the first node) and print it (--dry-run, the default) or submit it "
        "(--submit). Train arguments go after `--`."
    )
    g = parser.add_argument_group("allocation")
    g.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    g.add_argument(
        "--gpus-per-node",
        type=int,
        required=True,
        help="GPUs per node, one rank each; 0 = CPU ranks (gloo), see --cpu-ranks-per-node",
    )
    g.add_argument(
        "--cpu-ranks-per-node",
        type=int,
        default=None,
        help="ranks per node when --gpus-per-node is 0 (required then; not allowed otherwise)",
    )
    g.add_argument(
        "--hetero-layout",
        required=True,
        metavar="FILE",
        help="layout YAML; its world size must be nodes x ranks per node. Passed to train as "
        "given: a relative path resolves against the job's working directory (sbatch's: "
        "the directory it is called from)",
    )
    g.add_argument("--partition", default=None)
    g.add_argument("--time", default=None, help="time limit, sbatch syntax (e.g. 01:00:00)")
    g.add_argument("--account", default=None)
    g.add_argument("--job-name", default=DEFAULT_JOB_NAME)
    g.add_argument("--output", default=None, metavar="PATTERN", help="sbatch --output pattern (e.g. %%x-%%j.out)")
    g.add_argument(
        "--cpus-per-task",
        type=int,
        default=None,
        help="CPUs for each node's task (torchrun and all its ranks); default: sbatch's",
    )
    g.add_argument(
        "--no-gpu-request",
        action="store_true",
        help="do not write `#SBATCH --gpus-per-node` (clusters whose nodes come with their GPUs "
        "without a GRES request)",
    )
    g.add_argument(
        "--sbatch-option",
        action="append",
        default=[],
        metavar="--KEY=VALUE",
        help="extra `#SBATCH` line, repeatable (e.g. --sbatch-option=--exclusive)",
    )
    g.add_argument(
        "--signal-seconds",
        type=int,
        default=None,
        metavar="S",
        help="SIGTERM the job S seconds before its time limit (#SBATCH --signal=B:TERM@S, --requeue): "
        "the ranks finish the current step, save a checkpoint to the train arguments' --save and "
        "exit; the job requeues itself and resumes from it with --load. Default: 120 when the "
        "train arguments have --save, else off; 0 = off",
    )
    g.add_argument("--container-image", default=None, help="run each node's task in this image (pyxis srun flag)")
    g.add_argument(
        "--entry-module",
        default=DEFAULT_ENTRY_MODULE,
        help="python module torchrun runs with `train ...` (default: %(default)s)",
    )
    g.add_argument(
        "--script",
        default=None,
        metavar="PRETRAIN.py",
        help="run this training script instead of `megatron-hetero train` (Megatron-LM's patched "
        "pretrain_vlm.py; the arguments after `--` are its Megatron flags)",
    )
    m = parser.add_mutually_exclusive_group()
    m.add_argument("--dry-run", action="store_true", help="print the script (the default)")
    m.add_argument("--submit", action="store_true", help="write the script to --script-file and run sbatch on it")
    parser.add_argument(
        "--script-file",
        default=None,
        metavar="PATH",
        help="where --submit writes the script (default: ./JOB_NAME.sbatch)",
    )
    parser.add_argument(
        "train_args", nargs="*", metavar="-- TRAIN_ARGS", help="arguments for `megatron-hetero train` (after `--`)"
    )
    parser.set_defaults(func=run, add_train_parser=add_train_parser)
    return parser


def _check_train_args(
    train_args: Sequence[str],
    layout_file: str,
    add_train_parser: Optional[Callable[[argparse._SubParsersAction], Any]] = None,
) -> None:
    for arg in train_args:
        for flag in OWNED_TRAIN_FLAGS:
            if arg == flag or arg.startswith(flag + "="):
                what = (
                    "the job runs one torchrun worker per rank; ranks per node come from --gpus-per-node "
                    "or --cpu-ranks-per-node"
                    if flag == "--nproc-per-node"
                    else "the layout is `megatron-hetero slurm --hetero-layout FILE`'s"
                )
                raise ValueError(
                    f"train argument {arg!r}: {flag} is set by this command ({what}); remove it from "
                    f"the arguments after `--`"
                )
    if add_train_parser is None:  # the CLI passes train's parser so typos fail here, not after the queue wait
        return
    probe = argparse.ArgumentParser(prog="megatron-hetero", add_help=False)
    add_train_parser(probe.add_subparsers(dest="command"))
    try:
        ns = probe.parse_args(["train", "--hetero-layout", layout_file, *train_args])
    except SystemExit as exc:  # argparse printed `usage ... error: ...` on stderr
        raise ValueError(f"the train arguments {list(train_args)} do not parse (see the message above)") from exc
    if getattr(ns, "nproc_per_node", None) is not None:  # an abbreviation such as --nproc
        raise ValueError(
            "train arguments: --nproc-per-node is set by this command (ranks per node come from "
            "--gpus-per-node or --cpu-ranks-per-node); remove it from the arguments after `--`"
        )


def ranks_per_node(args: argparse.Namespace) -> int:
    if args.gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {args.gpus_per_node}")
    if args.gpus_per_node > 0:
        if args.cpu_ranks_per_node is not None:
            raise ValueError(
                f"--cpu-ranks-per-node {args.cpu_ranks_per_node} with --gpus-per-node "
                f"{args.gpus_per_node}: with GPUs each node runs one rank per GPU; give one of them"
            )
        return args.gpus_per_node
    if args.cpu_ranks_per_node is None:
        raise ValueError(
            "--gpus-per-node 0 runs CPU ranks (gloo): give --cpu-ranks-per-node R, the ranks each node runs"
        )
    if args.cpu_ranks_per_node < 1:
        raise ValueError(f"--cpu-ranks-per-node must be >= 1, got {args.cpu_ranks_per_node}")
    return args.cpu_ranks_per_node


def script_from_args(args: argparse.Namespace) -> str:
    """Validate (layout world size, train arguments) and return the script; ValueError on bad input."""
    from megatron_hetero.layout.yaml_io import load_layout

    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    per_node = ranks_per_node(args)
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:  # argparse keeps the separator on some Python versions
        train_args = train_args[1:]
    layout = load_layout(args.hetero_layout)
    world = args.nodes * per_node
    if layout.world_size != world:
        source = "--gpus-per-node" if args.gpus_per_node else "--cpu-ranks-per-node"
        raise ValueError(
            f"layout {args.hetero_layout!r} uses {layout.world_size} ranks, but --nodes {args.nodes} x "
            f"{per_node} ranks per node ({source}) = {world} ranks ({layout.world_size} != {world}); choose nodes "
            f"and ranks per node whose product is {layout.world_size}"
        )
    script = args.script
    _check_train_args(train_args, args.hetero_layout, None if script else args.add_train_parser)
    save_dir = _last_value(train_args, "--save")
    signal_seconds = args.signal_seconds
    if script and signal_seconds:
        raise ValueError(
            f"--signal-seconds {signal_seconds} with --script: the stop-and-requeue protocol is "
            f"`megatron-hetero train`'s; give --signal-seconds 0"
        )
    if signal_seconds is None:
        signal_seconds = 120 if save_dir and not script else 0
    return sbatch_script(
        nodes=args.nodes,
        ranks_per_node=per_node,
        gpus_per_node=args.gpus_per_node,
        layout=args.hetero_layout,
        train_args=train_args,
        partition=args.partition,
        time=args.time,
        account=args.account,
        job_name=args.job_name,
        output=args.output,
        container_image=args.container_image,
        cpus_per_task=args.cpus_per_task,
        request_gpus=not args.no_gpu_request,
        sbatch_options=args.sbatch_option,
        entry_module=args.entry_module,
        script=script,
        signal_seconds=signal_seconds,
        save_dir=save_dir,
    )


def _last_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value of the last `flag V` / `flag=V` in argv (argparse: the last one wins), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def submit(script: str, path: Path) -> tuple[int, str]:
    """Write SCRIPT to PATH and `sbatch --parsable` it: (0, job id) or (1, sbatch's message)."""
    path.write_text(script)
    path.chmod(0o755)
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        return EXIT_FAILURE, "sbatch not found on PATH (is this a SLURM login node?)"
    except subprocess.TimeoutExpired:
        return EXIT_FAILURE, "sbatch did not answer within 120 s"
    if proc.returncode != 0:
        msg = proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}"
        return EXIT_FAILURE, f"sbatch failed (exit {proc.returncode}): {msg}"
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        return EXIT_FAILURE, f"sbatch printed no job id: {proc.stdout.strip()!r}"
    return EXIT_OK, job_id


def run(args: argparse.Namespace) -> int:
    """--dry-run (default): print the script. --submit: write it and sbatch it, print the job id on stdout.
    Exit 0 ok, 2 invalid input (message on stderr, nothing written), 1 sbatch failed."""
    try:
        script = script_from_args(args)
    except ValueError as exc:
        print(f"megatron-hetero slurm: invalid input: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if not args.submit:
        sys.stdout.write(script)
        return EXIT_OK
    path = Path(args.script_file or f"{args.job_name or DEFAULT_JOB_NAME}.sbatch")
    try:
        rc, result = submit(script, path)
    except OSError as exc:
        print(f"megatron-hetero slurm: cannot write {str(path)!r}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILURE
    if rc != EXIT_OK:
        print(f"megatron-hetero slurm: {result} (script kept in {path})", file=sys.stderr)
        return rc
    print(result)
    print(f"megatron-hetero slurm: submitted job {result} (script {path}; cwd {os.getcwd()})", file=sys.stderr)
    return EXIT_OK
