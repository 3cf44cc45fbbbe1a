"""A measured hardware preset of the one GPU this process sees (`scripts/gpu_check.sh preset`).

    python -m megatron_hetero.profiling.gpu_preset --out h200_measured.json [--impl transformer_engine]

Times, in bf16 and with `megatron-hetero profile`'s own layer kernel (`profiling.run._rank_layers`:
a Megatron `TransformerBlock` of the model's config, forward + backward per layer) on a world-1 NCCL
rank, two layers the planner prices: a CLIP-L/14 encoder layer (hidden 1024, 16 heads, ffn 4096, 577
tokens per image; 4 and 8 images, about 2K and 4K tokens) and a 7B-class decoder layer (hidden 4096,
32 heads, ffn 11008, swiglu; seq 2048 and 4096, one sample). The fit t = a + b * FLOPs
(`planner.hardware.fit_layer_model`) gives the preset's `efficiency` (1 / (b * peak)) and
`layer_overhead_s` (a); the host copy bandwidth and the device memory are measured too. What one GPU
cannot measure (NVLink and network bandwidths, latencies) is kept from `base` (the H100 preset's
published figures; an H200 SXM has the same NVLink and the same dense bf16 peak) and the `source`
says which is which. The result loads as a `planner.hardware.HardwareSpec`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional

#: the CLIP-L/14 encoder layer and the 7B-class decoder layer (profile grid case keys)
CLIP_L14 = {"kind": "encoder", "hidden": 1024, "heads": 16, "ffn_hidden": 4096, "seq": 577}
DECODER_7B = {"kind": "llm", "hidden": 4096, "heads": 32, "ffn_hidden": 11008, "gated": True}
#: dense bf16 FLOP/s of an H200 SXM (NVIDIA's datasheet: the same Hopper tensor cores as an H100 SXM)
H200_PEAK_FLOPS = 989.4e12
BASE_PRESET = Path(__file__).resolve().parents[1] / "planner" / "hardware_presets" / "h100_80gb.json"


def preset_cases() -> list[dict[str, Any]]:
    """The timed layer cases: the decoder layer at seq 2048 and 4096, the CLIP layer at 4 and 8 images."""
    one = {"tp": 1, "cp": 1}
    return [{**DECODER_7B, **one, "seq": s, "batch": 1} for s in (2048, 4096)] + [
        {**CLIP_L14, **one, "batch": b} for b in (4, 8)
    ]


def rank_measure(iters: int, warmup: int, impl: str) -> dict[str, Any]:
    """On a rank (world 1): the cases' per-layer times (median seconds), the host bandwidth, the memory."""
    import torch

    from megatron_hetero.profiling.kernels import rank_host_bandwidth, rank_memory
    from megatron_hetero.profiling.run import _rank_layers

    cases = preset_cases()
    times, _solo = _rank_layers(cases, iters, warmup, 1, dtype=torch.bfloat16, impl=impl)
    layers = [{**c, "seconds": float(statistics.median(t))} for c, t in zip(cases, times)]
    return {"layers": layers, "host_bandwidth": rank_host_bandwidth(), "memory_bytes": rank_memory(1), "impl": impl}


def preset_from_measurement(
    meas: dict[str, Any], name: str, base: Optional[dict[str, Any]] = None, peak_flops: float = H200_PEAK_FLOPS
) -> dict[str, Any]:
    """The hardware preset document of a `rank_measure` result (pure; ValueError for a measurement
    the fit cannot use)."""
    from megatron_hetero.planner.hardware import HardwareSpec, fit_layer_model, layer_flops

    base = dict(base if base is not None else json.loads(BASE_PRESET.read_text()))
    layers = meas["layers"]
    if len(layers) < 2 or any(not (c["seconds"] > 0) for c in layers):
        raise ValueError(f"need >= 2 positive layer times to fit a preset, got {[c['seconds'] for c in layers]}")
    samples = [
        {**c, "tokens": c["seq"] * c["batch"], "seconds": c["seconds"], "gated": bool(c.get("gated"))} for c in layers
    ]
    fit = fit_layer_model(samples)
    if fit.b <= 0:
        raise ValueError(f"the layer fit has a non-positive time per FLOP ({fit.b}); the measurement is unusable")
    achieved = [
        float(layer_flops(s["tokens"], s["seq"], s["hidden"], s["ffn_hidden"], s["gated"])) / s["seconds"]
        for s in samples
    ]
    cases = "; ".join(
        f"{c['kind']} h{c['hidden']} seq {c['seq']} x{c['batch']}: {c['seconds'] * 1e3:.3f} ms ({f / 1e12:.0f} TFLOP/s)"
        for c, f in zip(layers, achieved)
    )
    doc = {
        **base,
        "name": name,
        "peak_flops": peak_flops,
        "efficiency": float(f"{1.0 / (fit.b * peak_flops):.4g}"),
        "memory_bytes": float(meas["memory_bytes"]),
        "host_bandwidth": float(meas["host_bandwidth"]),
        "layer_overhead_s": max(0.0, fit.a),
        "source": (
            f"measured on one GPU (megatron_hetero.profiling.gpu_preset, bf16, --transformer-impl "
            f"{meas.get('impl', 'local')}, forward + backward per layer): {cases}; efficiency and "
            f"layer_overhead_s fitted from them against peak {peak_flops / 1e12:.1f} TFLOP/s; memory_bytes "
            f"and host_bandwidth measured; NVLink/network bandwidths and latencies and devices_per_node "
            f"not measurable on one GPU: kept from {base.get('name', 'the base preset')}"
        ),
    }
    HardwareSpec.from_dict(doc)  # the preset must load as the planner reads it
    return doc


def main(argv: Optional[list[str]] = None) -> int:
    """Measure on a world-1 NCCL rank and write the preset JSON; prints one summary line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="preset JSON to write")
    p.add_argument("--impl", default="local", choices=["local", "transformer_engine"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--name", default="H200 (measured on one GPU)")
    args = p.parse_args(argv)
    from megatron_hetero.compat import apply_compat
    from megatron_hetero.compat.device import default_backend
    from megatron_hetero.runtime.launcher import run_ranks

    apply_compat()  # this module run as a script is an entry point
    backend = default_backend()
    if backend != "nccl":
        raise SystemExit("gpu_preset: needs a CUDA GPU (a world-1 NCCL rank); none is present")
    meas = run_ranks(1, rank_measure, args.iters, args.warmup, args.impl, backend=backend, timeout=400)[0]
    doc = preset_from_measurement(meas, args.name)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"efficiency {doc['efficiency']}, layer_overhead_s {doc['layer_overhead_s']:.2e}: {doc['source']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
