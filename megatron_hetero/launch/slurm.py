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
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_hetero.launch.rank_env import PORT_BASE, PORT_SPAN

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2
DEFAULT_ENTRY_MODULE = "megatron_hetero"
DEFAULT_JOB_NAME = "megatron-hetero"
# train flags this command sets itself (the layout, and the local spawn count that torchrun replaces)
OWNED_TRAIN_FLAGS = ("--hetero-layout", "--hetero-module", "--hetero-placement", "--hetero-edge", "--nproc-per-node")
_SBATCH_VALUE = re.compile(r"[^\s\"'\\#]+")
_SBATCH_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[^\s\"'\\]+)?")


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


def _sbatch_value(flag: str, value: object) -> str:
    text = str(value)
    if not _SBATCH_VALUE.fullmatch(text):
        raise ValueError(
            f"{flag} {text!r}: values written to `#SBATCH` lines may not contain whitespace, quotes, "
            f"backslashes, '#' or control characters (sbatch parses these lines itself)"
        )
    return text


def _positive(flag: str, value: Optional[int], minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")


def _bash_array(name: str, values: Sequence[str]) -> str:
    if not values:
        return f"{name}=()"
    return f"{name}=(\n" + "".join(f"  {shlex.quote(v)}\n" for v in values) + ")"


def sbatch_script(
    *,
    nodes: int,
    ranks_per_node: int,
    gpus_per_node: int,
    layout: str,
    train_args: Sequence[str] = (),
    partition: Optional[str] = None,
    time: Optional[str] = None,
    account: Optional[str] = None,
    job_name: Optional[str] = DEFAULT_JOB_NAME,
    output: Optional[str] = None,
    container_image: Optional[str] = None,
    cpus_per_task: Optional[int] = None,
    request_gpus: bool = True,
    sbatch_options: Sequence[str] = (),
    entry_module: str = DEFAULT_ENTRY_MODULE,
    script: Optional[str] = None,
    signal_seconds: int = 0,
    save_dir: Optional[str] = None,
) -> str:
    """The sbatch script text (pure). Checks only what makes the text unsafe or meaningless (counts < 1,
    `#SBATCH` values that sbatch would split or misread); the layout's world size is `run`'s check.
    `script`: a training script (Megatron-LM's patched `pretrain_vlm.py`) that torchrun runs instead of
    `-m ENTRY_MODULE train`, with `--hetero-layout` and the train arguments; on CPU nodes it runs
    through `-m megatron_hetero.megatron_lm.run SCRIPT` (the CPU redirections Megatron-LM needs).
    `signal_seconds` > 0 (needs `save_dir`, the train arguments' --save): SLURM sends SIGTERM to the batch
    shell that many seconds before the time limit; the shell passes it to the job step's tasks with
    `scancel --signal=TERM JOB` (torchrun, which passes it to the ranks, which run with
    --exit-signal-handler), waits for srun, and when global rank 0 wrote the stop marker
    (MH_EXIT_SIGNAL_MARKER: the checkpoint is complete) requeues the job, which resumes with
    `--load SAVE_DIR` (added whenever SAVE_DIR holds a checkpoint)."""
    _positive("--nodes", nodes)
    _positive("ranks per node", ranks_per_node)
    _positive("--gpus-per-node", gpus_per_node, 0)
    _positive("--cpus-per-task", cpus_per_task)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", entry_module):
        raise ValueError(f"--entry-module {entry_module!r} is not a python module name")
    if signal_seconds < 0:
        raise ValueError(f"--signal-seconds must be >= 0, got {signal_seconds}")
    if signal_seconds and not save_dir:
        raise ValueError(
            f"--signal-seconds {signal_seconds}: the train arguments have no --save DIR, so there is "
            f"nothing to resume from; give --save DIR after `--` or --signal-seconds 0"
        )
    if signal_seconds and "--exit-signal-handler" not in train_args:
        train_args = [*train_args, "--exit-signal-handler"]
    world = nodes * ranks_per_node
    mode = f"{gpus_per_node} GPUs per node, one rank each" if gpus_per_node else "CPU ranks (gloo)"
    sbatch = []
    if job_name:
        sbatch.append(f"--job-name={_sbatch_value('--job-name', job_name)}")
    sbatch += [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if gpus_per_node and request_gpus:
        sbatch.append(f"--gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        sbatch.append(f"--cpus-per-task={cpus_per_task}")
    for flag, value in (("--partition", partition), ("--time", time), ("--account", account), ("--output", output)):
        if value is not None:
            sbatch.append(f"{flag}={_sbatch_value(flag, value)}")
    if signal_seconds:
        sbatch += [f"--signal=B:TERM@{signal_seconds}", "--requeue", "--open-mode=append"]
    for opt in sbatch_options:
        if not _SBATCH_OPTION.fullmatch(str(opt)):
            raise ValueError(
                f"--sbatch-option {opt!r}: expected --KEY or --KEY=VALUE without whitespace, quotes, "
                f"backslashes or control characters"
            )
        sbatch.append(str(opt))

    lines = [
        "#!/bin/bash",
        f"# megatron-hetero train on {nodes} nodes x {ranks_per_node} ranks = {world} ranks ({mode}).",
        "# Written by `megatron-hetero slurm`; submit with `sbatch THIS_FILE`. One srun task per node runs torchrun;",
        "# the rendezvous is on the first node of the allocation. Without regenerating, these environment variables",
        "# (set where sbatch is called; sbatch passes its environment to the job) override the values below:",
        "#   MH_PYTHON           python with megatron_hetero and torch installed (default: python3)",
        '#   MH_TORCHRUN         launcher command, whitespace-split (default: "$MH_PYTHON -m torch.distributed.run")',
        f"#   MH_NNODES           nodes to run on (default: {nodes})",
        f"#   MH_NPROC_PER_NODE   ranks per node (default: {ranks_per_node})",
        "#   MH_MASTER_ADDR      rendezvous host (default: first host of SLURM_JOB_NODELIST)",
        f"#   MH_MASTER_PORT      rendezvous port (default: {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN})",
        "#   MH_RDZV_BACKEND     torchrun rendezvous backend (default: c10d)",
        "#   MH_TORCHRUN_ARGS    extra torchrun arguments, whitespace-split, no shell quoting (default: none)",
        "#   MH_SRUN_ARGS        extra srun arguments, whitespace-split (default: none)",
        "#   MH_CONTAINER_IMAGE  image for `srun --container-image` (pyxis); empty = none (default: as generated)",
        f"#   MH_ENTRY_MODULE     python module torchrun runs with `train ...` (default: {entry_module})",
        f"#   MH_SCRIPT           a training script torchrun runs instead (Megatron-LM's pretrain_vlm.py; "
        f"default: {script or 'none'})",
        "#   MH_HETERO_LAYOUT    layout file given to train (default: as generated)",
        "#   MH_TRAIN_ARGS       extra train arguments appended last, whitespace-split (default: none)",
        "#   MH_DRY_RUN          set to 1 to print the srun command line instead of running it",
    ]
    if signal_seconds:
        lines += [
            "#   MH_REQUEUE          0: do not requeue after stopping on SIGTERM (default: 1)",
            f"# On SIGTERM ({signal_seconds} s before the time limit, or `scancel --batch --signal=TERM JOB`) the",
            "# ranks finish the current step, save to the save directory and exit; the job then requeues itself",
            "# and resumes from that checkpoint (--load is added whenever the save directory holds one).",
        ]
    lines += [f"#SBATCH {s}" for s in sbatch]
    lines += [
        "",
        "set -euo pipefail",
        ': "${SLURM_JOB_ID:?run this script with sbatch: SLURM_JOB_ID is not set}"',
        "",
        "python=${MH_PYTHON:-python3}",
        'if [ -n "${MH_TORCHRUN:-}" ]; then',
        '  read -r -a torchrun <<< "$MH_TORCHRUN"',
        "else",
        '  torchrun=("$python" -m torch.distributed.run)',
        "fi",
        f"nnodes=${{MH_NNODES:-{nodes}}}",
        f"nproc_per_node=${{MH_NPROC_PER_NODE:-{ranks_per_node}}}",
        "rdzv_backend=${MH_RDZV_BACKEND:-c10d}",
        f"entry_module=${{MH_ENTRY_MODULE:-{entry_module}}}",
        f"generated_script={shlex.quote(script or '')}",
        "script=${MH_SCRIPT-$generated_script}",
        f"generated_layout={shlex.quote(layout)}",
        "layout=${MH_HETERO_LAYOUT:-$generated_layout}",
        f"generated_container_image={shlex.quote(container_image or '')}",
        "container_image=${MH_CONTAINER_IMAGE-$generated_container_image}",
        'if [ -n "${MH_MASTER_ADDR:-}" ]; then',
        "  head=$MH_MASTER_ADDR",
        "else",
        '  : "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set; give the rendezvous host in MH_MASTER_ADDR}"',
        "  # no pipefail here: head exits after one line and scontrol may get SIGPIPE on a long host list",
        '  head=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "fi",
        'if [ -z "$head" ]; then',
        '  echo "megatron-hetero: no rendezvous host: scontrol printed no host for'
        ' SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}; set MH_MASTER_ADDR" >&2',
        "  exit 1",
        "fi",
        f"port=${{MH_MASTER_PORT:-$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))}}",
        'read -r -a torchrun_extra <<< "${MH_TORCHRUN_ARGS:-}"',
        'read -r -a srun_extra <<< "${MH_SRUN_ARGS:-}"',
        'read -r -a train_extra <<< "${MH_TRAIN_ARGS:-}"',
        "# the train arguments as given to `megatron-hetero slurm` (each one quoted: data, not code)",
        _bash_array("train_args", list(train_args)),
        *(_resume_lines(save_dir, signal_seconds) if signal_seconds else []),
        'srun_args=(--nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1)',
        'if [ -n "$container_image" ]; then srun_args+=(--container-image="$container_image"); fi',
        "",
        'if [ -z "$script" ]; then entry=(-m "$entry_module" train)',
        # CPU nodes: Megatron-LM's scripts need the CPU redirections of megatron_hetero.megatron_lm.run
        "else entry=(" + ("-m megatron_hetero.megatron_lm.run " if gpus_per_node == 0 else "") + '"$script"); fi',
        # ${a[@]+"${a[@]}"}: empty arrays expand to nothing under `set -u` on bash < 4.4 too
        'cmd=(srun "${srun_args[@]}" ${srun_extra[@]+"${srun_extra[@]}"}',
        '  "${torchrun[@]}" --nnodes="$nnodes" --nproc-per-node="$nproc_per_node"',
        '  --rdzv-backend="$rdzv_backend" --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID"',
        '  ${torchrun_extra[@]+"${torchrun_extra[@]}"}',
        '  "${entry[@]}" --hetero-layout "$layout"',
        '  ${train_args[@]+"${train_args[@]}"} ${train_extra[@]+"${train_extra[@]}"})',
        'echo "megatron-hetero: job $SLURM_JOB_ID: $nnodes nodes x $nproc_per_node ranks, rendezvous $head:$port" >&2',
        'if [ "${MH_DRY_RUN:-0}" = 1 ]; then',
        "  printf '%q ' \"${cmd[@]}\"; echo",
        "  exit 0",
        "fi",
        *(_signal_lines() if signal_seconds else ['exec "${cmd[@]}"']),
        "",
    ]
    return "\n".join(lines)


def _resume_lines(save_dir: str, signal_seconds: int) -> list[str]:
    """Shell lines: resume from the save directory's checkpoint, and where rank 0 marks a stop on SIGTERM."""
    from megatron_hetero.launch.rank_env import MARKER_ENV

    return [
        f"save_dir={shlex.quote(save_dir)}",
        "# global rank 0 writes this file once the checkpoint of the stop on SIGTERM is complete",
        'marker="$save_dir/.exit-signal.$SLURM_JOB_ID"',
        'rm -f "$marker"',
        f'export {MARKER_ENV}="$marker"',
        "# torchrun forwards SIGTERM to its ranks and waits this long for them (the step and the save) before SIGKILL",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{signal_seconds}}}",
        'if [ -f "$save_dir/latest_checkpointed_iteration.txt" ]; then',
        '  echo "megatron-hetero: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): resuming from iteration'
        ' $(head -n 1 "$save_dir/latest_checkpointed_iteration.txt") in $save_dir" >&2',
        '  train_args+=(--load "$save_dir")',
        "fi",
    ]


def _signal_lines() -> list[str]:
    """Shell lines instead of `exec`: run srun in the background, pass SIGTERM on to its tasks, wait, requeue
    when the ranks stopped on the signal with a checkpoint (the marker), else exit with srun's status."""
    return [
        "got_signal=0 child=",
        # to the job step's tasks (torchrun on every node, which passes it to its ranks) through slurmctld:
        # srun itself would take SIGTERM as "terminate the step" and SIGKILL the tasks after KillWait
        'trap \'got_signal=1; echo "megatron-hetero: job $SLURM_JOB_ID got SIGTERM: passing it to the ranks" >&2;'
        ' scancel --signal=TERM "$SLURM_JOB_ID" || kill -TERM "$child" 2>/dev/null || true\' TERM',
        '"${cmd[@]}" &',
        "child=$!",
        'rc=0; wait "$child" || rc=$?',
        "# a trapped signal interrupts `wait`: wait again until srun itself has ended",
        'while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done',
        'if [ -f "$marker" ] && [ "${MH_REQUEUE:-1}" = 1 ]; then',
        '  echo "megatron-hetero: job $SLURM_JOB_ID stopped on SIGTERM after iteration $(cut -d" " -f1 "$marker")'
        ' with a checkpoint in $save_dir (got_signal=$got_signal, srun exit $rc); requeueing" >&2',
        '  rm -f "$marker"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
    ]


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
