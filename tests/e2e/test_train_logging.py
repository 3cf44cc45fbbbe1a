"""`train --tensorboard-dir / --wandb-* / --log-throughput / --log-memory` (training/writers.py,
training/run_stats.py, training/memory_log.py): one small run (world 2, colocated vision DP2 +
language TP2, Adam, 3 iterations, evaluated at 2 and 3) writes all of them at once; the TensorBoard
event file and the offline W&B run are read back and compared with the --log-jsonl records and the
iteration lines; the state bytes against a hand count of the tiny model's parameters; the activation
meter against a hand count on a two-layer module; bad input exits 2 before any rank starts."""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

LAYOUT = [
    "--hetero-placement",
    "colocated",
    "--hetero-module",
    "vision:dp=2",
    "--hetero-module",
    "language:tp=2",
    "--hetero-edge",
    "vision->language",
]
# parameters per rank, counted by hand from the tiny model's layers (weights + biases):
# vision (whole on each DP rank): patch embedding 24*32+32, positions 8*32, 2 layers of
# (ln 64, qkv 32*96+96, proj 32*32+32, ln 64, fc1 32*128+128, fc2 128*32+32), final ln 64,
# projector fc1 32*64+64 and fc2 64*64+64
VISION_PARAMS = 800 + 256 + 2 * (64 + 3168 + 1056 + 64 + 4224 + 4128) + 64 + 2112 + 4160
# language (one TP2 shard): embedding 64*64 (half the vocabulary), positions 32*64, 2 layers of
# (ln 128, qkv 64*96+96, proj 32*64+64, ln 128, fc1 64*128+128, fc2 128*64+64), final ln 128,
# output layer 64*64 (half the vocabulary, no bias)
LANGUAGE_PARAMS = 4096 + 2048 + 2 * (128 + 6240 + 2112 + 128 + 8320 + 8256) + 128 + 4096


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The one run: (records, stdout, its folder)."""
    from megatron_hetero.cli import main

    tmp = tmp_path_factory.mktemp("logging")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")  # never the network
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(
                [
                    "train",
                    *LAYOUT,
                    "--train-iters",
                    "3",
                    "--optimizer",
                    "adam",
                    "--eval-interval",
                    "2",
                    "--log-throughput",
                    "--log-memory",
                    "--tensorboard-dir",
                    str(tmp / "tb"),
                    "--log-validation-ppl-to-tensorboard",
                    "--wandb-project",
                    "hetero-test",
                    "--wandb-exp-name",
                    "logging",
                    "--wandb-save-dir",
                    str(tmp / "wandb"),
                    "--log-jsonl",
                    str(tmp / "log.jsonl"),
                ]
            )
    assert rc == 0, err.getvalue()[-3000:]
    records = [json.loads(line) for line in (tmp / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    return records, out.getvalue(), tmp


def _f32(x: float) -> float:
    """What TensorBoard keeps of a scalar (float32, as Megatron's add_scalar writes it)."""
    return float(np.float32(x))


def _expected(rec: dict) -> dict[str, float]:
    """The scalars of one record by Megatron's names, from the jsonl record itself."""
    exp = {
        "lm loss": rec["loss"],
        "learning-rate": rec["lr"],
        "batch-size": 8.0,
        "loss-scale": 1.0,
        "grad-norm": rec["grad_norm"],
        "iteration-time": rec["step_time_s"],  # the merged records' (slowest rank's) time
        "throughput": rec["tflops_per_rank"],
    }
    for m in ("vision", "language"):
        exp[f"grad-norm/{m}"] = rec["grad_norm_per_module"][m]
        exp[f"throughput/{m}"] = rec["tflops_per_rank_per_module"][m]
        exp[f"mem-state-bytes/{m}"] = max(sum(r[m].values()) for r in rec["state_bytes"].values())
        exp[f"mem-activation-peak-bytes/{m}"] = max(r[m] for r in rec["activation_peak_bytes"].values())
    exp["mem-state-bytes"] = max(sum(sum(p.values()) for p in r.values()) for r in rec["state_bytes"].values())
    exp["mem-activation-peak-bytes"] = max(rec["activation_peak_bytes_total"].values())
    if "eval_loss" in rec:
        exp["lm loss validation"] = rec["eval_loss"]
    return exp


def test_tensorboard_event_file_has_the_records_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records, _, tmp = run
    acc = EventAccumulator(str(tmp / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for rec in records:
        for tag, value in _expected(rec).items():
            assert tag in tags, (tag, sorted(tags))
            events = {e.step: e.value for e in acc.Scalars(tag)}
            assert events[rec["iteration"]] == _f32(value), (tag, rec["iteration"], events, value)
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3]  # --tensorboard-log-interval 1
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [8, 16, 24]
    ppl = {e.step: e.value for e in acc.Scalars("lm loss validation ppl")}
    assert ppl == {r["iteration"]: _f32(math.exp(r["eval_loss"])) for r in records if "eval_loss" in r}
    assert sorted(ppl) == [2, 3]


def _wandb_records(path: Path):
    """The protobuf records (W&B's own `wandb_internal_pb2.Record`) of a .wandb file: a 7-byte
    header (':W&B', magic, version) and then LevelDB's log format (32 KiB blocks of chunks with a
    7-byte header: crc, length, type full/first/middle/last). wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            rec = pb.Record()
            rec.ParseFromString(pending + chunk)
            pending = b""
            yield rec
        elif kind in (2, 3):  # first, middle
            pending += chunk


def test_wandb_offline_run_has_the_same_scalars(run):
    records, _, tmp = run
    runs = list((tmp / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # offline: the last rank alone, no network
    (file,) = runs[0].glob("run-*.wandb")
    history: dict[int, dict] = {}
    meta = {}
    for rec in _wandb_records(file):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            history[rec.history.step.num] = row
        elif kind == "run":
            meta = {"project": rec.run.project, "name": rec.run.display_name}
    assert meta == {"project": "hetero-test", "name": "logging"}
    assert sorted(history) == [1, 2, 3]
    for rec in records:
        row = history[rec["iteration"]]
        assert row["samples vs steps"] == rec["consumed_samples"]
        for tag, value in _expected(rec).items():
            assert row[tag] == value, (tag, rec["iteration"], row.get(tag), value)  # JSON doubles: exact
    assert "lm loss validation" not in history[1]


def _line_value(line: str, label: str) -> str:
    return line.split(label, 1)[1].split("|", 1)[0].strip()


def test_line_and_records_carry_throughput_and_memory(run):
    records, stdout, _ = run
    lines = [x for x in stdout.splitlines() if x.startswith(" iteration ")]
    assert len(lines) == 3, stdout[-3000:]
    for line, rec in zip(lines, records):
        # throughput per GPU (TFLOP/s/GPU): whole (vision v, language l), six decimals below 1
        text = _line_value(line, "throughput per GPU (TFLOP/s/GPU): ")
        whole, each = text.split(" (")
        assert float(whole) == pytest.approx(rec["tflops_per_rank"], abs=5e-7) and rec["tflops_per_rank"] > 0
        per = dict(x.split(" ") for x in each.rstrip(")").split(", "))
        for m in ("vision", "language"):
            assert float(per[m]) == pytest.approx(rec["tflops_per_rank_per_module"][m], abs=5e-7)
        # colocated: every module on both ranks, so the whole model's figure is the modules' sum
        assert rec["tflops_per_rank"] == pytest.approx(sum(rec["tflops_per_rank_per_module"].values()), rel=1e-12)
        assert rec["iteration_time_s"] == rec["step_time_s"]
        # the language module's FLOPs by Megatron's formula (tests/pure/test_throughput.py): 169,869,312
        assert rec["tflops_per_rank_per_module"]["language"] == pytest.approx(
            169_869_312 / (rec["step_time_s"] * 2 * 1e12), rel=1e-12
        )
        # state: measured from the tensors, against the hand count (fp32, Adam: two moments per parameter,
        # DDP's gradient buffer as large as the parameters)
        for rank in ("0", "1"):
            for m, n in (("vision", VISION_PARAMS), ("language", LANGUAGE_PARAMS)):
                assert rec["state_bytes"][rank][m] == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
        total = 16 * (VISION_PARAMS + LANGUAGE_PARAMS)
        assert f"state bytes per rank: max {total} (rank 0: params {4 * (VISION_PARAMS + LANGUAGE_PARAMS)}," in line
        for rank, peaks in rec["activation_peak_bytes"].items():
            assert peaks["vision"] > 0 and peaks["language"] > 0
            assert max(peaks.values()) <= rec["activation_peak_bytes_total"][rank] <= sum(peaks.values())
        act = max(rec["activation_peak_bytes_total"].values())
        assert f"activation peak bytes per rank: max {act} (rank " in line


def _predicted() -> list[dict[str, int]]:
    """The memory model's bytes per rank of the fixture's job (`run_stats.predicted_memory`)."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.cli.train_door import job_from_args
    from megatron_hetero.training.run_stats import predicted_memory

    args = build_parser().parse_args(["train", *LAYOUT, "--optimizer", "adam", "--log-memory"])
    layout = layout_from_args(args, world_size=None)
    return predicted_memory(job_from_args(args, layout))


def _assert_memory_prediction(rec: dict, predicted: list[dict[str, int]]) -> None:
    """`memory_bytes` of a merged record: per rank the prediction beside the measured state + peak."""
    assert sorted(rec["memory_bytes"]) == ["0", "1"], rec["memory_bytes"]
    for r, got in rec["memory_bytes"].items():
        p = predicted[int(r)]
        measured = sum(sum(parts.values()) for parts in rec["state_bytes"][r].values())
        measured += rec["activation_peak_bytes_total"][r]
        assert got == {
            "predicted": p["state"] + p["activation"],
            "measured": measured,
            "predicted_state": p["state"],
            "predicted_activation": p["activation"],
        }, (r, got, p)


def test_forked_record_carries_the_memory_prediction(run):
    """The default launcher (forked ranks): the --log-jsonl record's `memory_bytes` is --log-memory's
    prediction vs measured per rank; the state resident per phase is `resident_bytes`."""
    records, _, _ = run
    predicted = _predicted()
    for rec in records:
        _assert_memory_prediction(rec, predicted)
        assert sorted(rec["resident_bytes"]) == ["0", "1"]
        for r, phases in rec["resident_bytes"].items():
            assert phases and all(set(mods) == {"vision", "language"} for mods in phases.values()), phases
            # colocated, nothing offloaded: every phase holds the same state, parameters and gradient
            # buffers at least (Adam's state from the first optimizer step on, its step counters included)
            first = next(iter(phases.values()))
            assert all(mods == first for mods in phases.values()), (r, phases)
            for m, b in rec["state_bytes"][r].items():
                assert b["params"] + b["grads"] <= first[m] <= b["params"] + b["grads"] + b["optimizer"] + 1024


@pytest.mark.timeout(600)
def test_torchrun_record_carries_the_memory_prediction(tmp_path):
    """The same under torchrun (one node, 2 ranks, 2 iterations): global rank 0 gathers every rank's
    records and its --log-jsonl record carries `memory_bytes` with the prediction."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in launch and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_hetero", "train", *LAYOUT, "--optimizer", "adam", "--train-iters", "2"]
    cmd += ["--log-memory", "--log-jsonl", str(log), "--hetero-comm-timeout", "120"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    predicted = _predicted()
    for rec in records:
        _assert_memory_prediction(rec, predicted)
        assert sorted(rec["resident_bytes"]) == ["0", "1"]


def test_activation_meter_counts_saved_tensors_by_hand():
    """A linear layer then a ReLU on a [4, 8] input: autograd saves the input (4*8 floats; the weight
    is not an activation) and the ReLU's output (4*16 floats): 384 bytes at the peak, none after the
    backward; a second step measures the same."""
    import torch

    from megatron_hetero.training.memory_log import ActivationMeter

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    meter = ActivationMeter()
    meter.attach("net", net)
    x = torch.randn(4, 8)
    for _ in range(2):
        with meter.measure():
            y = net(x)
            assert meter.live_bytes("net") == 4 * 8 * 4 + 4 * 16 * 4
            y.sum().backward()
            del y
        assert meter.peaks() == {"net": 384} and meter.total_peak == 384
        assert meter.live_bytes("net") == 0  # the backward freed them


@pytest.mark.parametrize(
    "missing,flags",
    [("tensorboard", ["--tensorboard-dir", "TB"]), ("wandb", ["--wandb-project", "p", "--wandb-save-dir", "WB"])],
)
def test_missing_package_exits_2_before_any_rank(missing, flags, tmp_path, monkeypatch, capsys):
    from megatron_hetero.cli import main

    monkeypatch.setitem(sys.modules, missing, None)  # `import <missing>` raises ImportError
    flags = [str(tmp_path / f) if f in ("TB", "WB") else f for f in flags]
    assert main(["train", *LAYOUT, *flags]) == 2
    err = capsys.readouterr().err
    assert f"needs the `{missing}` package, which is not installed" in err and f"pip install {missing}" in err, err


def test_bad_folders_and_flags_exit_2(tmp_path, capsys):
    from megatron_hetero.cli import main

    afile = tmp_path / "a-file"
    afile.write_text("x")
    cases = [
        (["--tensorboard-dir", str(afile)], f"--tensorboard-dir {afile}: exists and is not a directory"),
        (["--tensorboard-dir", str(afile / "tb")], f"--tensorboard-dir {afile / 'tb'}: {afile} is not a directory"),
        (["--wandb-project", "p", "--wandb-save-dir", str(afile)], f"--wandb-save-dir {afile}: exists and is not"),
        (["--wandb-project", "p"], "--wandb-project needs --wandb-save-dir DIR, or --save DIR"),
        (["--wandb-exp-name", "e"], "--wandb-exp-name e: needs --wandb-project NAME"),
        (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be a positive integer, got 0"),
        (["--log-validation-ppl-to-tensorboard"], "--log-validation-ppl-to-tensorboard needs --tensorboard-dir DIR"),
    ]
    for flags, message in cases:
        assert main(["train", *LAYOUT, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert message in err, (flags, err)
