"""The cost model calibrated from a traced single-device run, and its predicted vs measured per-layer
times on a run of other shapes (`scripts/gpu_check.sh calibrate`).

    python -m megatron_hetero.bench.gpu_calibrate --out calibration.json \\
        [--hardware h200_141gb|PRESET.json] [--bf16] [--steps 8] [--fit NAME=INT,...] [--held-out NAME=INT,...]

Two `megatron-hetero train` runs on one rank (world 1, colocated: the encoder then the language
model), each with a recording tracer (`--trace`: on a GPU every span waits for the device before
it reads the clock): the **fit** run at `FIT`'s sizes and the **held-out** run at `HELD_OUT`'s
(other layers, widths, sequence and image tokens; `--fit`/`--held-out` change them by train's flag
names: `--fit num_layers=2,hidden_size=64`). From each trace, without its first step
(warm-up): the step (median wall time, its noise `StepTimes.noise_s`) and each module's forward +
backward time per step (the busiest rank's self time of its `encoder-*` / `llm-*` spans: its layers,
its embedding or patch input, its head and loss, its data), divided by its layers: the **measured
per-layer time**.

The cost model is the hardware preset's (`--hardware`, default the published H200 figures; on a GPU,
the `preset` check's measured `h200_measured.json`), calibrated to the fit run's trace exactly as
`train --hetero-autotune` calibrates to its measuring window (`planner.autotune.calibrate`). For
both runs the report gives, per module, the per-layer time the **preset** predicts (uncalibrated),
the one the **calibrated** model predicts, and the measured one, with the relative errors
(predicted / measured - 1), and the same for the step. On the fit run the calibrated prediction
equals the measurement by construction; the held-out run is the test of the model: what a
calibration on one shape tells of another. The result is printed, one line per run and module,
and written as JSON (`--out`).

Runs on CPU too (gloo; what the tests run, with tiny sizes): there the preset's figures are a GPU's
and the preset error says only how far this CPU is from one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence
from megatron_hetero.planner.hardware_presets import load_hardware

#: the fit run's model and batch (train's flags by name) on a GPU (bf16): a 4-layer, 1024-wide
#: language model of 1024 tokens and a 2-layer, 1024-wide encoder of 256 tokens, 4 samples per micro-batch
FIT = {
    "num_layers": 4,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "seq_length": 1024,
    "encoder_num_layers": 2,
    "encoder_hidden_size": 1024,
    "encoder_num_attention_heads": 16,
    "encoder_tokens": 256,
    "global_batch_size": 8,
    "micro_batch_size": 4,
}
#: the held-out run's: twice the layers, the language model 2048 wide over 2048 tokens, the encoder at
#: 576 tokens (CLIP-L/14 at 336 px), 2 samples per micro-batch
HELD_OUT = {
    **FIT,
    "num_layers": 8,
    "hidden_size": 2048,
    "seq_length": 2048,
    "encoder_num_layers": 4,
    "encoder_tokens": 576,
    "micro_batch_size": 2,
}
#: the world-1 layout both runs train on
WORLD1_LAYOUT = "placement: colocated\nmodules:\n  vision: {}\n  language: {}\nedges: [vision -> language]\n"
#: the modules as the trace's span kinds and the cost model name them
MODULES = ("encoder", "llm")


def _rel(predicted: float, measured: float) -> Optional[float]:
    """predicted / measured - 1 (None when nothing was measured)."""
    return predicted / measured - 1.0 if measured > 0 else None


def run_report(name: str, doc: dict[str, Any], job, preset, calib) -> dict[str, Any]:
    """One run's part of the report (pure) of the validated `job` (`config.job.Job`) that ran:
    from its trace `doc` (without the first step), per module
    its layers and the measured, preset-predicted and calibrated-predicted forward + backward seconds
    per layer with their errors; the same for the step, with the steps' noise. `preset`: the
    uncalibrated `Profile`; `calib`: the `Calibration` of the fit run."""
    from megatron_hetero.planner import autotune as A
    from megatron_hetero.planner.cost import evaluate
    from megatron_hetero.training.autotune_checks import workload_of
    from megatron_hetero.planner.layout_cost import candidate_for

    wl = workload_of(job)
    cand = candidate_for(job.layout, job.config.spec, job.config.offload_encoder)
    steps = A.step_times_from_trace(doc).drop(1)
    n = len(steps.wall_s)
    before = A.predicted_terms(cand, wl, preset)
    after = A.predicted_terms(cand, wl, calib.profile)
    modules = {}
    for mod, ms in zip(MODULES, (wl.encoder, wl.llm)):
        per_step = [steps.kind_time(i, (f"{mod}-forward", f"{mod}-backward")) for i in range(n)]
        measured = float(statistics.median(per_step)) / ms.num_layers
        pre = before[mod].total / ms.num_layers
        cal = after[mod].total / ms.num_layers
        modules[mod] = {
            "layers": ms.num_layers,
            "hidden": ms.hidden,
            "seq": ms.seq,
            "measured_layer_s": measured,
            "preset_layer_s": pre,
            "calibrated_layer_s": cal,
            "preset_error": _rel(pre, measured),
            "calibrated_error": _rel(cal, measured),
        }
    pre_step = evaluate(cand, wl, preset).total
    cal_step = calib.predict(cand, wl)
    return {
        "name": name,
        "steps_measured": n,
        "micro_batch": wl.micro_batch,
        "global_batch": wl.global_batch,
        "modules": modules,
        "step": {
            "measured_s": steps.step_s,
            "noise_s": steps.noise_s,
            "range_s": steps.spread_s,
            "preset_s": pre_step,
            "calibrated_s": cal_step,
            "preset_error": _rel(pre_step, steps.step_s),
            "calibrated_error": _rel(cal_step, steps.step_s),
        },
    }


def calibration_report(runs: Sequence[tuple[str, dict, Any]], hardware: str) -> dict[str, Any]:
    """The report (pure) of `runs` [(name, trace document, validated `Job`)], the first the fit run: the
    preset `hardware` (a name or a JSON path), calibrated to the first run's trace, priced against
    every run (`run_report`). ValueError for no runs or a trace the calibration cannot use."""
    from megatron_hetero.planner import autotune as A
    from megatron_hetero.planner.hardware import Profile
    from megatron_hetero.training.autotune_checks import workload_of
    from megatron_hetero.planner.layout_cost import candidate_for

    if not runs:
        raise ValueError("calibration_report: no runs")
    hw = load_hardware(hardware)
    preset = Profile.from_hardware(hw)
    _, doc, job = runs[0]
    wl = workload_of(job)
    calib = A.calibrate(
        A.step_times_from_trace(doc).drop(1),
        candidate_for(job.layout, job.config.spec, job.config.offload_encoder),
        wl,
        preset,
    )
    return {
        "hardware": hw.name,
        "fit_run": runs[0][0],
        "factors": dict(calib.factors),
        "notes": list(calib.notes),
        "runs": [run_report(name, d, j, preset, calib) for name, d, j in runs],
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as printed: one line per run and module, one per run's step."""
    pct = lambda e: "n/a" if e is None else f"{e * 100:+.1f}%"  # noqa: E731
    out = [
        f"calibrated to the {report['fit_run']} run from {report['hardware']}: factors "
        + ", ".join(f"{k} {v:.3g}" for k, v in report["factors"].items())
    ]
    for r in report["runs"]:
        for mod, m in r["modules"].items():
            out.append(
                f"{r['name']}: {mod} ({m['layers']} layers, h{m['hidden']}, seq {m['seq']}): per layer measured "
                f"{m['measured_layer_s'] * 1e3:.3f} ms, preset {m['preset_layer_s'] * 1e3:.3f} ms "
                f"({pct(m['preset_error'])}), calibrated {m['calibrated_layer_s'] * 1e3:.3f} ms "
                f"({pct(m['calibrated_error'])})"
            )
        s = r["step"]
        out.append(
            f"{r['name']}: step measured {s['measured_s'] * 1e3:.2f} ms (noise {s['noise_s'] * 1e3:.2f} ms, "
            f"{r['steps_measured']} steps), preset {s['preset_s'] * 1e3:.2f} ms ({pct(s['preset_error'])}), "
            f"calibrated {s['calibrated_s'] * 1e3:.2f} ms ({pct(s['calibrated_error'])})"
        )
    return out


