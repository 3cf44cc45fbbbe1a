"""Execution traces: `train --trace FILE` writes one Chrome/Perfetto trace of every rank; every
micro-batch of every module has its forward and backward span on every rank that runs it."""

from __future__ import annotations

import json

import pytest

COLOCATED = (
    "placement: colocated\nmodules:\n  vision: {dp: 4}\n  language: {pp: 2, dp: 2}\nedges: [vision -> language]\n"
)
DISJOINT = "placement: disjoint\nmodules:\n  vision: {dp: 2}\n  language: {pp: 2}\nedges: [vision -> language]\n"
SIZES = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "16",
    "--encoder-num-layers",
    "1",
    "--encoder-hidden-size",
    "16",
    "--encoder-num-attention-heads",
    "2",
    "--encoder-tokens",
    "4",
    "--global-batch-size",
    "4",
]


def _spans(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _train(tmp_path, text: str, iters: int = 2, *extra: str) -> dict:
    from megatron_hetero.cli import main

    layout = tmp_path / "layout.yaml"
    layout.write_text(text)
    trace = tmp_path / "trace.json"
    assert (
        main(
            [
                "train",
                "--hetero-layout",
                str(layout),
                "--train-iters",
                str(iters),
                "--trace",
                str(trace),
                *SIZES,
                *extra,
            ]
        )
        == 0
    )
    return json.loads(trace.read_text())


def _check_common(doc: dict, world: int) -> None:
    spans = _spans(doc)
    assert doc["otherData"]["ranks"] == list(range(world))
    assert {e["pid"] for e in spans} == set(range(world))
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(world)}
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0 and e["cat"] in doc["otherData"]["kinds"], e
    # every rank reduces gradients and steps its optimizer once per step
    for r in range(world):
        assert any(e["cat"] == "grad-reduce" for e in spans if e["pid"] == r)
        assert any(e["cat"] == "optimizer" for e in spans if e["pid"] == r)


def _count(spans, rank: int, kind: str, module: str, mb: int) -> int:
    return sum(
        1
        for e in spans
        if e["pid"] == rank and e["cat"] == kind and e["args"].get("module") == module and e["args"].get("mb") == mb
    )


@pytest.mark.timeout(300)
def test_colocated_trace_has_every_micro_batch_of_every_module_on_every_rank(tmp_path):
    iters = 2
    doc = _train(tmp_path, COLOCATED, iters)
    _check_common(doc, 4)
    spans = _spans(doc)
    micro = 4 // 2  # global batch 4 over the language model's dp 2, micro-batch size 1
    for r in range(4):
        for d in ("forward", "backward"):
            # the encoder runs its whole DP share as one micro-batch (phase 1 / phase 3)
            assert _count(spans, r, f"encoder-{d}", "vision", 0) == iters, (r, d)
            for mb in range(micro):
                assert _count(spans, r, f"llm-{d}", "language", mb) == iters, (r, d, mb)
        bnd = [e for e in spans if e["pid"] == r and e["cat"] == "boundary"]
        assert sorted(e["args"]["direction"] for e in bnd) == ["backward"] * iters + ["forward"] * iters
        assert all(e["args"]["edge"] == "vision->language" for e in bnd)
        # the language model's 1F1B over pp 2 waits in Megatron's pipeline send/receive
        assert any(e["cat"] == "wait" and e["name"].startswith("language pipeline") for e in spans if e["pid"] == r)
    # backward spans nest inside the step: each starts after its forward ends
    for r in range(4):
        for mb in range(micro):
            f = [e for e in spans if e["pid"] == r and e["cat"] == "llm-forward" and e["args"]["mb"] == mb]
            b = [e for e in spans if e["pid"] == r and e["cat"] == "llm-backward" and e["args"]["mb"] == mb]
            for fe, be in zip(f, b):
                assert be["ts"] >= fe["ts"] + fe["dur"]
    assert sum(e["args"]["bytes_sent"] for e in spans if e["cat"] == "boundary") > 0
    # ... and `timeline` draws one row per traced rank
    pytest.importorskip("matplotlib")
    from megatron_hetero.report.draw import draw_timeline

    drawn = draw_timeline(doc, tmp_path / "timeline.png")
    assert drawn["ranks"] == doc["otherData"]["ranks"] == [0, 1, 2, 3]
    assert drawn["bars"] == len(spans)


