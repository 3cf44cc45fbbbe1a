"""What a cluster costs: fitted or simulated time models (`Profile`), published hardware figures
(`HardwareSpec`), their JSON files, and the least-squares fits that build them. Pure (numpy only).

Collectives, alpha-beta per link (intra-node NVLink or inter-node network), ring algorithms:
    all-reduce      2(n-1)*alpha + 2(n-1)/n * bytes * beta
    all-gather / reduce-scatter   (n-1)*alpha + (n-1)/n * bytes * beta   (bytes = gathered size)
    broadcast       ceil(log2 n)*alpha + bytes * beta                    (pipelined)
    send/recv       alpha + bytes * beta
Measured per-(kind, link, n) alpha-beta pairs in a `Profile` override the ring formula. How the
cost model uses these: `planner/cost.py`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
LINKS = ("intra", "inter")
OVERHEADS = ("llm_io", "encoder_io", "llm_io_tp", "encoder_io_tp", "optimizer", "snapshot", "grad_sync", "data")


@dataclass(frozen=True)
class AlphaBeta:
    """t = alpha + bytes * beta (seconds; beta in seconds per byte)."""

    alpha: float
    beta: float

    def time(self, nbytes):
        return self.alpha + np.asarray(nbytes, dtype=float) * self.beta


@dataclass(frozen=True)
class LayerModel:
    """Time of one transformer layer, forward + backward, one micro-batch, on one rank:
    t = a + b * flops_per_rank (a seconds, b seconds per FLOP)."""

    a: float
    b: float

    def time(self, flops_per_rank):
        return self.a + self.b * np.asarray(flops_per_rank, dtype=float)


def ring_factors(kind: str, n):
    """(latency hops, byte fraction) of collective `kind` over `n` ranks (see module docstring)."""
    n = np.asarray(n, dtype=float)
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return n - 1, (n - 1) / n
    if kind == "broadcast":
        return np.ceil(np.log2(np.maximum(n, 1))), np.ones_like(n)
    if kind == "send_recv":
        return np.ones_like(n), np.ones_like(n)
    raise ValueError(f"unknown collective kind {kind!r}; kinds are {list(COLLECTIVES)}")


def layer_flops(tokens, seq, hidden, ffn_hidden, gated: bool = False):
    """Training FLOPs (fwd+bwd) of one transformer layer: 3 * (8Th^2 + 2mThf + 4Tsh)."""
    m = 3 if gated else 2
    t = np.asarray(tokens, dtype=float)
    h = float(hidden)
    return 3.0 * (8.0 * t * h * h + 2.0 * m * t * h * ffn_hidden + 4.0 * t * seq * h)


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = alpha + bytes * beta to measured (size, time) samples.

    A negative intercept (noise at small sizes) is clamped to 0 and beta refitted through the origin.
    """
    x = np.asarray(sizes_bytes, dtype=float)
    y = np.asarray(times_s, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"sizes and times must be equal-length 1-D sequences, got {x.shape} and {y.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 distinct message sizes, got {sorted(set(x.tolist()))}")
    beta, alpha = np.polyfit(x, y, 1)
    if alpha < 0:
        alpha, beta = 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(alpha), float(beta)


def fit_layer_model(samples: Iterable[Any]) -> LayerModel:
    """Fit `LayerModel` (t = a + b * flops_per_rank) to measured layer times.

    Each sample is either a pair `(flops_per_rank, seconds)` or a mapping with keys `tokens` (of the
    micro-batch replica), `seq`, `hidden`, `ffn_hidden`, `tp`, `cp` (default 1), `gated` (default
    False) and `seconds`; its FLOPs per rank are `layer_flops(...) / (tp * cp)`.
    """
    xs, ys = [], []
    for s in samples:
        if isinstance(s, dict):
            try:
                f = layer_flops(s["tokens"], s["seq"], s["hidden"], s["ffn_hidden"], s.get("gated", False))
                xs.append(float(f) / (s["tp"] * s.get("cp", 1)))
                ys.append(float(s["seconds"]))
            except KeyError as exc:
                raise ValueError(f"layer sample {s!r} lacks key {exc}") from None
        else:
            x, y = s
            xs.append(float(x))
            ys.append(float(y))
    a, b = fit_alpha_beta(xs, ys)
    return LayerModel(a=a, b=b)


