"""Megatron-style iteration lines and a terminal progress line, written by global rank 0.

Every `log_interval` iterations one line (averages over the interval where Megatron averages):

     iteration    4/10 | lm loss 4.512345 | consumed samples: 32 | elapsed time per iteration (ms): 41.2 |
     learning rate: 1.000000E-03 | grad norm: 0.8123 | tokens per second: 6213.6 | global batch size: 8 |

(one line; the learning rate is the one the iteration ran at, the grad norm the whole model's: the
modules' norms combined before clipping). With --log-throughput the line has Megatron's
`throughput per GPU (TFLOP/s/GPU): X (vision V, language L) |` after the step time (the whole
model's TFLOP/s per rank, then each module's: `training/throughput.py`; over an interval, the
interval's FLOPs over its time), with --log-memory the largest rank's resident state and activation
peak (`state bytes per rank: max S (rank r: params P, grads G, optimizer O) | activation peak bytes
per rank: max A (rank r) |`; every rank's, by module, are in the --log-jsonl records:
`training/run_stats.py`). An iteration whose global batch held no loss token (`no_loss_tokens`: its
loss is NaN) is left out of the loss average and counted (`number of iterations without loss tokens:
N |`). With `progress` (stdout is a terminal) a carriage-return line shows the iterations in between.
Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

BAR = 24


def format_line(total: int, recs: list[dict], global_batch: int) -> str:
    last = recs[-1]
    # iterations whose global batch held no loss token have no loss (NaN): averaged over the others
    losses = [r["loss"] for r in recs if not r.get("no_loss_tokens")]
    loss = sum(losses) / len(losses) if losses else float("nan")
    step_ms = 1e3 * sum(r["step_time_s"] for r in recs) / len(recs)
    parts = [
        f" iteration {last['iteration']:>4}/{total} | lm loss {loss:.6f} |",
        f"consumed samples: {last['consumed_samples']} |",
        f"elapsed time per iteration (ms): {step_ms:.1f} |",
    ]
    if last.get("tflops_per_rank") is not None:
        parts.append(throughput_text(recs))
    if last.get("lr") is not None:
        parts.append(f"learning rate: {last['lr']:.6E} |")
    if last.get("loss_scale") is not None:  # --fp16, as Megatron logs it
        parts.append(f"loss scale: {last['loss_scale']:.1f} |")
    if last.get("grad_norm") is not None:
        parts.append(f"grad norm: {last['grad_norm']:.4f} |")
    skipped = sum(1 for r in recs if r.get("skipped"))
    if skipped:
        parts.append(f"number of skipped iterations: {skipped:3d} |")
    empty = len(recs) - len(losses)
    if empty:
        parts.append(f"number of iterations without loss tokens: {empty:3d} |")
    tokens = sum(r["tokens"] for r in recs)
    seconds = sum(r["step_time_s"] for r in recs)
    parts.append(f"tokens per second: {tokens / seconds if seconds > 0 else 0.0:.1f} |")
    if last.get("state_bytes") is not None and last.get("activation_peak_bytes") is not None:  # --log-memory
        parts.append(memory_text(last))
    parts.append(f"global batch size: {global_batch} |")
    return " ".join(parts)


def _harmonic(values: list[float]) -> float:
    """The interval's figure from per-iteration TFLOP/s of the same FLOPs: n / sum(1 / x)."""
    return len(values) / sum(1.0 / v for v in values) if all(v > 0 for v in values) else 0.0


def format_tflops(x: float) -> str:
    """Megatron's one decimal, or six below 1 TFLOP/s (small models, CPUs)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.6f}"


def throughput_text(recs: list[dict]) -> str:
    """`throughput per GPU (TFLOP/s/GPU): X (module Y, ...) |` over the interval's records."""
    text = f"throughput per GPU (TFLOP/s/GPU): {format_tflops(_harmonic([r['tflops_per_rank'] for r in recs]))}"
    modules = recs[-1].get("tflops_per_rank_per_module") or {}
    if modules:
        each = ", ".join(
            f"{m} {format_tflops(_harmonic([r['tflops_per_rank_per_module'][m] for r in recs]))}" for m in modules
        )
        text += f" ({each})"
    return text + " |"


def memory_maxima(rec: dict[str, Any]) -> dict[str, Any]:
    """The largest figures over ranks of a record's memory fields: `state` (bytes, rank) of the rank
    with the most resident state (None without `state_bytes`), `state_parts` its params/grads/optimizer,
    `state_per_module` each module's largest rank; `activations` (bytes, rank) and
    `activations_per_module` the same for the activation peaks (None without --log-memory)."""
    out: dict[str, Any] = {"state": None, "state_parts": {}, "state_per_module": {}}
    out.update(activations=None, activations_per_module={})
    state = rec.get("state_bytes")
    if state:
        totals = {r: sum(sum(parts.values()) for parts in mods.values()) for r, mods in state.items()}
        top = max(totals, key=lambda r: (totals[r], -int(r)))
        out["state"] = (totals[top], int(top))
        out["state_parts"] = {
            k: sum(parts[k] for parts in state[top].values()) for k in ("params", "grads", "optimizer")
        }
        for mods in state.values():
            for m, parts in mods.items():
                out["state_per_module"][m] = max(out["state_per_module"].get(m, 0), sum(parts.values()))
    acts, totals_act = rec.get("activation_peak_bytes"), rec.get("activation_peak_bytes_total")
    if acts and totals_act:
        top = max(totals_act, key=lambda r: (totals_act[r], -int(r)))
        out["activations"] = (totals_act[top], int(top))
        for mods in acts.values():
            for m, v in mods.items():
                out["activations_per_module"][m] = max(out["activations_per_module"].get(m, 0), v)
    return out


def memory_text(rec: dict[str, Any]) -> str:
    """`state bytes per rank: max S (rank r: params P, grads G, optimizer O) | activation peak bytes per
    rank: max A (rank r) |` (the record's `memory_maxima`)."""
    mx = memory_maxima(rec)
    (state, srank), parts = mx["state"], mx["state_parts"]
    text = (
        f"state bytes per rank: max {state} (rank {srank}: params {parts['params']}, grads {parts['grads']}, "
        f"optimizer {parts['optimizer']}) |"
    )
    if mx["activations"] is not None:
        act, arank = mx["activations"]
        text += f" activation peak bytes per rank: max {act} (rank {arank}) |"
    return text


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
