"""`python -m megatron_hetero.bench.gpu_calibrate` on CPU (the GPU check `calibrate` runs it on a
GPU with bf16 and larger shapes): two traced world-1 runs, the cost model calibrated to the first,
per-layer and step times predicted and measured for both. Checked against the traces themselves."""

from __future__ import annotations

import json
import statistics

import pytest

from megatron_hetero.bench import gpu_calibrate

FIT = (
    "num_layers=2,hidden_size=64,num_attention_heads=4,seq_length=64,encoder_num_layers=1,encoder_hidden_size=32,"
    "encoder_num_attention_heads=4,encoder_tokens=16,global_batch_size=4,micro_batch_size=2"
)
HELD_OUT = (
    "num_layers=3,hidden_size=96,num_attention_heads=4,seq_length=96,encoder_num_layers=2,encoder_hidden_size=32,"
    "encoder_num_attention_heads=4,encoder_tokens=32,global_batch_size=4,micro_batch_size=1"
)
STEPS = 4


def _module_seconds(trace: dict, module: str) -> list[float]:
    """Per traced step after the first: the summed durations of the module's forward and backward
    spans (at world 1 nothing runs nested inside a module's compute span); steps end at the
    optimizer spans."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ends = sorted(e["ts"] + e["dur"] for e in events if e["cat"] == "optimizer")
    per_step = [0.0] * len(ends)
    for e in events:
        if e["cat"] in (f"{module}-forward", f"{module}-backward"):
            k = next(i for i, end in enumerate(ends) if e["ts"] < end)
            per_step[k] += e["dur"] / 1e6
    return per_step[1:]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate") / "calibration.json"
    rc = gpu_calibrate.main(
        ["--out", str(out), "--steps", str(STEPS), "--fit", FIT, "--held-out", HELD_OUT, "--hardware", "h200_141gb"]
    )
    assert rc == 0
    return out, json.loads(out.read_text())


def test_measured_per_layer_times_are_the_traces(report):
    out, doc = report
    assert doc["device"] == "cpu" and doc["fit_run"] == "fit" and doc["hardware"].startswith("H200")
    assert [r["name"] for r in doc["runs"]] == ["fit", "held-out"]
    for run in doc["runs"]:
        trace = json.loads((out.parent / "calibration_traces" / f"{run['name']}.trace.json").read_text())
        assert run["steps_measured"] == STEPS - 1
        for module, m in run["modules"].items():
            want = statistics.median(_module_seconds(trace, module)) / m["layers"]
            assert m["measured_layer_s"] == pytest.approx(want, rel=1e-9), (run["name"], module)
    layers = {r["name"]: {k: m["layers"] for k, m in r["modules"].items()} for r in doc["runs"]}
    assert layers == {"fit": {"encoder": 1, "llm": 2}, "held-out": {"encoder": 2, "llm": 3}}


def test_the_fit_run_is_reproduced_and_the_held_out_run_predicted_by_the_same_factors(report):
    _, doc = report
    fit, held = doc["runs"]
    for m in fit["modules"].values():  # calibrated to this run: its own times back
        assert m["calibrated_layer_s"] == pytest.approx(m["measured_layer_s"], rel=1e-9)
        assert m["calibrated_error"] == pytest.approx(0.0, abs=1e-9)
    assert fit["step"]["calibrated_s"] == pytest.approx(fit["step"]["measured_s"], rel=1e-9)
    for module, m in held["modules"].items():  # world 1: no communication, a module scales by its factor
        assert m["calibrated_layer_s"] == pytest.approx(doc["factors"][module] * m["preset_layer_s"], rel=1e-9)
        assert m["preset_error"] == pytest.approx(m["preset_layer_s"] / m["measured_layer_s"] - 1, rel=1e-9)
        assert m["calibrated_error"] == pytest.approx(m["calibrated_layer_s"] / m["measured_layer_s"] - 1, rel=1e-9)
    assert held["modules"]["llm"]["preset_layer_s"] > fit["modules"]["llm"]["preset_layer_s"]  # a wider, longer layer
    assert held["step"]["noise_s"] >= 0 and held["step"]["calibrated_s"] > 0


def test_bad_input_exits_2_with_the_reason(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_calibrate.main(["--out", str(tmp_path / "c.json"), "--steps", "2"])
    assert exc.value.code == 2 and "--steps must be >= 3" in capsys.readouterr().err
    rc = gpu_calibrate.main(
        ["--out", str(tmp_path / "c.json"), "--fit", FIT.replace("num_attention_heads=4", "num_attention_heads=5")]
    )
    assert rc == 2 and "gpu_calibrate:" in capsys.readouterr().err
    rc = gpu_calibrate.main(
        ["--out", str(tmp_path / "c.json"), "--steps", "3", "--fit", FIT, "--hardware", "no_such_gpu"]
    )
    assert rc == 2 and "unknown hardware preset" in capsys.readouterr().err
    rc = gpu_calibrate.main(["--out", str(tmp_path / "c.json"), "--fit", "num_layers=two"])
    assert rc == 2 and "expected NAME=INT" in capsys.readouterr().err
    rc = gpu_calibrate.main(["--out", str(tmp_path / "c.json"), "--fit", "layers=2"])
    assert rc == 2 and "'layers' is not one of" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()  # nothing ran, nothing written
