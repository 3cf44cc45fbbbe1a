"""`--exit-signal-handler` (Megatron-LM's flag and semantics): SIGTERM stops training at a step boundary.

SLURM sends SIGTERM before a job's time limit (`#SBATCH --signal`), `scancel` sends it on request; the
signal may reach only some ranks (torchrun forwards it to its own workers, the fork launcher to its
children). Each rank's handler only sets a flag. At the end of every step each rank contributes its
flag to one all-reduce (MAX) of a single int32 over the world group (the process group's timeout
bounds it; a dead peer fails it with a `runtime.step.CollectiveError` naming the ranks), so every
rank learns in the same step that some rank was signalled. Then the trainer saves a checkpoint of the
step just finished (with --save; without it nothing is saved and the message says so, as Megatron-LM
does), global rank 0 prints one line, writes the stop marker (below) and every rank returns normally:
the process exits 0.

Stop marker: when the environment variable MH_EXIT_SIGNAL_MARKER names a file, global rank 0 writes
`ITERATION SAVE_DIR` into it (atomically) after the checkpoint is complete. The sbatch script of
`megatron-hetero slurm` reads it to tell "stopped on the signal with a checkpoint: requeue" from a
failure (torchrun itself exits non-zero after forwarding a signal, so its exit code cannot say).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable, Optional

from megatron_hetero.launch.rank_env import MARKER_ENV

EXIT_SIGNAL = signal.SIGTERM


class ExitSignal:
    """The per-rank SIGTERM flag and the world's agreement on it. Inactive (no handler, no collective)
    unless `enabled`. Use as a context manager: the previous handler is restored on exit."""

    def __init__(self, enabled: bool, signum: int = EXIT_SIGNAL) -> None:
        self.enabled = bool(enabled)
        self.signum = signum
        self.received = False
        self._previous = None
        self._installed = False

    def install(self) -> "ExitSignal":
        """Set the handler (signal handlers can only be set from the main thread: ranks run there under the
        fork launcher and torchrun; elsewhere the flag stays unset and `agreed` still takes part)."""
        if self.enabled and not self._installed and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True
        return self

    def restore(self) -> None:
        """Put the previous handler back."""
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def __enter__(self) -> "ExitSignal":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:  # async-signal context: only set the flag
        self.received = True

    def agreed(self, rank: int) -> bool:
        """Whether any rank of the world has received the signal (one all-reduce MAX of an int32 over the
        world group). Collective: every rank calls it once per step when enabled; False when disabled."""
        if not self.enabled:
            return False
        import torch
        import torch.distributed as dist

        from megatron_hetero.compat.device import get_device
        from megatron_hetero.runtime.step import run_collective

        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=get_device())
        run_collective(
            "exit-signal flag all-reduce (MAX) over the world", rank, dist.all_reduce, flag, dist.ReduceOp.MAX
        )
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def stop_message(name: str, iteration: int, save: Optional[str]) -> str:
    """The line global rank 0 prints when the run stops on the signal."""
    if save:
        return (
            f"megatron-hetero: received {name}: stopped after iteration {iteration}; checkpoint of iteration "
            f"{iteration} saved in {save} (resume with --load {save}); exiting with status 0\n"
        )
    return (
        f"megatron-hetero: received {name}: stopped after iteration {iteration}; nothing saved (no --save); "
        f"exiting with status 0\n"
    )


def write_marker(iteration: int, save: Optional[str], environ=os.environ) -> Optional[Path]:
    """Write `ITERATION SAVE_DIR` to the file MH_EXIT_SIGNAL_MARKER names (atomic rename); None when unset
    or when nothing was saved (no marker: the batch script must not requeue a run it cannot resume)."""
    target = environ.get(MARKER_ENV)
    if not target or not save:
        return None
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(f"{iteration} {save}\n")
    os.replace(tmp, path)
    return path


def finish_on_signal(
    stop: ExitSignal, iteration: int, save: Optional[str], rank: int, write: Optional[Callable[[str], None]]
) -> None:
    """After the world agreed to stop at `iteration` and the checkpoint (if any) is complete: on global
    rank 0 the marker and the message (through `write`, else stdout)."""
    if rank != 0:
        return
    write_marker(iteration, save)
    text = stop_message(stop.name, iteration, save)
    if write is not None:
        write(text)
    else:
        import sys

        sys.stdout.write(text)
        sys.stdout.flush()
