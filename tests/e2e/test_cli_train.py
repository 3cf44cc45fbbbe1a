"""End-to-end `megatron-hetero train` runs as a user starts them: real subprocesses (`python -m
megatron_hetero.cli` and `python -m megatron_hetero`), and the same CLI entry called in this process
where a test runs several jobs (the ranks are forked from it either way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ROOT / "examples" / "layouts"


def _train(
    tmp_path: Path, layout: str, *extra: str, module: str = "megatron_hetero.cli"
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log = tmp_path / f"{Path(layout).stem}.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "train",
            "--hetero-layout",
            str(LAYOUTS / layout),
            "--train-iters",
            "3",
            "--log-jsonl",
            str(log),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, records


@pytest.mark.timeout(600)
def test_train_cli_same_losses_heterogeneous_and_homogeneous(tmp_path):
    het, het_rec = _train(tmp_path, "colocated_fan_in.yaml", "--nproc-per-node", "8")
    assert het.returncode == 0, het.stderr[-3000:]
    hom, hom_rec = _train(tmp_path, "homogeneous.yaml", module="megatron_hetero")  # python -m megatron_hetero
    assert hom.returncode == 0, hom.stderr[-3000:]
    # zip stops at the shorter list: both logs must hold every iteration before they are compared
    assert len(het_rec) == len(hom_rec) == 3, (len(het_rec), len(hom_rec))
    assert [r["iteration"] for r in het_rec] == [r["iteration"] for r in hom_rec] == [1, 2, 3]
    for a, b in zip(het_rec, hom_rec):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
        assert a["step_time_s"] > 0 and set(a["resident_bytes"]) == {str(r) for r in range(8)}
    assert het_rec[-1]["loss"] < het_rec[0]["loss"]  # it trains
    assert "iteration    3/3 | lm loss" in het.stdout
    assert "| consumed samples: 24 |" in het.stdout and "| learning rate: 1.000000E-03 |" in het.stdout
    assert "\r[" not in het.stdout  # no progress line when stdout is not a terminal
    for r in het_rec:
        assert r["lr"] == 1e-3 and r["grad_norm"] > 0 and set(r["grad_norm_per_module"]) == {"vision", "language"}
        assert r["consumed_samples"] == 8 * r["iteration"] and r["tokens_per_s"] > 0


@pytest.mark.timeout(120)
def test_train_cli_rejects_bad_layout_before_starting(tmp_path, capsys):
    """A bad layout exits 2 before torch or Megatron-core is imported (`train.precheck`); a job the
    layout cannot run (the batch) exits 2 before any rank starts."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "placement: colocated\nmodules:\n  vision: {dp: 8}\n  language: {tp: 2, pp: 2, dp: 3}\n"
        "edges: [vision -> language]\n"
    )
    code = (
        "import sys; from megatron_hetero.cli import main; rc = main(sys.argv[1:]); "
        "print('imported torch' if 'torch' in sys.modules else 'no torch'); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "--hetero-layout", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "module language: tp(2)*cp(1)*pp(2)*dp(3)=12 != ranks 0-7 (8)" in proc.stderr
    assert proc.stdout.strip() == "no torch"
    from megatron_hetero.cli import main

    rc = main(["train", "--hetero-layout", str(LAYOUTS / "colocated_fan_in.yaml"), "--global-batch-size", "6"])
    assert rc == 2
    assert "--global-batch-size 6 is not divisible by dp(8)" in capsys.readouterr().err


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(p.name for p in LAYOUTS.glob("*.yaml")))
def test_every_example_layout_trains_with_defaults(layout, tmp_path, capsys):
    """In-process (the ranks fork from the test process): each example runs with only the layout given
    (default sizes; disjoint layouts get a micro-batch size every module's DP divides)."""
    from megatron_hetero.cli import main

    log = tmp_path / "log.jsonl"
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "64"] if "moe" in layout else []  # ep > 1 needs experts
    assert (
        main(["train", "--hetero-layout", str(LAYOUTS / layout), "--train-iters", "1", "--log-jsonl", str(log), *moe])
        == 0
    ), capsys.readouterr().err[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 1  # --train-iters 1
    assert 4.0 < records[0]["loss"] < 5.5  # ln(128) = 4.85 at initialisation


@pytest.mark.timeout(300)
def test_train_cli_schedule_clip_and_log_interval(tmp_path, capsys):
    """In-process: --lr-warmup-iters / --lr-decay-style / --min-lr / --clip-grad reach every module's
    optimizer; --log-interval 2 prints iterations 2 and 3 (the last), with the interval's mean loss."""
    from megatron_hetero.cli import main

    log = tmp_path / "log.jsonl"
    rc = main(
        [
            "train",
            "--hetero-layout",
            str(LAYOUTS / "disjoint_fan_in.yaml"),
            "--train-iters",
            "3",
            "--lr-warmup-iters",
            "1",
            "--lr-decay-style",
            "linear",
            "--min-lr",
            "1e-4",
            "--clip-grad",
            "0.5",
            "--log-interval",
            "2",
            "--log-jsonl",
            str(log),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["lr"] for r in recs] == pytest.approx([0.0, 1e-3, 1e-3 - 0.5 * (1e-3 - 1e-4)])
    lines = [x for x in out.splitlines() if x.startswith(" iteration")]
    assert [x.split("|")[0].split()[1] for x in lines] == ["2/3", "3/3"]
    assert f"lm loss {(recs[0]['loss'] + recs[1]['loss']) / 2:.6f}" in lines[0]
    assert f"grad norm: {recs[2]['grad_norm']:.4f}" in lines[1]
    rc = main(["train", "--hetero-layout", str(LAYOUTS / "disjoint_fan_in.yaml"), "--lr-warmup-iters", "5"])
    assert rc == 2 and "--lr-warmup-iters 5 must be smaller than the decay iterations 5" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_train_cli_eval_on_digits(tmp_path, capsys):
    """In-process: --eval-interval 2 on the digits evaluates after iterations 2 and 3 (the last) over
    the whole held-out split by default (200 samples: 25 global batches of 8), prints the validation
    lines and writes eval_loss / eval_accuracy into those records; on synthetic data the held-out
    loss has no accuracy. --eval-iters without --eval-interval is refused (exit 2)."""
    from megatron_hetero.cli import main
    from megatron_hetero.data.digits import write_digits_dataset

    data = tmp_path / "digits"
    write_digits_dataset(data)
    log = tmp_path / "log.jsonl"
    common = [
        "train",
        "--hetero-placement",
        "colocated",
        "--hetero-module",
        "vision:dp=2",
        "--hetero-module",
        "language:tp=2",
        "--hetero-edge",
        "vision->language",
        "--seq-length",
        "16",
        "--train-iters",
        "3",
    ]
    rc = main([*common, "--data-path", str(data), "--eval-interval", "2", "--log-jsonl", str(log)])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert ["eval_loss" in r for r in recs] == [False, True, True]
    for r in recs[1:]:
        assert 0 < r["eval_loss"] < 10 and 0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_samples"] == 200
    lines = [x for x in out.splitlines() if x.startswith(" validation")]
    assert len(lines) == 2
    assert lines[0].startswith(
        f" validation loss at iteration 2 | lm loss {recs[1]['eval_loss']:.6f} | "
        f"caption accuracy {recs[1]['eval_accuracy']:.4f} |"
    )
    rc = main([*common, "--eval-interval", "3", "--eval-iters", "1", "--log-jsonl", str(log)])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    rec = [json.loads(line) for line in log.read_text().splitlines()][-1]
    assert 0 < rec["eval_loss"] < 10 and "eval_accuracy" not in rec
    assert " validation loss at iteration 3 | lm loss" in out and "caption accuracy" not in out
    rc = main([*common, "--eval-iters", "2"])
    assert rc == 2 and "--eval-iters 2 needs --eval-interval" in capsys.readouterr().err


def test_bf16_trains_close_to_fp32_in_two_layouts(tmp_path, capsys):
    """--bf16: bf16 parameters and compute, fp32 main weights (Megatron's mixed-precision optimizer).
    The loss falls and stays within 1% of the fp32 run, colocated and disjoint (bf16 has 8 bits of
    mantissa: parity is to that precision, not to 1e-5). In-process (the CLI entry, ranks forked)."""
    from megatron_hetero.cli import main

    runs = {}
    for name, layout, extra in (
        ("fp32", "colocated_fan_out.yaml", ()),
        ("bf16", "colocated_fan_out.yaml", ("--bf16",)),
        ("bf16-disjoint", "disjoint_fan_in.yaml", ("--bf16",)),
    ):
        log = tmp_path / f"{name}.jsonl"
        argv = ["train", "--hetero-layout", str(LAYOUTS / layout), "--train-iters", "4", "--lr", "1e-2"]
        rc = main([*argv, "--log-jsonl", str(log), *extra])
        assert rc == 0, capsys.readouterr().err[-3000:]
        runs[name] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        assert len(runs[name]) == 4
    for name in ("bf16", "bf16-disjoint"):
        assert runs[name][-1] < runs[name][0], runs[name]
        assert max(abs(a - b) / b for a, b in zip(runs[name], runs["fp32"])) < 1e-2, (runs[name], runs["fp32"])
    assert runs["bf16"] != runs["fp32"]  # it did compute in bf16
    # --bf16 with --save/--load: tests/ranks/test_mixed_precision.py


@pytest.mark.timeout(120)
def test_transformer_engine_impl_refused_without_cuda_or_te(capsys):
    """--transformer-impl transformer_engine exits 2 with the reason before any rank starts where CUDA
    or the transformer_engine package is missing (this CPU machine); in-process, no rank is forked."""
    from megatron_hetero.cli import main
    from megatron_hetero.compat import device

    reason = device.transformer_engine_unavailable()
    if reason is None:
        pytest.skip("this machine has CUDA and transformer_engine: the GPU checks run the TE impl")
    rc = main(
        ["train", "--hetero-layout", str(LAYOUTS / "colocated_fan_in.yaml"), "--transformer-impl", "transformer_engine"]
    )
    out, err = capsys.readouterr()
    assert rc == 2, err[-2000:]
    assert "--transformer-impl transformer_engine needs a CUDA GPU and the transformer-engine package" in err
    assert "this machine has no CUDA GPU" in err or "no transformer_engine package" in err
    assert "ranks (" not in out  # the start line is printed only once the job is valid


def test_transformer_engine_impl_keeps_the_cp_refusal():
    """TE attention could run context parallelism, but only the local impl's core attention is
    tried with cp > 1 here: the TE impl with cp > 1 is refused (on a GPU machine too)."""
    import dataclasses

    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.config.model import LlavaSpec
    from megatron_hetero.training.setup import JobConfig, validate_job
    from megatron_hetero.training.setup import JobDraft

    doc = {
        "placement": "colocated",
        "modules": {"vision": {"dp": 2}, "language": {"cp": 2}},
        "edges": ["vision -> language"],
    }
    layout = layout_from_dict(doc, world_size=2)
    job = JobConfig(spec=LlavaSpec(seq_length=64), global_batch_size=2, micro_batch_size=1)
    validate_job(JobDraft(layout, job))  # the local impl runs cp 2
    te = dataclasses.replace(job, spec=dataclasses.replace(job.spec, transformer_impl="transformer_engine"))
    with pytest.raises(ValueError, match=r"module language: cp\(2\) > 1 with --transformer-impl transformer_engine"):
        validate_job(JobDraft(layout, te))
