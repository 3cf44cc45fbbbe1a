"""Opt-in fault injection: make one rank raise, or die with SIGKILL, at a named point of training.

Off unless the environment variable MEGATRON_HETERO_FAULT is set (every rank reads its own
environment; the fork launcher and torchrun both pass it on):

    MEGATRON_HETERO_FAULT="PHASE:RANK:KIND[:ITERATION]"

PHASE is one of `PHASES` (below), RANK the global rank that fails, KIND `raise` (an `InjectedFault`
exception, as a bug would raise) or `kill` (`SIGKILL` to the rank's own process: no Python cleanup,
no report, its sockets close as when a node dies), ITERATION the 1-based training iteration at which
it fires (omitted: the first time the rank reaches PHASE; `pg-create` has no iteration). A fault point
fires at most once per process. When MEGATRON_HETERO_FAULT_LOG names a file, the rank appends one JSON
line `{"phase", "rank", "kind", "iteration", "time"}` (wall clock) just before it fails, so a harness
can time how long the other ranks take to exit (`bench/faults.py`).

The call sites (one line each) and what they mean:

    pg-create        runtime/topology.py: after the first module's dense groups exist, before the rest
    encoder-forward  an encoder's forward of this rank's share (colocated phase 1 / disjoint Forward)
    boundary-send    a boundary forward on a rank that sends on the edge, before it posts its messages
    boundary-recv    a boundary forward on a rank that receives on the edge, before it posts its receives
    llm-1f1b         the language model's forward of the middle micro-batch (1F1B steady state when pp > 1)
    grad-reduce      before this rank's gradient reduction over each module's DP x CP group
    optimizer        before this rank's optimizer step
    ckpt-save        in `save_checkpoint`, after the first module's shards are written, before the rest
                     and before the marker file that makes the checkpoint the latest

Nothing here imports torch at import time; a bad spec raises ValueError naming the variable.
`named_collective` (a decorator) names the failures of a function that every rank calls together.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

FAULT_ENV = "MEGATRON_HETERO_FAULT"
FAULT_LOG_ENV = "MEGATRON_HETERO_FAULT_LOG"
PHASES = (
    "pg-create",
    "encoder-forward",
    "boundary-send",
    "boundary-recv",
    "llm-1f1b",
    "grad-reduce",
    "optimizer",
    "ckpt-save",
)
KINDS = ("raise", "kill")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws; its message names the phase, the rank and the iteration."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault: `rank` fails at `phase` (at `iteration`, 1-based; None: the first time) by `kind`."""

    phase: str
    rank: int
    kind: str
    iteration: Optional[int] = None

    def __str__(self) -> str:
        return ":".join([self.phase, str(self.rank), self.kind] + ([str(self.iteration)] if self.iteration else []))


def parse_fault(text: str) -> FaultSpec:
    """`PHASE:RANK:KIND[:ITERATION]` -> FaultSpec. ValueError with the accepted values otherwise."""
    parts = text.strip().split(":")
    usage = (
        f"{FAULT_ENV}={text!r}: expected PHASE:RANK:raise|kill[:ITERATION] with PHASE one of "
        f"{', '.join(PHASES)}, RANK >= 0 and ITERATION >= 1"
    )
    if len(parts) not in (3, 4):
        raise ValueError(usage)
    phase, rank, kind = parts[:3]
    if phase not in PHASES or kind not in KINDS or not rank.isdigit():
        raise ValueError(usage)
    iteration = None
    if len(parts) == 4:
        if not parts[3].isdigit() or int(parts[3]) < 1:
            raise ValueError(usage)
        if phase == "pg-create":
            raise ValueError(f"{usage} (pg-create happens once, before iteration 1: give no ITERATION)")
        iteration = int(parts[3])
    return FaultSpec(phase, int(rank), kind, iteration)


@lru_cache(maxsize=8)
def _spec_of(text: str) -> Optional[FaultSpec]:
    return parse_fault(text) if text.strip() else None


_fired: set[str] = set()  # phases that already fired in this process (a fault fires once)


def active_fault() -> Optional[FaultSpec]:
    """The fault MEGATRON_HETERO_FAULT asks for, or None (parsed once per distinct value)."""
    return _spec_of(os.environ.get(FAULT_ENV, ""))


def fault_point(phase: str, rank: int, iteration: Optional[int] = None, when: bool = True) -> None:
    """Fail here if the active fault names `phase`, `rank` and (when it gives one) `iteration`, and
    `when` holds; otherwise return at once. `kill` does not return; `raise` raises InjectedFault."""
    if phase not in PHASES:
        raise ValueError(f"unknown fault phase {phase!r}; phases are {list(PHASES)}")
    spec = active_fault()
    if spec is None or not when or spec.phase != phase or spec.rank != rank or phase in _fired:
        return
    if spec.iteration is not None and spec.iteration != iteration:
        return
    _fired.add(phase)
    where = f"{phase} on rank {rank}" + (f", iteration {iteration}" if iteration is not None else "")
    log = os.environ.get(FAULT_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(
                json.dumps(
                    {"phase": phase, "rank": rank, "kind": spec.kind, "iteration": iteration, "time": time.time()}
                )
                + "\n"
            )
    if spec.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # pragma: no cover - SIGKILL is not deliverable late; never reached
    raise InjectedFault(f"injected fault ({FAULT_ENV}={spec}): raised at {where}")


def named_collective(describe: Callable[..., str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a function that is collective over the world (every rank calls it together, e.g.
    a checkpoint save): a failure is re-raised as `runtime.step.CollectiveError` naming
    `describe(*args, **kwargs)` and this rank. An InjectedFault and a CollectiveError, which already
    say where, pass unchanged. Importing this module stays free of torch."""
    import functools

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            from megatron_hetero.runtime.step import CollectiveError

            try:
                return fn(*args, **kwargs)
            except (InjectedFault, CollectiveError):
                raise
            except Exception as exc:  # noqa: BLE001 - a peer died or timed out: say where
                import torch.distributed as dist

                rank = dist.get_rank() if dist.is_initialized() else 0
                first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
                raise CollectiveError(
                    f"{describe(*args, **kwargs)}: rank {rank} failed: {type(exc).__name__}: {first}"
                ) from exc

        return run

    return wrap