@dataclass(frozen=True)
class HardwareSpec:
    """Published figures of one accelerator type and its cluster (JSON file; presets in planner/hardware_presets/).

    peak_flops: dense bf16 FLOP/s per device; efficiency: achieved fraction of it on transformer
    layers; bandwidths in bytes/s per device and direction; latencies in seconds;
    host_bandwidth: device<->host bytes/s (offload); layer_overhead_s: fixed time per layer.
    """

    name: str
    peak_flops: float
    efficiency: float
    memory_bytes: float
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    devices_per_node: int
    host_bandwidth: float = 50e9
    layer_overhead_s: float = 0.0
    source: str = ""

    @classmethod
    def from_dict(cls, doc: dict) -> "HardwareSpec":
        return _from_dict(cls, doc, "hardware spec")

    @classmethod
    def load(cls, path) -> "HardwareSpec":
        return cls.from_dict(_read_json(path, "hardware spec"))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Profile:
    """Fitted costs of one cluster: layer models per module kind and alpha-beta per link/collective.

    layers: kind ("llm", "encoder", or "default" as fallback) -> LayerModel.
    links: "intra"/"inter" -> per-hop alpha and per-byte beta used by the ring formulas.
    collectives: kind -> link -> group size -> AlphaBeta measured for that whole collective
    (t = alpha + bytes * beta); overrides the ring formula at that size.
    overheads (measured profiles; empty: not modelled): name -> LayerModel t = a + b * x of the work
    outside the transformer layers: "data" (a rank building a run's samples from the data source,
    every LLM stage per micro-batch and an encoder's first stage per run: x = samples * LLM seq),
    "llm_io" (per LLM micro-batch on its last stage: embedding, output layer, loss; x = output-layer
    FLOPs per rank), "encoder_io" (per encoder pass on its last
    stage: patch embedding, projector; x = projector FLOPs per rank), "<kind>_io_tp" (with TP > 1: x =
    the time of one all-reduce of the run's activation over the TP group, b = how many such
    all-reduces the embedding, output layer and loss / projector add), "optimizer" (per module stage
    per step: x = parameters on the rank), "snapshot" (one resident-state snapshot of a module stage,
    x = parameters on the rank; `SNAPSHOTS` per step), "grad_sync" (communication that closes a phase,
    when ranks arrive as their own work ends, measured on the DDP wrapper's gradient all-reduce after
    the backward pass: x = the formula's time for the same bytes and group; applied to the gradient
    and loss all-reduces, the pipeline p2p and the boundary exchanges, see `synced`).
    layer_collectives (measured profiles): like `collectives`, for the TP all-reduces and CP
    all-gathers as they run inside a transformer layer (interleaved with its compute), fitted from
    the layer measurements; `layer_parts` prefers them.
    cores, concurrency (measured profiles; 0: every rank has its own device): the ranks share `cores`
    execution units (a CPU machine), and every time in this profile was measured with
    `concurrency` ranks busy at once (see `shared_step`).
    cpu_cores (measured profiles; 0: unknown): the machine's physical execution units. With it, the
    units' throughput with k ranks runnable (`cores_at`) runs from k (k <= cpu_cores) down to the
    measured `cores` at k = concurrency (oversubscribed ranks lose time to switching and caches).
    """

    layers: dict
    links: dict
    devices_per_node: int
    memory_bytes: float
    host_bandwidth: float = 50e9
    collectives: dict = field(default_factory=dict)
    source: str = ""
    overheads: dict = field(default_factory=dict)
    cores: float = 0.0
    concurrency: int = 0
    layer_collectives: dict = field(default_factory=dict)
    cpu_cores: float = 0.0

    @property
    def shared(self) -> bool:
        """Whether ranks share execution units (the step is bounded by the ranks' total work)."""
        return self.cores > 0

    @property
    def uncontended(self) -> float:
        """Factor from this profile's times (measured with `concurrency` busy ranks) to the time of
        the same work with the execution units to itself: min(1, cores / concurrency)."""
        if not self.shared or self.concurrency <= 0:
            return 1.0
        return min(1.0, self.cores / self.concurrency)

    def cores_at(self, k):
        """Throughput of the shared units (in ranks' worth of uncontended work per second) with k
        ranks runnable: k up to `cpu_cores`; beyond, C / (1 + g * (k - C)), g fitted so that the
        throughput at k = `concurrency` is the measured `cores` (g >= 0). Without `cpu_cores`: the
        measured `cores` at every k (the rule of profiles taken before it was recorded)."""
        k = np.asarray(k, dtype=float)
        C, W = self.cpu_cores, float(self.concurrency)
        if C <= 0 or W <= C:
            return np.full_like(k, self.cores)
        if self.cores >= C:  # no measurable loss to oversubscription
            return np.clip(k, 1e-12, self.cores)
        g = max(C / self.cores - 1.0, 0.0) / (W - C)
        return np.where(k <= C, np.maximum(k, 1e-12), C / (1.0 + g * (k - C)))

    def overhead_time(self, name: str, x):
        """Time of overhead `name` (0 when the profile does not model it)."""
        model = self.overheads.get(name)
        if model is None:
            return np.zeros_like(np.asarray(x, dtype=float))
        return model.time(x)

    @classmethod
    def from_hardware(cls, hw: HardwareSpec) -> "Profile":
        """A simulated profile: b = 1 / (peak * efficiency), links from bandwidth and latency."""
        return cls(
            layers={"default": LayerModel(a=hw.layer_overhead_s, b=1.0 / (hw.peak_flops * hw.efficiency))},
            links={
                "intra": AlphaBeta(hw.intra_latency, 1.0 / hw.intra_bandwidth),
                "inter": AlphaBeta(hw.inter_latency, 1.0 / hw.inter_bandwidth),
            },
            devices_per_node=hw.devices_per_node,
            memory_bytes=hw.memory_bytes,
            host_bandwidth=hw.host_bandwidth,
            source=f"simulated from {hw.name}",
        )

    def layer_model(self, kind: str) -> LayerModel:
        model = self.layers.get(kind) or self.layers.get("default")
        if model is None:
            raise ValueError(f"profile has no layer model for {kind!r} (and no 'default'); has {sorted(self.layers)}")
        return model

    def layer_time(self, kind: str, flops_per_rank):
        return self.layer_model(kind).time(flops_per_rank)

    def collective_time(self, kind: str, nbytes, n, inter):
        """Time of collective `kind` moving `nbytes` over `n` ranks (0 where n <= 1)."""
        n = np.asarray(n, dtype=float)
        nbytes = np.asarray(nbytes, dtype=float)
        inter = np.asarray(inter, dtype=bool)
        lo, hi = self.links["intra"], self.links["inter"]
        alpha = np.where(inter, hi.alpha, lo.alpha)
        beta = np.where(inter, hi.beta, lo.beta)
        hops, frac = ring_factors(kind, n)
        t = hops * alpha + frac * nbytes * beta
        for link, table in self.collectives.get(kind, {}).items():
            for size, ab in table.items():
                sel = (n == int(size)) & (inter == (link == "inter"))
                t = np.where(sel, ab.alpha + nbytes * ab.beta, t)
        return np.where(n > 1, t, 0.0)

    def layer_collective_time(self, kind: str, nbytes, n, inter):
        """`collective_time`, with the in-layer table where it has (kind, link, n)."""
        t = self.collective_time(kind, nbytes, n, inter)
        n = np.asarray(n, dtype=float)
        nbytes = np.asarray(nbytes, dtype=float)
        inter = np.asarray(inter, dtype=bool)
        for link, table in self.layer_collectives.get(kind, {}).items():
            for size, ab in table.items():
                sel = (n == int(size)) & (inter == (link == "inter"))
                t = np.where(sel & (n > 1), ab.alpha + nbytes * ab.beta, t)
        return t

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "devices_per_node": self.devices_per_node,
            "memory_bytes": self.memory_bytes,
            "host_bandwidth": self.host_bandwidth,
            "layers": {k: dataclasses.asdict(v) for k, v in self.layers.items()},
            "links": {k: dataclasses.asdict(v) for k, v in self.links.items()},
            "collectives": _tables_to_dict(self.collectives),
            "overheads": {k: dataclasses.asdict(v) for k, v in self.overheads.items()},
            "layer_collectives": _tables_to_dict(self.layer_collectives),
            "cores": self.cores,
            "concurrency": self.concurrency,
            "cpu_cores": self.cpu_cores,
        }

    @classmethod
    def from_dict(cls, doc: dict) -> "Profile":
        if not isinstance(doc, dict):
            raise ValueError(f"a profile must be a JSON object, got {type(doc).__name__}")
        try:
            layers = {k: LayerModel(float(v["a"]), float(v["b"])) for k, v in doc["layers"].items()}
            links = {k: AlphaBeta(float(v["alpha"]), float(v["beta"])) for k, v in doc["links"].items()}
            coll = _tables_from_dict(doc.get("collectives", {}))
            layer_coll = _tables_from_dict(doc.get("layer_collectives", {}))
            overheads = {k: LayerModel(float(v["a"]), float(v["b"])) for k, v in doc.get("overheads", {}).items()}
            unknown = sorted(set(overheads) - set(OVERHEADS))
            if unknown:
                raise ValueError(f"profile: unknown overheads {unknown}; names are {list(OVERHEADS)}")
            prof = cls(
                layers=layers,
                links=links,
                devices_per_node=int(doc["devices_per_node"]),
                memory_bytes=float(doc["memory_bytes"]),
                host_bandwidth=float(doc.get("host_bandwidth", 50e9)),
                collectives=coll,
                source=str(doc.get("source", "")),
                overheads=overheads,
                cores=float(doc.get("cores", 0.0)),
                concurrency=int(doc.get("concurrency", 0)),
                layer_collectives=layer_coll,
                cpu_cores=float(doc.get("cpu_cores", 0.0)),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"profile is missing or has a malformed field: {exc!r}") from None
        missing = [k for k in LINKS if k not in prof.links]
        if missing:
            raise ValueError(f"profile: links {missing} missing; need alpha/beta for {list(LINKS)}")
        return prof

    @classmethod
    def load(cls, path) -> "Profile":
        return cls.from_dict(_read_json(path, "profile"))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _tables_to_dict(tables: dict) -> dict:
    return {
        k: {link: {str(n): dataclasses.asdict(ab) for n, ab in t.items()} for link, t in v.items()}
        for k, v in tables.items()
    }


def _tables_from_dict(doc: dict) -> dict:
    out = {}
    for kind, per_link in doc.items():
        if kind not in COLLECTIVES:
            raise ValueError(f"profile: unknown collective {kind!r}; kinds are {list(COLLECTIVES)}")
        out[kind] = {
            link: {int(n): AlphaBeta(float(ab["alpha"]), float(ab["beta"])) for n, ab in t.items()}
            for link, t in per_link.items()
        }
    return out


def _read_json(path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {str(path)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} file {str(path)!r} is not valid JSON: {exc}") from None


def _from_dict(cls, doc: dict, what: str):
    if not isinstance(doc, dict):
        raise ValueError(f"a {what} must be a JSON object, got {type(doc).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; allowed keys are {sorted(names)}")
    try:
        return cls(**doc)
    except TypeError as exc:
        raise ValueError(f"{what}: {exc}") from None