def parse_shape(text: str, base: dict[str, int]) -> dict[str, int]:
    """`base` with the `NAME=INT,...` items of `text` (train's flags by name: num_layers=8,
    hidden_size=2048, global_batch_size=8, ...). ValueError for an item that is not NAME=INT."""
    from megatron_hetero.config.model import LlavaSpec, flag_values

    names = {*flag_values(LlavaSpec(), keep_none=True), "global_batch_size", "micro_batch_size"}
    out = dict(base)
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = (x.strip() for x in item.partition("="))
        if not eq or not value.lstrip("-").isdigit():
            raise ValueError(f"shape item {item!r}: expected NAME=INT (e.g. num_layers=8)")
        if name not in names:
            raise ValueError(f"shape item {item!r}: {name!r} is not one of {sorted(names)}")
        out[name] = int(value)
    return out


def traced_run(shape: dict[str, int], work: Path, name: str, steps: int, bf16: bool, timeout: float = 600.0):
    """`train` on one rank at `shape` (train's size flags by name, and global_batch_size,
    micro_batch_size) with a trace into `work`/NAME.trace.json, forked from this process
    (`training.job.run_local`); returns (trace document, the validated `config.job.Job`). The layout is
    `WORLD1_LAYOUT`; ValueError for sizes train refuses."""
    import dataclasses

    from megatron_hetero.bench.planner_configs import BenchModel
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.config.optim import OptimConfig
    from megatron_hetero.training.job import run_local
    from megatron_hetero.training.setup import JobDraft, validate_job

    import yaml

    sizes = dict(shape)
    batch = {k: sizes.pop(k) for k in ("global_batch_size", "micro_batch_size") if k in sizes}
    model = BenchModel(**batch).resized(**sizes) if sizes else BenchModel(**batch)
    job = model.job(steps)
    trace = work / f"{name}.trace.json"
    job = dataclasses.replace(job, trace=str(trace.resolve()))
    if bf16:  # what train --bf16 sets: the model's precision and the optimizer's fp32 main weights
        job = dataclasses.replace(
            job, spec=dataclasses.replace(job.spec, bf16=True), optim=dataclasses.replace(OptimConfig(), bf16=True)
        )
    layout = layout_from_dict(yaml.safe_load(WORLD1_LAYOUT), world_size=1)
    work.mkdir(parents=True, exist_ok=True)
    validated = validate_job(JobDraft(layout, job))
    run_local(validated, timeout=timeout)
    return json.loads(trace.read_text()), validated


