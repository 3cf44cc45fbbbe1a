"""The profile's pure half: what `megatron-hetero profile` measures (`ProfileGrid` and its cases) and
how the measurements become a cost-model `Profile` (`fit_profile`), with the JSON document and its
text summary. No torch. The timing kernels are `profiling/kernels.py` (collectives, host copies,
load detection) and `profiling/run.py` (layers and whole modules of the model; `run_profile`).

Fit (`fit_profile`), all from the measurements of one run (least squares, a, b >= 0):
  * per module kind, `LayerModel` t = a + b * flops_per_rank on the TP1·CP1 layers (the layer
    compute of the cost model);
  * per collective and group size (link `intra`): `AlphaBeta` t = alpha + bytes * beta, which
    overrides the ring formula at that size; the link's per-hop alpha/beta from send/recv;
  * `layer_collectives`: the TP all-reduce and CP all-gather as they cost inside a layer, from the
    measured TP>1 and CP>1 layers minus the layer compute model;
  * `overheads`: `data` (building a micro-batch of synthetic samples, against its tokens),
    `<kind>_io` (module minus its layer model and data: embedding, output layer, loss / patch
    embedding, projector) against the output-layer / projector FLOPs, `<kind>_io_tp` (what
    TP adds, in activation all-reduces over the TP group), `optimizer`, `snapshot` (against the
    parameters on the rank), `grad_sync` (DDP's gradient all-reduce against the all-reduce model);
  * gloo (ranks share the CPU): `cores` = world * t(one busy rank) / t(all ranks busy) of the solo
    layer case, `concurrency` = world (see `planner.cost_terms.shared_step`).
The residuals of the layer model against every measured layer (TP/CP included) are reported in
the JSON (`checks`). The profile JSON is `Profile.to_dict()` plus `world_size`, `backend`, `grid`
and the raw `measurements`; `Profile.load` reads it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from megatron_hetero.planner import cost_terms as CT
from megatron_hetero.planner.hardware import COLLECTIVES, AlphaBeta, LayerModel, Profile, fit_alpha_beta, layer_flops
from megatron_hetero.planner.workload import ModelSpec, Workload

KINDS = ("llm", "encoder")


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. `layer_shapes`: (hidden, heads, seq, batch) per kind; `tp`/`cp`: degrees
    (kept where they divide the world and the heads); `sizes`: collective message bytes."""

    layer_shapes: dict = field(
        default_factory=lambda: {
            "llm": ((64, 4, 32, 1), (64, 4, 32, 4), (128, 4, 64, 2), (256, 8, 128, 2)),
            "encoder": ((32, 4, 8, 1), (32, 4, 8, 8), (64, 4, 16, 4), (128, 4, 32, 4)),
        }
    )
    #: whole modules of the LLaVA model with one layer (per-micro-batch parts outside the layers:
    #: data, embedding, output layer and loss / patch embedding and projector; and the optimizer step):
    #: kind -> (hidden, heads, seq, batch, vocab or llm hidden)
    module_shapes: dict = field(
        default_factory=lambda: {
            "llm": ((64, 4, 32, 2, 128), (128, 4, 64, 2, 512), (256, 8, 128, 2, 1024)),
            "encoder": ((32, 4, 8, 2, 64), (64, 4, 16, 4, 128), (128, 4, 32, 4, 256)),
        }
    )
    tp: tuple = (1, 2, 4)
    cp: tuple = (1, 2)
    sizes: tuple = (1 << 10, 1 << 14, 1 << 18, 1 << 21)
    collectives: tuple = ("all_reduce", "all_gather", "broadcast", "send_recv")
    iters: int = 5
    warmup: int = 2
    reps: int = 6

    @classmethod
    def quick(cls) -> "ProfileGrid":
        return cls(
            layer_shapes={"llm": ((64, 4, 32, 1), (128, 4, 64, 2)), "encoder": ((32, 4, 8, 1), (64, 4, 16, 4))},
            module_shapes={
                "llm": ((64, 4, 32, 2, 128), (128, 4, 64, 2, 512)),
                "encoder": ((32, 4, 8, 2, 64), (64, 4, 16, 4, 128)),
            },
            tp=(1, 2),
            cp=(1, 2),
            sizes=(1 << 10, 1 << 14, 1 << 18),
            iters=3,
            warmup=1,
            reps=2,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_shapes"] = {k: [list(s) for s in v] for k, v in self.layer_shapes.items()}
        d["module_shapes"] = {k: [list(s) for s in v] for k, v in self.module_shapes.items()}
        return d


def _ffn(hidden: int) -> int:
    return 4 * hidden  # Megatron's default ffn_hidden_size (the LLaVA model passes None)


def layer_cases(grid: ProfileGrid, world: int) -> list[dict]:
    """Every layer case of the grid that fits the world: kind, shape, tp, cp."""
    out = []
    for kind, shapes in grid.layer_shapes.items():
        if kind not in KINDS:
            raise ValueError(f"profile grid: unknown module kind {kind!r}; kinds are {list(KINDS)}")
        for hidden, heads, seq, batch in shapes:
            for tp in grid.tp:
                for cp in grid.cp if kind == "llm" else (1,):
                    if world % (tp * cp) or heads % tp or hidden % heads or (cp > 1 and seq % (2 * cp)):
                        continue
                    out.append(
                        {
                            "kind": kind,
                            "hidden": hidden,
                            "heads": heads,
                            "ffn_hidden": _ffn(hidden),
                            "seq": seq,
                            "batch": batch,
                            "tp": tp,
                            "cp": cp,
                        }
                    )
    return out


def module_cases(grid: ProfileGrid, world: int) -> list[dict]:
    """Every whole-module case (one layer) of the grid: TP1 and the largest TP of the grid, CP1."""
    out = []
    for kind, shapes in grid.module_shapes.items():
        if kind not in KINDS:
            raise ValueError(f"profile grid: unknown module kind {kind!r}; kinds are {list(KINDS)}")
        for hidden, heads, seq, batch, other in shapes:
            for tp in sorted({1, max(t for t in grid.tp if world % t == 0 and heads % t == 0)}):
                c = {
                    "kind": kind,
                    "hidden": hidden,
                    "heads": heads,
                    "ffn_hidden": _ffn(hidden),
                    "seq": seq,
                    "batch": batch,
                    "tp": tp,
                    "cp": 1,
                }
                c["vocab" if kind == "llm" else "llm_hidden"] = other
                out.append(c)
    return out


def collective_cases(grid: ProfileGrid, world: int) -> list[dict]:
    out = []
    for kind in grid.collectives:
        if kind not in COLLECTIVES:
            raise ValueError(f"profile grid: unknown collective {kind!r}; kinds are {list(COLLECTIVES)}")
        sizes = [n for n in (2, 4, 8, 16, 32) if n <= world and world % n == 0]
        for n in [2] if kind == "send_recv" else sizes:
            if n > world:
                continue
            for nbytes in grid.sizes:
                out.append({"kind": kind, "n": n, "bytes": int(nbytes)})
    return out


def solo_layer_case(cases: list[dict]) -> int:
    """The layer case also timed with one busy rank: the first TP1·CP1 language-model case."""
    return next(i for i, c in enumerate(cases) if c["tp"] == 1 and c["cp"] == 1 and c["kind"] == cases[0]["kind"])


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over iterations of the slowest rank's time."""
    return float(statistics.median(max(r[k] for r in per_rank) for k in range(len(per_rank[0]))))


def combine_rounds(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement document from rounds of the same grid: per case the fastest round."""
    if not docs:
        raise ValueError("no measurement rounds to combine")
    docs = [
        dict(d, external_load=d["external_load"] if isinstance(d["external_load"], list) else [d["external_load"]])
        for d in docs
    ]
    out = {**docs[0], **{k: list(docs[0][k]) for k in ("layers", "modules", "collectives")}}
    for key in ("layers", "modules", "collectives"):
        for i, _case in enumerate(out[key]):
            best = min((d[key][i] for d in docs), key=lambda c: c["seconds"])
            out[key][i] = best
    out["solo_layer"] = min((d["solo_layer"] for d in docs), key=lambda c: c["seconds"])
    out["host_bandwidth"] = max(d["host_bandwidth"] for d in docs)
    out["seconds"] = sum(d["seconds"] for d in docs)
    out["rounds"] = sum(d.get("rounds", 1) for d in docs)
    out["external_load"] = [x for d in docs for x in d["external_load"]]
    return out


def _fit_line(xs: list[float], ys: list[float]) -> LayerModel:
    """t = a + b * x with a, b >= 0 (a negative slope from noise: the mean, flat)."""
    if len(set(xs)) < 2:
        return LayerModel(a=max(0.0, float(statistics.mean(ys))), b=0.0)
    a, b = fit_alpha_beta(xs, ys)
    if b < 0:
        return LayerModel(a=max(0.0, float(statistics.mean(ys))), b=0.0)
    return LayerModel(a=a, b=b)


def fit_profile(raw: dict[str, Any], memory_bytes: Optional[float] = None) -> Profile:
    """The `Profile` of a measurement document (see module docstring)."""
    world = int(raw["world_size"])
    layers = {}
    for kind in KINDS:
        samples = [
            dict(s, tokens=s["batch"] * s["seq"], gated=False)
            for s in raw["layers"]
            if s["kind"] == kind and s["tp"] == 1 and s["cp"] == 1
        ]
        if samples:
            pairs = [
                (float(layer_flops(x["tokens"], x["seq"], x["hidden"], x["ffn_hidden"])), x["seconds"]) for x in samples
            ]
            layers[kind] = _fit_line([f for f, _ in pairs], [t for _, t in pairs])
    if not layers:
        raise ValueError("profile: no TP1·CP1 layer measurement to fit")
    layers["default"] = layers.get("llm") or next(iter(layers.values()))
    coll: dict[str, dict] = {}
    for kind in COLLECTIVES:
        for n in sorted({s["n"] for s in raw["collectives"] if s["kind"] == kind}):
            pts = [(s["bytes"], s["seconds"]) for s in raw["collectives"] if s["kind"] == kind and s["n"] == n]
            if len({b for b, _ in pts}) < 2:
                continue
            ab = _fit_line([p[0] for p in pts], [p[1] for p in pts])
            coll.setdefault(kind, {}).setdefault("intra", {})[n] = AlphaBeta(ab.a, ab.b)
    sr = coll.get("send_recv", {}).get("intra", {}).get(2)
    if sr is None:
        raise ValueError("profile: send/recv measurements are needed for the link model")
    link = AlphaBeta(sr.alpha, sr.beta)
    shared = raw["backend"] == "gloo"  # ranks forked on one CPU machine share its cores
    solo = raw.get("solo_layer")
    cores, concurrency = 0.0, 0
    if shared and solo:
        same = next(
            s for s in raw["layers"] if all(s[k] == solo[k] for k in ("kind", "hidden", "seq", "batch", "tp", "cp"))
        )
        # effective cores: the world's ranks did `world` layers in the time one rank alone does
        # world * t_solo / t_all of them
        cores, concurrency = min(float(world), world * solo["seconds"] / same["seconds"]), world
    prof = Profile(
        layers=layers,
        links={"intra": link, "inter": link},
        devices_per_node=world,
        memory_bytes=float(memory_bytes if memory_bytes is not None else raw["memory_bytes"]),
        host_bandwidth=float(raw["host_bandwidth"]),
        collectives=coll,
        source=f"measured on {raw['backend']}, {world} concurrent ranks (megatron-hetero profile)",
        cores=cores,
        concurrency=concurrency,
        cpu_cores=float(raw.get("cpu_cores", 0.0)) if cores else 0.0,
    )
    prof = dataclasses.replace(prof, layer_collectives=_fit_layer_collectives(prof, raw))
    overheads = {}
    for kind in KINDS:
        io_pts = []  # (tp, flops, one activation all-reduce over TP, io seconds)
        for s in raw.get("modules", []):
            if s["kind"] != kind:
                continue
            spec, wl = _specs(s)
            layer = float(sum(CT.layer_parts(prof, wl, spec, s["batch"], s["tp"], 1)))
            data = s["data_seconds"] if kind == "llm" else 0.0  # the LLM module built its batch
            io_pts.append(
                (
                    s["tp"],
                    float(CT.io_flops(wl, spec, s["batch"], s["tp"], 1)),
                    float(CT.io_allreduce(prof, wl, spec, s["batch"], s["tp"], 1)),
                    s["seconds"] - layer - data,
                )
            )
        one = [p for p in io_pts if p[0] == 1]
        if not one:
            continue
        io = _fit_line([p[1] for p in one], [p[3] for p in one])
        overheads[f"{kind}_io"] = io
        # TP > 1: the extra time over the TP1 model, in activation all-reduces over the TP group
        # (embedding, output layer, vocab-parallel loss / projector), least squares through 0
        tps = [(p[2], p[3] - float(io.time(p[1]))) for p in io_pts if p[0] > 1 and p[2] > 0]
        if tps:
            k = sum(x * y for x, y in tps) / sum(x * x for x, _ in tps)
            overheads[f"{kind}_io_tp"] = LayerModel(a=0.0, b=max(0.0, k))
    mods = raw.get("modules", [])
    if mods:
        overheads["data"] = _fit_line([float(s["batch"] * s["seq"]) for s in mods], [s["data_seconds"] for s in mods])
        overheads["optimizer"] = _fit_line([float(s["params"]) for s in mods], [s["optimizer_seconds"] for s in mods])
        overheads["snapshot"] = _fit_line([float(s["params"]) for s in mods], [s["snapshot_seconds"] for s in mods])
        # DDP's gradient all-reduce right after the backward pass (fwd+bwd+sync minus fwd+bwd), against
        # the all-reduce model of the same bytes and group
        xs = [float(prof.collective_time("all_reduce", s["params"] * 4.0, s["dp"], False)) for s in mods]
        overheads["grad_sync"] = _fit_line(xs, [s["grad_sync_seconds"] for s in mods])
    return dataclasses.replace(prof, overheads=overheads)


def _fit_layer_collectives(prof: Profile, raw: dict[str, Any]) -> dict:
    """TP all-reduces and CP all-gathers as they cost inside a layer: from every measured TP>1·CP1
    (CP>1·TP1) layer, the time over the layer compute model, per all-reduce (per all-gather, plus
    the attention compute the model overlaps with it), fitted as alpha + bytes * beta per group size."""
    pts: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for s in raw["layers"]:
        if (s["tp"] > 1) == (s["cp"] > 1):
            continue
        spec = ModelSpec(s["kind"], 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind=s["kind"])
        wl = Workload(spec, spec, global_batch=1, dtype_bytes=4, recompute=None)
        compute = float(CT.layer_parts(prof, wl, spec, s["batch"], s["tp"], s["cp"])[0])
        tokens = s["batch"] * s["seq"]
        if s["tp"] > 1:
            nbytes = tokens / s["cp"] * s["hidden"] * 4
            pts.setdefault(("all_reduce", s["tp"]), []).append((nbytes, (s["seconds"] - compute) / 4.0))
        elif spec.shards:
            nbytes = 2.0 * tokens * s["hidden"] * 4
            overlap = prof.layer_model(s["kind"]).b * 12.0 * tokens * s["seq"] * s["hidden"] / s["cp"]
            pts.setdefault(("all_gather", s["cp"]), []).append((nbytes, (s["seconds"] - compute + overlap) / 3.0))
    out: dict[str, dict] = {}
    for (kind, n), xy in sorted(pts.items()):
        ab = _fit_line([x for x, _ in xy], [max(0.0, y) for _, y in xy])
        out.setdefault(kind, {}).setdefault("intra", {})[n] = AlphaBeta(ab.a, ab.b)
    return out


def _specs(s: dict) -> tuple[ModelSpec, Workload]:
    """Cost-model specs of one measured module case (fp32)."""
    if s["kind"] == "llm":
        spec = ModelSpec("llm", 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind="llm", vocab=s["vocab"])
        llm = spec
    else:
        spec = ModelSpec("encoder", 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind="encoder")
        llm = ModelSpec("llm", 1, s["llm_hidden"], 4 * s["llm_hidden"], s["heads"], s["seq"], kind="llm")
    enc = spec if s["kind"] == "encoder" else ModelSpec("encoder", 1, 8, 32, 1, 1, kind="encoder")
    return spec, Workload(enc, llm, global_batch=1, dtype_bytes=4, recompute=None)


def layer_checks(prof: Profile, raw: dict[str, Any]) -> list[dict]:
    """Every measured layer against the model: compute + TP all-reduces + CP gathers (fp32)."""
    out = []
    for s in raw["layers"]:
        spec = ModelSpec(s["kind"], 1, s["hidden"], s["ffn_hidden"], s["heads"], s["seq"], kind=s["kind"])
        wl = Workload(spec, spec, global_batch=1, dtype_bytes=4, recompute=None)
        est = float(sum(CT.layer_parts(prof, wl, spec, s["batch"], s["tp"], s["cp"])))
        out.append(
            {
                **{k: s[k] for k in ("kind", "hidden", "seq", "batch", "tp", "cp")},
                "measured_s": s["seconds"],
                "model_s": est,
                "error": est / s["seconds"] - 1.0,
            }
        )
    return out


def profile_document(raw: dict[str, Any], prof: Profile) -> dict[str, Any]:
    """The JSON written by `megatron-hetero profile`: the Profile plus the measurements."""
    checks = layer_checks(prof, raw)
    errs = [abs(c["error"]) for c in checks]
    return {
        **prof.to_dict(),
        "world_size": raw["world_size"],
        "backend": raw["backend"],
        "grid": raw["grid"],
        "measure_seconds": raw["seconds"],
        "rounds": raw.get("rounds", 1),
        "external_load": raw.get("external_load"),
        "measurements": {
            "layers": raw["layers"],
            "collectives": raw["collectives"],
            "host_bandwidth": raw["host_bandwidth"],
        },
        "checks": {"layers": checks, "layer_mape": sum(errs) / len(errs) if errs else None},
    }


def summary(doc: dict[str, Any]) -> str:
    """A short text report of a profile document."""
    lines = [f"profile: {doc['source']}; measured in {doc['measure_seconds']:.1f} s"]
    for kind, lm in doc["layers"].items():
        if kind != "default":
            lines.append(f"  layer {kind:8s} t = {lm['a'] * 1e3:.3f} ms + flops * {lm['b'] * 1e12:.3f} ps")
    for kind, per in doc["collectives"].items():
        for n, ab in sorted(per.get("intra", {}).items(), key=lambda x: int(x[0])):
            lines.append(
                f"  {kind:14s} n={n:<3} alpha {ab['alpha'] * 1e6:8.1f} us  beta {ab['beta'] * 1e9:8.3f} ns/B"
                f" ({(1 / ab['beta'] / 1e9) if ab['beta'] > 0 else math.inf:.2f} GB/s)"
            )
    if doc["checks"]["layer_mape"] is not None:
        lines.append(
            f"  layer model vs every measured layer (TP/CP included): mean |error| {doc['checks']['layer_mape']:.1%}"
        )
    return "\n".join(lines)
