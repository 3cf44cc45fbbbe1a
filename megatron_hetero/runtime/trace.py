"""Per-rank execution traces of the schedules, merged into one Chrome/Perfetto trace file.

A `Tracer` records "complete" spans (`ph: "X"`) on its rank; the schedules open them around the
calls they already make (`with config.tracer.span(kind, name, args): ...`). When tracing is off the
schedules hold `NULL_TRACER`, whose `span()` returns one shared `nullcontext` and evaluates nothing
(names and arguments may be callables, evaluated only by a recording tracer, at the span's end).

Span kinds (`cat`, the colours of `megatron-hetero timeline`): see `KINDS`.

Backward of a micro-batch that autograd runs inside someone else's call (Megatron's
`backward_step` in the colocated language phase; the last encoder stage's backward behind the
colocated boundary's backward) is measured with autograd hooks (`mark_backward`): a hook on the
micro-batch's output fires when its gradient is computed (the start of its backward) and queues an
engine callback that runs when that backward pass ends (the hook mechanism torch's DDP uses to
finalise gradients). This measures exactly the autograd pass of that output, whatever schedule
function drives it, with no patching of Megatron's internals.

Clock: `time.time_ns()`, the wall clock every process of one host shares, so spans of ranks on one
machine line up without correction. On a GPU the host only queues kernels, so a recording tracer
made by `recording_tracer` waits for the device (`compat.device.device_sync`, a device synchronize
as Megatron's timers do) before it reads the clock at each span's start and end: a span measures the
device's work, not the launches. That costs the overlap of launches with compute while tracing; on
CPU nothing is queued and nothing waits. Ranks on several hosts are aligned when the trace is gathered
(`gather_trace`): after a barrier every rank reads its clock once; each host's events are shifted by
(rank 0's reading - the reading of that host's first rank). The shifts are written into the file.

File format (`write` / `gather_trace`): {"traceEvents": [...], "displayTimeUnit": "ms",
"otherData": {...}}; one process per rank (pid = rank, process name "rank R"), spans on tid 0,
timestamps in microseconds since the earliest event of the run. Each span's `args` carry what it
did (module, stage, micro-batch `mb`, edge, direction, bytes, the actions of a communication batch).

`megatron-hetero train --trace FILE` turns tracing on: the job's `trace` field gives every rank a
recording `Tracer` (`training.setup.JobConfig.runtime_config`).
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

#: Span kinds, in legend order: compute, then data movement, then the step's closing work and waits.
KINDS = (
    "encoder-forward",
    "encoder-backward",
    "llm-forward",
    "llm-backward",
    "boundary",
    "comm",
    "wait",
    "grad-reduce",
    "optimizer",
    "loss-reduce",
    "offload",
    "schedule",
)
#: The blocking methods of Megatron-core's `P2PCommunicator` that its pipeline schedules call (each
#: posts and waits for its sends/receives): the language model's pipeline waits in the colocated phase 2.
MEGATRON_P2P_METHODS = (
    "recv_forward",
    "recv_backward",
    "send_forward",
    "send_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
)

Label = Union[str, Callable[[], str]]
Args = Union[None, dict, Callable[[], dict]]

_NULL_SPAN = nullcontext()


class NullTracer:
    """Tracing off: every method does nothing; `span()` returns one shared nullcontext."""

    enabled = False
    path: Optional[str] = None

    def span(self, kind: str, name: Label, args: Args = None):
        return _NULL_SPAN

    def mark_backward(self, tensor, kind: str, name: Label, args: Args = None) -> None:
        return None

    def wrap_methods(self, obj, names: Iterable[str], kind: str, prefix: str):
        return obj

    def wrap_forward_step(self, forward_step: Callable, role: str, module: str) -> Callable:
        return forward_step


NULL_TRACER = NullTracer()


class _Span:
    __slots__ = ("tracer", "kind", "name", "args", "t0")

    def __init__(self, tracer: "Tracer", kind: str, name: Label, args: Args) -> None:
        self.tracer, self.kind, self.name, self.args = tracer, kind, name, args

    def __enter__(self) -> "_Span":
        self.t0 = self.tracer.now()
        return self

    def __exit__(self, *exc) -> None:
        self.tracer.record(self.kind, self.name, self.t0, self.tracer.now(), self.args)


class Tracer:
    """Tracing on: spans of this rank, as (kind, name, start ns, end ns, args) tuples. `sync`: called
    before every clock reading (the device's wait: `recording_tracer`); None reads the clock alone."""

    enabled = True

    def __init__(self, rank: int, path: Optional[str] = None, sync: Optional[Callable[[], None]] = None) -> None:
        self.rank, self.path, self.sync = rank, path, sync
        self.spans: list[tuple] = []
        self.recording = True

    def now(self) -> int:
        """The clock (ns) once the device's queued work is done (`sync`)."""
        if self.sync is not None:
            self.sync()
        return time.time_ns()

    def stop(self) -> None:
        """Stop recording and drop the spans (a measuring window is over: `train --hetero-autotune`);
        spans still open are not kept, and `enabled` stays True (the wrapped methods keep calling)."""
        self.recording = False
        self.spans = []

    def span(self, kind: str, name: Label, args: Args = None) -> _Span:
        return _Span(self, kind, name, args)

    def record(self, kind: str, name: Label, t0: int, t1: int, args: Args = None) -> None:
        """One finished span (names and args callables are evaluated here)."""
        if not self.recording:
            return
        self.spans.append(
            (kind, name() if callable(name) else name, t0, t1, (args() if callable(args) else args) or {})
        )

    def mark_backward(self, tensor, kind: str, name: Label, args: Args = None) -> None:
        """A span for the backward pass that starts at `tensor` (see module docstring): from the
        moment its gradient is computed to the end of that autograd pass. No-op for a tensor that
        does not require grad."""
        if tensor is None or not getattr(tensor, "requires_grad", False):
            return
        from torch.autograd import Variable

        def hook(grad):
            t0 = self.now()
            Variable._execution_engine.queue_callback(lambda: self.record(kind, name, t0, self.now(), args))

        tensor.register_hook(hook)

    def wrap_methods(self, obj, names: Iterable[str], kind: str, prefix: str):
        """Put a span of `kind`, named 'PREFIX METHOD', around each listed method of the object
        `obj` (instance attributes shadowing the class's: the object's users are unchanged)."""
        for n in names:
            fn = getattr(obj, n, None)
            if fn is None:
                continue

            def traced(*a, _fn=fn, _label=f"{prefix} {n}", **k):
                with self.span(kind, _label):
                    return _fn(*a, **k)

            setattr(obj, n, traced)
        return obj

    def wrap_forward_step(self, forward_step: Callable, role: str, module: str) -> Callable:
        """Megatron's `forward_step_func` with a `ROLE-forward` span around each call and a
        `ROLE-backward` span (`mark_backward`) on the tensor it returns; the i-th call is micro-batch
        i (Megatron's schedules take the data iterator's micro-batches in order)."""
        count = [0]

        def traced(data_iterator, model, *rest):
            mb = count[0]
            count[0] += 1
            args = {"module": module, "mb": mb}
            with self.span(f"{role}-forward", f"{module} F{mb}", args):
                out = forward_step(data_iterator, model, *rest)
            self.mark_backward(out[0], f"{role}-backward", f"{module} B{mb}", args)
            return out

        return traced

    def payload(self) -> dict[str, Any]:
        """What this rank contributes to the merged trace."""
        return {"rank": self.rank, "host": socket.gethostname(), "spans": self.spans}


AnyTracer = Union[Tracer, NullTracer]


def recording_tracer(rank: int, path: Optional[str] = None) -> Tracer:
    """The recording tracer of a training rank: on a GPU it waits for the device before each clock
    reading (`compat.device.device_sync`), on CPU it reads the clock alone."""
    from megatron_hetero.compat.device import device_sync

    return Tracer(rank, path, sync=device_sync())


def kind_of(is_encoder: bool, direction: str) -> str:
    """The span kind of a module's compute: 'encoder-forward', 'llm-backward', ..."""
    return f"{'encoder' if is_encoder else 'llm'}-{direction}"


def wire_args(ops) -> dict[str, Any]:
    """The arguments of a batch's wait span: messages and payload bytes sent and received
    (`runtime.wire.WireOp`s: boundary pieces and pipeline tensors alike)."""
    sent = [op.tensor.numel() * op.tensor.element_size() for op in ops if op.send]
    recv = [op.tensor.numel() * op.tensor.element_size() for op in ops if not op.send]
    return {"sends": len(sent), "recvs": len(recv), "bytes_sent": sum(sent), "bytes_recv": sum(recv)}


def boundary_args(boundary, call) -> dict[str, Any]:
    """The arguments of a colocated boundary call's span, read after the call: its edge, direction,
    and the payload bytes this rank sent (the boundary's `WireStats`, which records one entry per
    call on a rank of either side)."""
    stats = boundary.stats[call.direction]
    sent = stats.per_call[-1] if (call.src or call.dst) and stats.per_call else 0
    return {"edge": call.edge, "direction": call.direction, "bytes_sent": sent, "src": call.src, "dst": call.dst}


def chrome_trace(
    payloads: list[dict[str, Any]], offsets_ns: Optional[dict[int, int]] = None, meta: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """The Chrome/Perfetto document of every rank's payload (`Tracer.payload()`); `offsets_ns`
    {rank: ns} is added to that rank's timestamps (cross-host alignment)."""
    offsets_ns = offsets_ns or {}
    origin = min((s[2] + offsets_ns.get(p["rank"], 0) for p in payloads for s in p["spans"]), default=0)
    events: list[dict[str, Any]] = []
    for p in sorted(payloads, key=lambda p: p["rank"]):
        r, off = p["rank"], offsets_ns.get(p["rank"], 0)
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for kind, name, t0, t1, args in p["spans"]:
            events.append(
                {
                    "name": name,
                    "cat": kind,
                    "ph": "X",
                    "pid": r,
                    "tid": 0,
                    "ts": (t0 + off - origin) / 1e3,
                    "dur": (t1 - t0) / 1e3,
                    "args": args,
                }
            )
    other = {
        "clock": "time.time_ns (wall clock shared by the processes of one host)",
        "origin_ns": origin,
        "ranks": sorted(p["rank"] for p in payloads),
        "hosts": {str(p["rank"]): p.get("host", "") for p in payloads},
        "host_offsets_ns": {str(r): o for r, o in sorted(offsets_ns.items()) if o},
        "kinds": list(KINDS),
    }
    other.update(meta or {})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def host_offsets(readings: list[tuple[int, str, int]]) -> dict[int, int]:
    """{rank: ns to add} from (rank, host, clock reading after a common barrier): 0 on rank 0's
    host; elsewhere rank 0's reading minus the reading of that host's lowest rank."""
    readings = sorted(readings)
    first: dict[str, int] = {}
    for _r, host, t in readings:
        first.setdefault(host, t)
    ref_host, ref_t = readings[0][1], readings[0][2]
    return {r: 0 if host == ref_host else ref_t - first[host] for r, host, _ in readings}


def write(path: Union[str, Path], doc: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def gather_trace(tracer: AnyTracer, meta: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """Collective over the default group when `tracer` records (nothing otherwise): gather every
    rank's spans and clock reading on rank 0, which merges them and writes `tracer.path` (when
    set). Returns the merged document on rank 0, None elsewhere and when tracing is off."""
    if not tracer.enabled:
        return None
    import torch.distributed as dist

    dist.barrier()
    now = time.time_ns()
    mine = dict(tracer.payload(), clock=now)
    world = dist.get_world_size()
    got: Optional[list] = [None] * world if tracer.rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    if tracer.rank != 0:
        return None
    offsets = host_offsets([(p["rank"], p["host"], p["clock"]) for p in got])
    doc = chrome_trace(got, offsets, meta)
    if tracer.path:
        write(tracer.path, doc)
    return doc
