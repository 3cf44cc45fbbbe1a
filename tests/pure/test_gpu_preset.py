"""The measured hardware preset of `scripts/gpu_check.sh preset` (`profiling.gpu_preset`): its cases
and the document a measurement becomes (the measurement itself needs a GPU: tests/gpu)."""

from __future__ import annotations

import pytest

from megatron_hetero.planner.hardware import HardwareSpec, layer_flops
from megatron_hetero.profiling import gpu_preset as G


def _measurement(efficiency: float, overhead: float) -> dict:
    layers = []
    for c in G.preset_cases():
        f = float(layer_flops(c["seq"] * c["batch"], c["seq"], c["hidden"], c["ffn_hidden"], bool(c.get("gated"))))
        layers.append({**c, "seconds": overhead + f / (efficiency * G.H200_PEAK_FLOPS)})
    return {"layers": layers, "host_bandwidth": 50e9, "memory_bytes": 141e9, "impl": "transformer_engine"}


def test_preset_cases_are_the_clip_and_7b_layers():
    cases = G.preset_cases()
    assert [(c["kind"], c["hidden"], c["seq"], c["batch"]) for c in cases] == [
        ("llm", 4096, 2048, 1),
        ("llm", 4096, 4096, 1),
        ("encoder", 1024, 577, 4),
        ("encoder", 1024, 577, 8),
    ]
    assert all(c["ffn_hidden"] == 11008 and c["gated"] for c in cases[:2])


def test_preset_from_measurement_recovers_the_fit_and_loads_as_a_hardware_spec():
    doc = G.preset_from_measurement(_measurement(0.6, 3e-5), "H200 test")
    spec = HardwareSpec.from_dict(doc)
    assert spec.efficiency == pytest.approx(0.6, rel=1e-3)
    assert spec.layer_overhead_s == pytest.approx(3e-5, rel=1e-3)
    assert spec.memory_bytes == 141e9 and spec.intra_bandwidth == 450e9  # measured; kept from the H100 preset
    assert "transformer_engine" in spec.source and "not measurable on one GPU" in spec.source


def test_preset_from_measurement_refuses_unusable_times():
    m = _measurement(0.6, 3e-5)
    m["layers"][0]["seconds"] = 0.0
    with pytest.raises(ValueError, match="positive layer times"):
        G.preset_from_measurement(m, "bad")
