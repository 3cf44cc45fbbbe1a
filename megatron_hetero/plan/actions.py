"""The one action vocabulary of the schedule tables (pure: no torch, no torch.distributed).

Both schedules (the disjoint 1F1B/zero-bubble tables in `schedule.py` and the colocated three-phase
tables in `colocated.py`) name their pipeline messages with the same two types, `Send` and `Recv`,
and spell a direction the same way: "forward" (an activation travels producer -> consumer) or
"backward" (a gradient travels consumer -> producer); boundary calls use the same two words.

* A **stage** is (module, pp index); a **link** a directed stage -> stage connection (inside a module
  stage s -> s+1; for a module edge the producer's last stage -> the consumer's first stage).
* `Send(link, mb, direction)` / `Recv(link, mb, direction)`: micro-batch `mb` over `link`; a forward
  message is sent by `link.src` and received by `link.dst`, a backward one the other way round.
  A one-rank table (colocated) also carries the peer's global rank (`peer_rank`, computed in plan/ so
  the runtime never recomputes rank arithmetic) and the tensor's batch rows (`rows`).
* `Forward`, `Backward`, `WeightGrad`: the compute of one micro-batch on one stage (the disjoint
  tables; the colocated tables' compute actions are in `colocated.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FORWARD = "forward"
BACKWARD = "backward"
DIRECTIONS = (FORWARD, BACKWARD)


@dataclass(frozen=True, order=True)
class Stage:
    """One pipeline stage of one module: (module name, pp index). Printed as 'language/0'."""

    module: str
    pp: int

    def __str__(self) -> str:
        return f"{self.module}/{self.pp}"


@dataclass(frozen=True, order=True)
class Link:
    """A directed stage -> stage connection (inside a module, or the module edge's end stages)."""

    src: Stage
    dst: Stage

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class Forward:
    """Run the forward of micro-batch `mb` on `stage`."""

    stage: Stage
    mb: int

    def __str__(self) -> str:
        return f"Forward mb {self.mb}"

    def short(self) -> str:
        return f"F{self.mb}"


@dataclass(frozen=True)
class Backward:
    """Run the backward of micro-batch `mb` on `stage`."""

    stage: Stage
    mb: int

    def __str__(self) -> str:
        return f"Backward mb {self.mb}"

    def short(self) -> str:
        return f"B{self.mb}"


@dataclass(frozen=True)
class WeightGrad:
    """Zero-bubble tables only: run the weight-gradient pass of micro-batch `mb` on `stage` (the
    `Backward` before it computed only the gradient of the stage's inputs)."""

    stage: Stage
    mb: int

    def __str__(self) -> str:
        return f"WeightGrad mb {self.mb}"

    def short(self) -> str:
        return f"W{self.mb}"


def check_direction(direction: str) -> None:
    """ValueError unless `direction` is "forward" or "backward"."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {list(DIRECTIONS)}, got {direction!r}")


@dataclass(frozen=True)
class _Message:
    """Micro-batch `mb` over `link` in `direction`; `peer_rank`/`rows`: see the module docstring."""

    link: Link
    mb: int
    direction: str
    peer_rank: Optional[int] = None
    rows: Optional[int] = None

    def __post_init__(self) -> None:
        check_direction(self.direction)

    @property
    def forward(self) -> bool:
        """An activation (True) or a gradient (False)."""
        return self.direction == FORWARD

    @property
    def module(self) -> str:
        """The module of the stage that executes this action."""
        return self.stage.module

    @property
    def stage(self) -> Stage:  # pragma: no cover - defined by Send and Recv
        raise NotImplementedError

    @property
    def peer(self) -> Stage:  # pragma: no cover - defined by Send and Recv
        raise NotImplementedError

    def _rank(self, word: str) -> str:
        return "" if self.peer_rank is None else f" {word} r{self.peer_rank}"


@dataclass(frozen=True)
class Send(_Message):
    """Send (asynchronously) micro-batch `mb` over `link`: "forward" = activation src -> dst (run by
    link.src), "backward" = gradient dst -> src (run by link.dst)."""

    @property
    def stage(self) -> Stage:
        """The stage that executes this send."""
        return self.link.src if self.forward else self.link.dst

    @property
    def peer(self) -> Stage:
        """The stage that receives it."""
        return self.link.dst if self.forward else self.link.src

    def __str__(self) -> str:
        return f"Send {self.direction} {self.link} mb {self.mb}{self._rank('to')}"

    def short(self) -> str:
        return f"s{'a' if self.forward else 'g'}{self.mb}>{self.peer}"


@dataclass(frozen=True)
class Recv(_Message):
    """Receive (blocking) micro-batch `mb` over `link`: "forward" = activation, run by link.dst;
    "backward" = gradient, run by link.src."""

    @property
    def stage(self) -> Stage:
        """The stage that executes this receive."""
        return self.link.dst if self.forward else self.link.src

    @property
    def peer(self) -> Stage:
        """The stage that sends it."""
        return self.link.src if self.forward else self.link.dst

    def __str__(self) -> str:
        return f"Recv {self.direction} {self.link} mb {self.mb}{self._rank('from')}"

    def short(self) -> str:
        return f"r{'a' if self.forward else 'g'}{self.mb}<{self.peer}"


COMPUTE = (Forward, Backward, WeightGrad)
MESSAGES = (Send, Recv)
