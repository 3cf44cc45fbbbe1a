"""One line for a failed command: the cause a user can act on and what to do, with the full
tracebacks in a log file (or on stderr with `--debug`).

A failure of many ranks arrives as one text per rank (`runtime.launcher.RankFailure.failures`: each
a formatted traceback, or 'rank R died without reporting a result: exit code ...'). Most of them
are consequences (a peer's connection closed, a wait gave up); `root_cause` picks the first rank
whose last line is not one, and `advice` says what to do about the causes users meet (a full disk,
a directory they cannot write, a rank that was killed). Pure: no torch.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

#: Last lines that only report another rank's failure.
_CONSEQUENCES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "gave up",
    "timed out",
    "could not post",
    "connection refused",
)
#: The log file a failed command writes its full tracebacks to.
LOG_NAME = "megatron-hetero-error.log"


def last_line(text: str) -> str:
    """The final line of a traceback (the exception, 'Type: message'); for our own exception types
    only the message (it names what failed); a one-line text as it is."""
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    line = lines[-1] if lines else ""
    m = re.match(r"^megatron_hetero(?:\.\w+)*\.\w+: (.*)$", line)
    return m.group(1) if m else line


def _is_consequence(line: str) -> bool:
    low = line.lower()
    return any(c in low for c in _CONSEQUENCES)


def root_cause(failures: Sequence[tuple[int, str]]) -> tuple[int, str]:
    """(rank, last line) of the failure that explains the others: the first in arrival order whose
    last line is not a consequence of another rank's failure (else the first)."""
    assert failures, "no failures"
    for rank, text in failures:
        line = last_line(text)
        if not _is_consequence(line):
            return rank, line
    rank, text = failures[0]
    return rank, last_line(text)


def advice(cause: str, save: Optional[str] = None) -> str:
    """What to do about `cause` (a last line), or '' when there is nothing better than the log."""
    where = f" under {save}" if save else ""
    if "No space left on device" in cause or "Errno 28" in cause:
        return (
            f"free space on the file system{where} or give --save a directory with room "
            "(the last complete checkpoint is untouched), then resume with --load"
        )
    if "Permission denied" in cause or "Errno 13" in cause:
        return "make that path writable, or choose another one"
    if "signal SIGKILL" in cause:
        return (
            "the rank was killed (SIGKILL: often the kernel's out-of-memory killer); lower the batch or "
            "model size or use more ranks"
        )
    if "died without reporting" in cause:
        return "its own output above says why it stopped"
    return ""


def write_log(text: str, dirs: Iterable[Optional[str]]) -> Optional[Path]:
    """Write `text` to `LOG_NAME` in the first of `dirs` that takes it, else to a new file in the
    system's temporary directory; None when nothing could be written (a full disk everywhere)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    body = f"{stamp}\n{text.rstrip()}\n"
    for d in dirs:
        if not d:
            continue
        try:
            path = Path(d) / LOG_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(body)
            return path
        except OSError:
            continue
    try:
        with tempfile.NamedTemporaryFile("w", prefix="megatron-hetero-error-", suffix=".log", delete=False) as f:
            f.write(body)
            return Path(f.name)
    except OSError:
        return None


def rank_failure_line(failures: Sequence[tuple[int, str]], killed: Sequence[int], save: Optional[str]) -> str:
    """The line of a run whose ranks failed: the root rank and cause, what to do."""
    rank, cause = root_cause(failures)
    others = sorted({r for r, _ in failures} - {rank})
    line = cause if re.search(rf"\brank {rank}\b", cause) else f"rank {rank}: {cause}"
    todo = advice(cause, save)
    extra = []
    if others:
        extra.append(f"ranks {others} stopped after it")
    if killed:
        extra.append(f"ranks {sorted(killed)} were killed")
    return line + (f" ({'; '.join(extra)})" if extra else "") + (f"; {todo}" if todo else "")
