"""The sbatch script of `megatron-hetero slurm` (`launch/slurm.py`, whose docstring describes the job):
`sbatch_script` writes it from checked values, every user-supplied value data and never shell code
(`shlex.quote`d on shell lines; free of whitespace, quotes, backslashes and control characters on
`#SBATCH` lines), with the SIGTERM-and-requeue lines when the run checkpoints.
"""

from __future__ import annotations

import re
import shlex
from typing import Optional, Sequence

from megatron_hetero.launch.rank_env import MARKER_ENV, PORT_BASE, PORT_SPAN


DEFAULT_ENTRY_MODULE = "megatron_hetero"
DEFAULT_JOB_NAME = "megatron-hetero"
_SBATCH_VALUE = re.compile(r"[^\s\"'\\#]+")
_SBATCH_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9-]*(=[^\s\"'\\]+)?")


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