@pytest.mark.timeout(300)
def test_disjoint_trace_has_every_micro_batch_and_labelled_batches(tmp_path):
    iters = 2
    doc = _train(tmp_path, DISJOINT, iters, "--micro-batch-size", "2")
    _check_common(doc, 4)
    spans = _spans(doc)
    micro = 2  # global batch 4 over the language model's dp 1 in micro-batches of 2 (1 row per vision DP rank)
    owners = {0: ("vision", "encoder"), 1: ("vision", "encoder"), 2: ("language", "llm"), 3: ("language", "llm")}
    for r, (module, role) in owners.items():
        for d in ("forward", "backward"):
            for mb in range(micro):
                assert _count(spans, r, f"{role}-{d}", module, mb) == iters, (r, d, mb)
        comm = [e for e in spans if e["pid"] == r and e["cat"] == "comm"]
        assert comm and all(e["args"]["actions"] and e["name"] for e in comm)
        waits = [e for e in spans if e["pid"] == r and e["cat"] == "wait"]
        assert len(waits) == len(comm)  # one wait per batch, inside it
        for c, w in zip(sorted(comm, key=lambda e: e["ts"]), sorted(waits, key=lambda e: e["ts"])):
            assert c["ts"] <= w["ts"] and w["ts"] + w["dur"] <= c["ts"] + c["dur"] + 1e-3

    # one clock for all ranks: language/0 starts micro-batch mb only after vision finished it, and
    # vision starts the backward of mb only after language/0 finished its backward of mb
    def one(rank, kind, mb, step):
        return sorted(
            (e for e in spans if e["pid"] == rank and e["cat"] == kind and e["args"]["mb"] == mb), key=lambda e: e["ts"]
        )[step]

    for step in range(iters):
        for mb in range(micro):
            for v in (0, 1):
                f_v, f_l = one(v, "encoder-forward", mb, step), one(2, "llm-forward", mb, step)
                assert f_v["ts"] + f_v["dur"] <= f_l["ts"], (step, mb, v)
                b_l, b_v = one(2, "llm-backward", mb, step), one(v, "encoder-backward", mb, step)
                assert b_l["ts"] + b_l["dur"] <= b_v["ts"], (step, mb, v)
    # the boundary's bytes: what vision sends in forward is what language's first stage receives
    sent = sum(e["args"]["bytes_sent"] for e in spans if e["cat"] == "wait" and e["pid"] in (0, 1))
    recv = sum(e["args"]["bytes_recv"] for e in spans if e["cat"] == "wait" and e["pid"] == 2)
    assert sent > 0 and recv > 0


def test_null_tracer_is_free_and_shared():
    from megatron_hetero.runtime.config import RuntimeConfig, runtime_config
    import dataclasses

    from megatron_hetero.runtime.trace import NULL_TRACER, Tracer
    from megatron_hetero.training.setup import JobConfig
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.module_state import OptimConfig

    assert RuntimeConfig().tracer is NULL_TRACER
    calls = []
    a = NULL_TRACER.span("comm", lambda: calls.append("name"), lambda: calls.append("args"))
    b = NULL_TRACER.span("wait", "x")
    assert a is b
    with a:
        pass
    assert calls == []  # lazily given names and args are never evaluated
    job = JobConfig(spec=LlavaSpec(), global_batch_size=8, micro_batch_size=1, train_iters=1, optim=OptimConfig())
    assert runtime_config(job, 0).tracer is NULL_TRACER  # --trace not given
    traced = runtime_config(dataclasses.replace(job, trace="t.json"), 3).tracer
    assert isinstance(traced, Tracer) and traced.path == "t.json" and traced.rank == 3


def test_tracer_waits_for_the_device_before_every_clock_reading(monkeypatch):
    """On a GPU a span must end when the device's work ends: the recording tracer calls its `sync`
    before each clock reading, in spans and in the backward hooks alike; on CPU it has none."""
    import time

    import torch

    from megatron_hetero.compat import device as dev
    from megatron_hetero.runtime.trace import Tracer, recording_tracer

    readings: list[str] = []
    clock = iter(range(10**9, 2 * 10**9, 1000))
    monkeypatch.setattr(time, "time_ns", lambda: (readings.append("clock"), next(clock))[1])
    t = Tracer(0, sync=lambda: readings.append("sync"))
    with t.span("llm-forward", "F0"):
        x = torch.ones(3, requires_grad=True)
        y = (x * 2).sum()
    t.mark_backward(y, "llm-backward", "B0")
    y.backward()
    assert [s[0] for s in t.spans] == ["llm-forward", "llm-backward"]
    assert readings == ["sync", "clock"] * 4  # every clock reading waits first: two spans, two ends each
    assert recording_tracer(0).sync is None  # CPU: nothing is queued, nothing waits

    synced = []
    monkeypatch.setattr(dev, "get_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    tracer = recording_tracer(2, "t.json")
    tracer.now()
    assert tracer.sync is not None and synced == [torch.device("cuda", 1)]


def test_tracer_records_spans_hooks_and_merges_ranks():
    import torch

    from megatron_hetero.runtime.trace import Tracer, chrome_trace, host_offsets

    t = Tracer(1)
    with t.span("llm-forward", lambda: "F0", lambda: {"mb": 0}):
        x = torch.ones(3, requires_grad=True)
        y = (x * 2).sum()
    t.mark_backward(y, "llm-backward", "B0", {"mb": 0})
    t.mark_backward(torch.ones(2), "llm-backward", "never", {})  # no grad: nothing
    y.backward()
    kinds = [s[0] for s in t.spans]
    assert kinds == ["llm-forward", "llm-backward"]
    (_, _, f0, f1, _), (_, _, b0, b1, _) = t.spans
    assert f0 <= f1 <= b0 <= b1
    other = {"rank": 0, "host": "a", "spans": [("wait", "w", f0 - 1000, f0, {})]}
    doc = chrome_trace([t.payload(), other])
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0 and {e["pid"] for e in xs} == {0, 1}
    # ranks on another host are shifted by the difference of their readings after a barrier
    assert host_offsets([(0, "a", 100), (1, "a", 105), (2, "b", 50), (3, "b", 52)]) == {0: 0, 1: 0, 2: 50, 3: 50}