def main(argv: Optional[list[str]] = None) -> int:
    """Run the two traced runs, print the report's lines and write it as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the report's JSON file")
    p.add_argument("--hardware", default="h200_141gb", help="preset name or JSON (default %(default)s)")
    p.add_argument(
        "--steps", type=int, default=8, help="training steps per run, the first not counted (default %(default)s)"
    )
    p.add_argument("--bf16", action="store_true", help="train in bf16 (what a GPU run uses)")
    p.add_argument("--fit", default="", help=f"the fit run's shape: NAME=INT,... over {FIT}")
    p.add_argument("--held-out", default="", help=f"the held-out run's shape: NAME=INT,... over {HELD_OUT}")
    p.add_argument("--work", default=None, help="folder for the traces (default: beside --out)")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps must be >= 3 (one warm-up step and two measured), got {args.steps}")
    from megatron_hetero.compat import apply_compat
    from megatron_hetero.training.job import quiet_upstream_warnings

    apply_compat()  # this module run as a script is an entry point
    quiet_upstream_warnings()
    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / (out.stem + "_traces")
    runs = []
    try:
        load_hardware(args.hardware)  # refused before any run
        shapes = {"fit": parse_shape(args.fit, FIT), "held-out": parse_shape(args.held_out, HELD_OUT)}
        for name, shape in shapes.items():
            doc, job = traced_run(shape, work, name, args.steps, args.bf16)
            runs.append((name, doc, job))
        report = calibration_report(runs, args.hardware)
    except ValueError as exc:  # flags train refuses, a preset that does not load, a trace the fit cannot use
        print(f"gpu_calibrate: {exc}", file=sys.stderr, flush=True)
        return 2
    report["shapes"] = {**shapes, "bf16": args.bf16, "steps": args.steps}
    from megatron_hetero.compat.device import get_device

    report["device"] = str(get_device())
    for line in report_lines(report):
        print(line, flush=True)
    bad = [
        f"{r['name']} {mod}"
        for r in report["runs"]
        for mod, m in r["modules"].items()
        if not (m["measured_layer_s"] > 0 and math.isfinite(m["calibrated_layer_s"]) and m["calibrated_layer_s"] > 0)
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if bad:
        print(f"gpu_calibrate: no usable measurement or prediction for {bad}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
