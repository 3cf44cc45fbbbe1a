"""Megatron-style iteration lines and a terminal progress line, written by global rank 0.

Every `log_interval` iterations one line (averages over the interval where Megatron averages):

     iteration    4/10 | lm loss 4.512345 | consumed samples: 32 | elapsed time per iteration (ms): 41.2 |
     learning rate: 1.000000E-03 | grad norm: 0.8123 | tokens per second: 6213.6 | global batch size: 8 |

(one line; the learning rate is the one the iteration ran at, the grad norm the whole model's: the
modules' norms combined before clipping). With `progress` (stdout is a terminal) a carriage-return
line shows the iterations in between. Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Callable, Optional

BAR = 24


def format_line(total: int, recs: list[dict], global_batch: int) -> str:
    last = recs[-1]
    loss = sum(r["loss"] for r in recs) / len(recs)
    step_ms = 1e3 * sum(r["step_time_s"] for r in recs) / len(recs)
    parts = [
        f" iteration {last['iteration']:>4}/{total} | lm loss {loss:.6f} |",
        f"consumed samples: {last['consumed_samples']} |",
        f"elapsed time per iteration (ms): {step_ms:.1f} |",
    ]
    if last.get("lr") is not None:
        parts.append(f"learning rate: {last['lr']:.6E} |")
    if last.get("loss_scale") is not None:  # --fp16, as Megatron logs it
        parts.append(f"loss scale: {last['loss_scale']:.1f} |")
    if last.get("grad_norm") is not None:
        parts.append(f"grad norm: {last['grad_norm']:.4f} |")
    skipped = sum(1 for r in recs if r.get("skipped"))
    if skipped:
        parts.append(f"number of skipped iterations: {skipped:3d} |")
    tokens = sum(r["tokens"] for r in recs)
    seconds = sum(r["step_time_s"] for r in recs)
    parts.append(f"tokens per second: {tokens / seconds if seconds > 0 else 0.0:.1f} |")
    parts.append(f"global batch size: {global_batch} |")
    return " ".join(parts)


def format_progress(done: int, total: int, loss: float) -> str:
    filled = BAR * done // max(total, 1)
    return f"\r[{'#' * filled}{'.' * (BAR - filled)}] {done}/{total} lm loss {loss:.4f}"


class IterationLog:
    """Collects records and writes lines through `write` (text; None: nothing is written)."""

    def __init__(
        self, write: Optional[Callable[[str], None]], total: int, global_batch: int, interval: int, progress: bool
    ) -> None:
        self.write, self.total, self.global_batch = write, total, global_batch
        self.interval, self.progress = interval, progress
        self.pending: list[dict] = []
        self.bar_shown = False

    def record(self, rec: dict) -> None:
        if self.write is None:
            return
        self.pending.append(rec)
        text = ""
        if self.interval and (rec["iteration"] % self.interval == 0 or rec["iteration"] == self.total):
            if self.bar_shown:
                text += "\r\033[K"
                self.bar_shown = False
            text += format_line(self.total, self.pending, self.global_batch) + "\n"
            self.pending = []
        elif self.progress:
            text += format_progress(rec["iteration"], self.total, rec["loss"])
            self.bar_shown = True
        if text:
            self.write(text)

    def close(self) -> None:
        if self.write is not None and self.bar_shown:
            self.write("\n")
            self.bar_shown = False
