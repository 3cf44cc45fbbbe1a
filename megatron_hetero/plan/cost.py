"""Cost model: step time and per-rank memory of a heterogeneous configuration. Pure (numpy only).

Every primitive below works elementwise on numpy arrays as well as on scalars, so the search can
evaluate whole candidate arrays at once (`plan/search.py`) with exactly the formulas that the
scalar reference `evaluate()` uses here.

Formulas (all times in seconds, per *micro-batch*, forward + backward, unless stated otherwise)
-------------------------------------------------------------------------------------------------
Layer FLOPs (Megatron counting, training = 3 x forward; T = tokens of the micro-batch replica,
s = sequence per sample, h = hidden, f = ffn hidden, m = 3 MLP matrices if gated (SwiGLU) else 2):
    F = 3 * (8*T*h^2 + 2*m*T*h*f + 4*T*s*h)
Layer compute time on one rank (the profile's `LayerModel` of the module kind):
    t = a + b * F / (tp * cp_eff)          cp_eff = cp if the module shards its sequence else 1
  a: per-layer fixed overhead (launches, small kernels); b: seconds per FLOP (1 / achieved FLOP/s).
  Encoders do not shard their (short, resolution-bound) sequence over CP: as in Megatron's LLaVA,
  the encoder runs replicated on every CP rank (`ModelSpec.shards_sequence`).
TP (sequence-parallel: 2 all-gathers + 2 reduce-scatters forward, the same backward = 4 all-reduce
volumes of the rank's activation, A = T/cp_eff * h * dtype bytes):
    t_tp = 4 * allreduce(A, n=tp)
CP (ring attention: K and V of the rank's heads circulate forward, K,V again + dK,dV backward),
overlapped with the attention-score compute (Megatron's ring attention); only the excess is exposed:
    t_cp = max(0, 3 * allgather(2 * T * h/tp * dtype, n=cp) - b * 3 * 4*T*s*h / (tp * cp))
Pipeline p2p per stage (activation forward + its gradient backward, one exchange each):
    t_pp = 2 * sendrecv(T/cp_eff * h * dtype)          (only when the module has > 1 stage)
Collectives, alpha-beta per link (intra-node NVLink or inter-node network), ring algorithms:
    all-reduce      2(n-1)*alpha + 2(n-1)/n * bytes * beta
    all-gather / reduce-scatter   (n-1)*alpha + (n-1)/n * bytes * beta   (bytes = gathered size)
    broadcast       ceil(log2 n)*alpha + bytes * beta                    (pipelined)
    send/recv       alpha + bytes * beta
  A group uses the inter-node link when the ranks it spans (group size x stride) exceed a node.
  Measured per-(kind, link, n) alpha-beta pairs in a `Profile` override the ring formula.
Data-parallel gradient reduction, once per step (fp32 main grads, group dp*cp), and the all-reduce
of the step's loss over the world (breakdown: dp_comm):
    t_dp = allreduce(params_per_rank * grad_bytes, n=dp*cp) + allreduce(8, n=world)
Pipeline of stages with per-micro-batch costs c_i and B micro-batches (1F1B):
    t_pipe = sum_i c_i + (B-1) * max_i c_i
  Breakdown: the bottleneck stage's components x B are compute/tp/cp/pp/boundary; the rest
  (sum of the other stages: fill and drain) is the bubble.
Memory per rank (bytes):
    state = params_rank * (weight_bytes + grad_bytes + optimizer_bytes [/ dp*cp: distributed optimizer])
  (defaults: bf16 weights 2, fp32 main grads 4, Adam fp32 master + 2 moments 12, distributed optimizer on)
    activations per layer per micro-batch = T/cp_eff * h * activation_bytes / tp
  (activation_bytes = 34: Korthikanti et al. with sequence parallelism and flash attention).
  1F1B stage i of P holds min(P - i, B) micro-batches of activations.

Placements (see `evaluate`):
- homogeneous: the encoder runs on the LLM's layout inside LLM pipeline stage 0 (Megatron LLaVA);
  stage 0 holds `first_stage_layers` LLM layers, the rest are split evenly.
- colocated (three-phase, as `runtime/colocated.py` runs it): encoder forward phase, one pass over the
  rank's encoder-DP share (G * images / dp_enc images; with pp_enc > 1 the whole share goes stage to
  stage, not pipelined: the stages' costs add up), LLM 1F1B pipeline, encoder backward phase (one
  pass); encoder activations of the whole step are held across the LLM phase; with
  `offload` the encoder's parameters/grads/optimizer state leave the device during the LLM phase
  (costing 2 * state / host_bandwidth).
- disjoint: one 1F1B pipeline through the encoder island's stages and the LLM island's segments;
  the bottleneck is the most expensive stage of either island; each island reduces its own
  gradients concurrently (the step waits for the slower).
Boundaries (encoder -> LLM, forward activations + backward gradients):
- disjoint, per micro-batch, on the LLM's first stage: 2 * sendrecv(samples/dp_llm * image_tokens
  / cp_llm * h * dtype), the bytes one destination rank needs (direct routing spreads senders; the
  encoder's projector runs in the encoder module, so its tokens cross at the LLM's hidden size h);
- colocated, once per step: 2 * allgather(G/dp_llm * image_tokens/cp_llm * h * dtype,
  n = max(fan factor, 2)); zero when both sides are single-stage with the same rank -> DP map.
Measured overheads (a `Profile` from `megatron-hetero profile`; absent from simulated profiles: 0):
  per run, building the run's samples `overheads["data"]` (x = samples * seq: every LLM stage, an
  encoder's first stage); per run of a module's last stage, its work outside the layers,
  `overheads["<kind>_io"]` at x = 6 * T * h * vocab / tp (LLM: embedding, output layer, loss) or 6 * T * (h_enc * h + h^2)
  / tp (encoder: patch embedding, projector), plus with TP `overheads["<kind>_io_tp"].b` all-reduces of
  the run's activation (T/cp * h * dtype) over the TP group; per stage and step, the optimizer step
  `overheads["optimizer"]` at x = parameters on the rank, and SNAPSHOTS[placement] resident-state
  snapshots `overheads["snapshot"]` (breakdown field `optimizer`); communication that closes a phase
  (gradient and loss all-reduces, pipeline p2p, boundaries) goes through `overheads["grad_sync"]`
  (t = a + b * the formula's time: ranks arrive as their own work ends) when measured. The step's
  once-per-step tail is that of the stage with the longest dp + optimizer time.
Shared execution units (`Profile.cores` > 0, e.g. ranks forked on one CPU machine; the profile's times
were measured with `Profile.concurrency` ranks busy at once): the step is
    max(work, critical * min(1, cores / concurrency))
  work: the mean rank's busy time, sum over stages of ranks x (runs x stage cost + dp + optimizer),
  over the world, plus the whole-step terms (colocated boundary, offload); critical: the formulas
  above (the critical path at the profile's sharing, scaled to a rank with the units to itself).
  The breakdown then gives the mean rank's busy time per part and the rest of the step as bubble.
Not modelled (deliberately simple): overlap of TP/DP/p2p communication with compute, embedding and
output-layer FLOPs in simulated profiles (their parameters count for memory), grouped-query
attention, activation recomputation. Colocated memory adds the worst LLM stage and the worst encoder
stage (a rank may host both).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
LINKS = ("intra", "inter")
PLACEMENT_KINDS = ("homogeneous", "colocated", "disjoint")
OVERHEADS = ("llm_io", "encoder_io", "llm_io_tp", "encoder_io_tp", "optimizer", "snapshot", "grad_sync", "data")
#: resident-state snapshots per module per step (the runtimes report memory per phase / per step)
SNAPSHOTS = {"colocated": 3, "disjoint": 1, "homogeneous": 0}


# ---------------------------------------------------------------------------------------------
# Fitted models and the profile
# ---------------------------------------------------------------------------------------------
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
    """Published figures of one accelerator type and its cluster (JSON file; see examples/hardware/).

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
            links={"intra": AlphaBeta(hw.intra_latency, 1.0 / hw.intra_bandwidth),
                   "inter": AlphaBeta(hw.inter_latency, 1.0 / hw.inter_bandwidth)},
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
            prof = cls(layers=layers, links=links, devices_per_node=int(doc["devices_per_node"]),
                       memory_bytes=float(doc["memory_bytes"]),
                       host_bandwidth=float(doc.get("host_bandwidth", 50e9)), collectives=coll,
                       source=str(doc.get("source", "")), overheads=overheads,
                       cores=float(doc.get("cores", 0.0)), concurrency=int(doc.get("concurrency", 0)),
                       layer_collectives=layer_coll)
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
    return {k: {link: {str(n): dataclasses.asdict(ab) for n, ab in t.items()} for link, t in v.items()}
            for k, v in tables.items()}


def _tables_from_dict(doc: dict) -> dict:
    out = {}
    for kind, per_link in doc.items():
        if kind not in COLLECTIVES:
            raise ValueError(f"profile: unknown collective {kind!r}; kinds are {list(COLLECTIVES)}")
        out[kind] = {link: {int(n): AlphaBeta(float(ab["alpha"]), float(ab["beta"])) for n, ab in t.items()}
                     for link, t in per_link.items()}
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


# ---------------------------------------------------------------------------------------------
# Workload and candidates
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """One module's size. seq: tokens per sample (encoder: patches per image; LLM: context).

    params: total parameters (default: layers * (4h^2 + m*h*f) + 2 * vocab * h, untied embedding
    and output layer). shards_sequence: whether CP splits this module's sequence (default: LLMs yes,
    encoders no: they run replicated over CP ranks).
    """

    name: str
    num_layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    seq: int
    kind: str = "llm"
    vocab: int = 0
    gated: bool = False
    params: Optional[int] = None
    shards_sequence: Optional[bool] = None

    def __post_init__(self):
        for key in ("num_layers", "hidden", "ffn_hidden", "heads", "seq"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name}: {key} must be a positive integer, got {v!r}")

    @property
    def shards(self) -> bool:
        return self.kind == "llm" if self.shards_sequence is None else bool(self.shards_sequence)

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding (= of the output layer): vocab * hidden."""
        return self.vocab * self.hidden

    @property
    def layer_params(self) -> float:
        if self.params is not None:
            return (self.params - 2 * self.embedding_params) / self.num_layers
        m = 3 if self.gated else 2
        return 4 * self.hidden ** 2 + m * self.hidden * self.ffn_hidden

    @property
    def total_params(self) -> float:
        return self.layer_params * self.num_layers + 2 * self.embedding_params


@dataclass(frozen=True)
class Workload:
    """One training step: `global_batch` samples, LLM micro-batches of `micro_batch` samples per DP
    replica, `images_per_sample` encoder inputs (of `encoder.seq` patches) per sample, and the
    byte sizes of the memory model (see module docstring).

    Micro-batches: a pipeline micro-batch carries M = micro_batch * dp samples (the largest dp of
    the LLM segments), B = global_batch / M. Colocated encoders run once per step over their DP share
    (global_batch * images_per_sample / dp_enc images).
    """

    encoder: ModelSpec
    llm: ModelSpec
    global_batch: int
    micro_batch: int = 1
    images_per_sample: int = 1
    dtype_bytes: int = 2
    weight_bytes: float = 2.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 12.0
    distributed_optimizer: bool = True
    activation_bytes: float = 34.0

    def __post_init__(self):
        for key in ("global_batch", "micro_batch", "images_per_sample", "dtype_bytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"workload: {key} must be a positive integer, got {v!r}")

    @property
    def image_tokens(self) -> int:
        """Encoder tokens entering the LLM per sample."""
        return self.images_per_sample * self.encoder.seq


@dataclass(frozen=True)
class Segment:
    """A module (or a pipeline segment of the LLM) on its layout, holding `layers` layers."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    layers: int = 0

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def short(self) -> str:
        return f"TP{self.tp}·CP{self.cp}·PP{self.pp}·DP{self.dp}"


@dataclass(frozen=True)
class Candidate:
    """One configuration. encoder_ranks: size of the encoder island (disjoint; else 0).
    offload: colocated encoder state offloaded during the LLM phase. first_stage_layers:
    homogeneous with pp > 1, the LLM layers sharing stage 0 with the encoder. The LLM is one
    segment, or (disjoint) a chain of segments with their own TP/DP and contiguous layers."""

    placement: str
    encoder: Segment
    llm: tuple
    encoder_ranks: int = 0
    offload: bool = False
    first_stage_layers: int = 0

    @property
    def world_size(self) -> int:
        if self.placement == "disjoint":
            return self.encoder.size + sum(s.size for s in self.llm)
        return self.llm[0].size

    def describe(self) -> str:
        llm = " + ".join(f"{s.short()}[{s.layers}L]" if len(self.llm) > 1 else s.short() for s in self.llm)
        text = f"{self.placement}: encoder {self.encoder.short()}, LLM {llm}"
        if self.placement == "disjoint":
            text += f", islands {self.encoder.size}+{self.world_size - self.encoder.size}"
        if self.offload:
            text += ", encoder offload"
        if self.placement == "homogeneous" and self.llm[0].pp > 1:
            text += f", stage-0 LLM layers {self.first_stage_layers}"
        return text

    def to_dict(self) -> dict:
        return {"placement": self.placement, "encoder": dataclasses.asdict(self.encoder),
                "llm": [dataclasses.asdict(s) for s in self.llm], "encoder_ranks": self.encoder_ranks,
                "offload": self.offload, "first_stage_layers": self.first_stage_layers}

    def to_layout(self, encoder_name: str = "vision", llm_name: str = "language"):
        """The resolved `HeteroLayout` of this candidate (homogeneous -> colocated, equal layouts)."""
        from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout, RankRange
        from megatron_hetero.layout.validate import resolve_layout

        e = self.encoder
        enc = ModuleLayout(name=encoder_name, tp=e.tp, cp=e.cp, pp=e.pp, dp=e.dp)
        if len(self.llm) == 1:
            s = self.llm[0]
            mods = [enc, ModuleLayout(name=llm_name, tp=s.tp, cp=s.cp, pp=s.pp, dp=s.dp)]
        else:
            mods, start = [enc], 0
            for i, s in enumerate(self.llm):
                mods.append(ModuleLayout(name=f"{llm_name}_{chr(ord('a') + i)}", tp=s.tp, cp=s.cp, pp=s.pp,
                                         dp=s.dp, layers=RankRange(start, start + s.layers - 1)))
                start += s.layers
        names = [m.name for m in mods]
        edges = tuple(Edge(a, b) for a, b in zip(names, names[1:]))
        placement = "disjoint" if self.placement == "disjoint" else "colocated"
        return resolve_layout(HeteroLayout(placement=placement, modules=tuple(mods), edges=edges), self.world_size)


@dataclass(frozen=True)
class CostBreakdown:
    """Step time split (seconds) and the per-rank memory peak (bytes); total = sum of the times
    (compute + tp_comm + cp_comm + pp_comm + dp_comm + boundary + offload + bubble + optimizer).
    On a profile whose ranks share execution units the parts are the mean rank's busy time and
    `bubble` is the rest of the step (waiting)."""

    compute: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    dp_comm: float
    boundary: float
    offload: float
    bubble: float
    total: float
    memory_per_rank_peak: float
    micro_batches: int
    optimizer: float = 0.0  # once per step: optimizer step(s) (profiles that model it)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Array-friendly primitives (shared by `evaluate` and the vectorized search)
# ---------------------------------------------------------------------------------------------
def _cp_eff(spec: ModelSpec, cp):
    return cp if spec.shards else np.ones_like(np.asarray(cp))


def layer_parts(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp):
    """(compute, tp_comm, cp_comm) of one layer, one micro-batch of `samples` per replica."""
    cpe = _cp_eff(spec, cp)
    tokens = np.asarray(samples, dtype=float) * spec.seq
    flops = layer_flops(tokens, spec.seq, spec.hidden, spec.ffn_hidden, spec.gated) / (np.asarray(tp) * cpe)
    compute = prof.layer_time(spec.kind, flops)
    dpn = prof.devices_per_node
    act = tokens / cpe * spec.hidden * wl.dtype_bytes
    tpc = 4.0 * prof.layer_collective_time("all_reduce", act, tp, np.asarray(tp) > dpn)
    if spec.shards:
        kv = 2.0 * tokens * spec.hidden / np.asarray(tp) * wl.dtype_bytes
        ring = 3.0 * prof.layer_collective_time("all_gather", kv, cp, np.asarray(tp) * cp > dpn)
        attention = prof.layer_model(spec.kind).b * 12.0 * tokens * spec.seq * spec.hidden / (np.asarray(tp) * cpe)
        cpc = np.maximum(ring - attention, 0.0)
    else:
        cpc = np.zeros_like(compute)
    return compute, tpc, cpc


def synced(prof: Profile, t):
    """Time of communication that closes a phase (ranks arrive as their own work ends): the
    profile's measured `grad_sync` overhead applied to the formula's time `t` (t where the profile
    has none; 0 stays 0)."""
    if "grad_sync" not in prof.overheads:
        return t
    t = np.asarray(t, dtype=float)
    return np.where(t > 0, prof.overhead_time("grad_sync", t), 0.0)


def p2p_time(prof: Profile, wl: Workload, spec: ModelSpec, samples, cp, inter):
    """Pipeline exchange of one stage per micro-batch: 2 * sendrecv(tokens/cp_eff * h * dtype)."""
    nbytes = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp) * spec.hidden * wl.dtype_bytes
    return synced(prof, 2.0 * prof.collective_time("send_recv", nbytes, 2, inter))


def state_bytes(wl: Workload, params_rank, dp_group):
    """Weights + fp32 grads + optimizer state of `params_rank` parameters."""
    opt = wl.optimizer_bytes / (np.asarray(dp_group, dtype=float) if wl.distributed_optimizer else 1.0)
    return np.asarray(params_rank, dtype=float) * (wl.weight_bytes + wl.grad_bytes + opt)


def act_bytes(wl: Workload, spec: ModelSpec, samples, tp, cp, layers):
    """Activations kept for backward by `layers` layers for one micro-batch."""
    tokens = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp)
    return np.asarray(layers, dtype=float) * tokens * spec.hidden * wl.activation_bytes / np.asarray(tp)


def dp_time(prof: Profile, wl: Workload, params_rank, tp, cp, dp):
    """Once per step: all-reduce of the rank's fp32 grads over dp*cp ranks (through the profile's
    measured `grad_sync` overhead where it has one)."""
    n = np.asarray(dp) * cp
    t = prof.collective_time("all_reduce", np.asarray(params_rank, dtype=float) * wl.grad_bytes, n,
                             np.asarray(tp) * n > prof.devices_per_node)
    return prof.overhead_time("grad_sync", t) if "grad_sync" in prof.overheads else t  # also at n = 1


def loss_reduce(prof: Profile, world):
    """Once per step: the all-reduce of the step's loss over every rank (8 bytes); like the gradient
    reduction it closes a phase, so it goes through the profile's `grad_sync` overhead too."""
    return synced(prof, prof.collective_time("all_reduce", 8.0, world, np.asarray(world) > prof.devices_per_node))


def disjoint_boundary(prof: Profile, wl: Workload, samples_dst, cp_dst, world_size):
    """Encoder -> LLM per micro-batch on the LLM's first stage: 2 * sendrecv of what one LLM rank
    needs (its samples, its CP share of the image tokens, projected to the LLM's hidden size)."""
    nbytes = np.asarray(samples_dst, dtype=float) * wl.image_tokens / cp_dst * wl.llm.hidden * wl.dtype_bytes
    return synced(prof, 2.0 * prof.collective_time("send_recv", nbytes, 2, np.asarray(world_size) > prof.devices_per_node))


def colocated_boundary(prof: Profile, wl: Workload, enc_tp, enc_cp, enc_pp, enc_dp, tp, cp, pp, dp):
    """Whole-step colocated transform, forward + backward: 2 * allgather(needed bytes, n=factor).

    Zero when both modules are single-stage with the same DP and the same rank -> DP-shard map (every
    rank already holds its shard). Otherwise each LLM rank assembles its (G/dp samples, CP share)
    shard from n = max(fan factor, 2) colocated ranks; intra-node when tp*cp*factor fits a node.
    """
    factor = np.maximum(enc_dp, dp) // np.minimum(enc_dp, dp)
    n = np.maximum(factor, 2)
    nbytes = wl.global_batch / np.asarray(dp, dtype=float) * wl.image_tokens / cp * wl.llm.hidden * wl.dtype_bytes
    t = synced(prof, 2.0 * prof.collective_time("all_gather", nbytes, n, np.asarray(tp) * cp * factor > prof.devices_per_node))
    same = (np.asarray(enc_pp) == 1) & (np.asarray(pp) == 1) & (np.asarray(enc_dp) == dp) & (
        np.asarray(enc_tp) * enc_cp == np.asarray(tp) * cp)
    return np.where(same, 0.0, t)


def distribute(layers: int, stages: int) -> list[int]:
    """Layers per stage: as even as possible, the extra layers on the first stages."""
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


# ---------------------------------------------------------------------------------------------
# Scalar reference evaluation: explicit stage lists
# ---------------------------------------------------------------------------------------------
@dataclass
class _Stage:
    """One pipeline stage of one module: per-run costs (a run = one micro-batch, or the whole share
    for a colocated encoder), once-per-step costs, and how many ranks run it."""

    compute: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    pp: float = 0.0
    boundary: float = 0.0
    params: float = 0.0  # parameters per rank
    ranks: int = 1  # ranks that run this stage (tp * cp * dp of its module)
    runs: int = 1  # runs per step
    dp: float = 0.0  # once per step: gradient all-reduce
    opt: float = 0.0  # once per step: optimizer step

    @property
    def cost(self) -> float:
        return self.compute + self.tp + self.cp + self.pp + self.boundary

    @property
    def tail(self) -> float:
        return self.dp + self.opt


def io_flops(wl: Workload, spec: ModelSpec, samples, tp, cp):
    """FLOPs per rank (fwd+bwd) of a module's work outside its layers, per run: the LLM's output
    layer (6 * T * h * vocab), an encoder's projector to the LLM's hidden size (6 * T * (h_e * h + h^2))."""
    tokens = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp)
    if spec.kind == "encoder":
        per_token = spec.hidden * wl.llm.hidden + wl.llm.hidden ** 2
    else:
        per_token = spec.hidden * spec.vocab
    return 6.0 * tokens * per_token / np.asarray(tp)


def io_allreduce(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp):
    """One all-reduce of a run's activation (T/cp_eff * h * dtype) over the TP group (0 at tp = 1)."""
    tokens = np.asarray(samples, dtype=float) * spec.seq / _cp_eff(spec, cp)
    return prof.collective_time("all_reduce", tokens * wl.llm.hidden * wl.dtype_bytes, tp,
                                np.asarray(tp) > prof.devices_per_node)


def io_time(prof: Profile, wl: Workload, spec: ModelSpec, samples, tp, cp):
    """The profile's `<kind>_io` overhead of one run (0 where not modelled), plus, with TP, its
    `<kind>_io_tp` count of activation all-reduces over the TP group (embedding, output layer,
    vocab-parallel loss / projector)."""
    t = prof.overhead_time(f"{spec.kind}_io", io_flops(wl, spec, samples, tp, cp))
    if f"{spec.kind}_io_tp" in prof.overheads:
        t = t + prof.overhead_time(f"{spec.kind}_io_tp", io_allreduce(prof, wl, spec, samples, tp, cp))
    return t


def _add_layers(st: _Stage, prof, wl, spec, layers, samples, seg: Segment) -> None:
    c, t, p = (float(x) for x in layer_parts(prof, wl, spec, samples, seg.tp, seg.cp))
    st.compute += layers * c
    st.tp += layers * t
    st.cp += layers * p


def data_time(prof: Profile, wl: Workload, samples):
    """The profile's `data` overhead: a rank building `samples` samples (0 where not modelled)."""
    return prof.overhead_time("data", np.asarray(samples, dtype=float) * wl.llm.seq)


def _module_stages(prof, wl, spec: ModelSpec, seg: Segment, layers_per_stage, samples, with_p2p: bool,
                   world: int, embed_first: bool = False, embed_last: bool = False, io_last: bool = False,
                   runs: int = 1, data: str = "none") -> list[_Stage]:
    """data: which stages build the run's samples: "all" (language model), "first" (encoder: the
    samples of its images), "none"."""
    out = []
    n = len(layers_per_stage)
    t_data = float(data_time(prof, wl, samples / wl.images_per_sample if data == "first" else samples))
    for i, lay in enumerate(layers_per_stage):
        st = _Stage(ranks=seg.tp * seg.cp * seg.dp, runs=runs)
        _add_layers(st, prof, wl, spec, lay, samples, seg)
        if data == "all" or (data == "first" and i == 0):
            st.compute += t_data
        if with_p2p:
            st.pp = float(p2p_time(prof, wl, spec, samples, seg.cp, world > prof.devices_per_node))
        if io_last and i == n - 1:
            st.compute += float(io_time(prof, wl, spec, samples, seg.tp, seg.cp))
        params = lay * spec.layer_params + spec.embedding_params * ((embed_first and i == 0) + (embed_last and i == n - 1))
        st.params = params / seg.tp
        out.append(st)
    return out


def _tails(prof: Profile, wl: Workload, stages: list[_Stage], seg_of: list[Segment], placement: str) -> None:
    """Fill each stage's once-per-step costs: gradient all-reduce, optimizer step (+ the runtime's
    resident-state snapshots)."""
    for st, seg in zip(stages, seg_of):
        st.dp = float(dp_time(prof, wl, st.params, seg.tp, seg.cp, seg.dp))
        st.opt = float(prof.overhead_time("optimizer", st.params)
                       + SNAPSHOTS[placement] * prof.overhead_time("snapshot", st.params))


def _pipeline(stages: list[_Stage], b: int) -> tuple[float, dict, float]:
    """(1F1B time, bottleneck components x B, bubble)."""
    costs = [s.cost for s in stages]
    top = max(range(len(stages)), key=lambda i: costs[i])
    total = sum(costs) + (b - 1) * costs[top]
    st = stages[top]
    comp = {k: b * getattr(st, k) for k in ("compute", "tp", "cp", "pp", "boundary")}
    return total, comp, total - b * costs[top]


def _slowest_tail(stages: list[_Stage]) -> tuple[float, float]:
    """(dp, optimizer) of the stage whose once-per-step work is the longest."""
    st = max(stages, key=lambda s: s.tail)
    return st.dp, st.opt


def check_candidate(c: Candidate, wl: Workload) -> int:
    """ValueError unless `c` splits the workload evenly; returns the number of micro-batches B."""
    if c.placement not in PLACEMENT_KINDS:
        raise ValueError(f"placement must be one of {list(PLACEMENT_KINDS)}, got {c.placement!r}")
    llm = c.llm
    if not llm or sum(s.layers for s in llm) != wl.llm.num_layers:
        raise ValueError(f"LLM segments hold {sum(s.layers for s in llm)} layers, the LLM has {wl.llm.num_layers}")
    if c.placement != "disjoint" and len(llm) != 1:
        raise ValueError(f"{c.placement}: the LLM must be one segment, got {len(llm)}")
    mb = wl.micro_batch * max(s.dp for s in llm)
    if wl.global_batch % mb:
        raise ValueError(f"global batch {wl.global_batch} is not divisible by micro-batch {wl.micro_batch} * "
                         f"LLM dp {max(s.dp for s in llm)} = {mb}")
    for s in llm:
        if mb % s.dp:
            raise ValueError(f"pipeline micro-batch {mb} is not divisible by segment dp {s.dp}")
        if s.layers < s.pp:
            raise ValueError(f"segment {s.short()} holds {s.layers} layers, fewer than its pp {s.pp}")
    e = c.encoder
    if e.layers != wl.encoder.num_layers or e.layers < e.pp:
        raise ValueError(f"encoder segment holds {e.layers} layers; the encoder has {wl.encoder.num_layers} (>= pp {e.pp})")
    batch = mb if c.placement == "disjoint" else wl.global_batch
    if batch % e.dp:
        raise ValueError(f"encoder dp {e.dp} does not divide the {batch} samples crossing the boundary")
    if c.placement == "homogeneous":
        s = llm[0]
        if (e.tp, e.cp, e.pp, e.dp) != (s.tp, s.cp, s.pp, s.dp):
            raise ValueError(f"homogeneous: encoder {e.short()} must equal the LLM's layout {s.short()}")
        if s.pp > 1 and not 1 <= c.first_stage_layers <= s.layers - (s.pp - 1):
            raise ValueError(f"homogeneous: first_stage_layers {c.first_stage_layers} outside 1..{s.layers - s.pp + 1}")
    return wl.global_batch // mb


def evaluate(c: Candidate, wl: Workload, prof: Profile) -> CostBreakdown:
    """Step time and per-rank memory peak of candidate `c` (formulas in the module docstring)."""
    b = check_candidate(c, wl)
    fn = {"homogeneous": _eval_homogeneous, "colocated": _eval_colocated, "disjoint": _eval_disjoint}[c.placement]
    return fn(c, wl, prof, b)


def _mem(wl, st: _Stage, seg: Segment, acts: float) -> float:
    return float(state_bytes(wl, st.params, seg.dp * seg.cp)) + acts


_PARTS = ("compute", "tp", "cp", "pp", "boundary")


def _finish(prof: Profile, stages: list[_Stage], world: int, pipe_parts: dict, bubble: float,
            tail: tuple[float, float], step_boundary: float, offload: float, memory: float, b: int) -> CostBreakdown:
    """The breakdown of the critical path (pipeline + slowest once-per-step tail + whole-step terms),
    or, on a profile whose ranks share execution units, `shared_step` of it."""
    dp, opt = tail
    loss = float(loss_reduce(prof, world))
    dp += loss
    crit = sum(pipe_parts.values()) + bubble + dp + opt + step_boundary + offload
    if not prof.shared:
        return CostBreakdown(compute=pipe_parts["compute"], tp_comm=pipe_parts["tp"], cp_comm=pipe_parts["cp"],
                             pp_comm=pipe_parts["pp"], dp_comm=dp, boundary=pipe_parts["boundary"] + step_boundary,
                             offload=offload, bubble=bubble, total=crit, memory_per_rank_peak=memory,
                             micro_batches=b, optimizer=opt)
    # mean busy time of a rank per category (step-wide terms run on every rank)
    mean = {k: sum(st.ranks * st.runs * getattr(st, k) for st in stages) / world for k in _PARTS}
    mean_dp = sum(st.ranks * st.dp for st in stages) / world + loss
    mean_opt = sum(st.ranks * st.opt for st in stages) / world
    work = sum(mean.values()) + mean_dp + mean_opt + step_boundary + offload
    total = shared_step(prof, work, crit)
    return CostBreakdown(compute=mean["compute"], tp_comm=mean["tp"], cp_comm=mean["cp"], pp_comm=mean["pp"],
                         dp_comm=mean_dp, boundary=mean["boundary"] + step_boundary, offload=offload,
                         bubble=total - work, total=total, memory_per_rank_peak=memory, micro_batches=b,
                         optimizer=mean_opt)


def shared_step(prof: Profile, work, critical):
    """Step time when ranks share execution units (`Profile.cores` > 0).

    The profile's times are per-rank times with `concurrency` ranks busy at once. A step can be no
    shorter than the work of the mean rank at that sharing (`work`: every rank's busy time, summed
    and divided by the ranks: the units are kept busy by the ranks that have work), nor than the
    critical path with the units to itself (`critical` x `uncontended`). The estimate is the larger
    of the two."""
    return np.maximum(work, np.asarray(critical) * prof.uncontended)


def _eval_homogeneous(c: Candidate, wl: Workload, prof: Profile, b: int) -> CostBreakdown:
    s, enc, m = c.llm[0], wl.encoder, wl.micro_batch
    per = [s.layers] if s.pp == 1 else [c.first_stage_layers] + distribute(s.layers - c.first_stage_layers, s.pp - 1)
    stages = _module_stages(prof, wl, wl.llm, s, per, m, s.pp > 1, s.size, True, True, io_last=True, runs=b,
                            data="all")
    st0 = stages[0]
    _add_layers(st0, prof, wl, enc, enc.num_layers, m * wl.images_per_sample, s)
    st0.compute += float(io_time(prof, wl, enc, m * wl.images_per_sample, s.tp, s.cp))
    mems = []
    for i, (st, lay) in enumerate(zip(stages, per)):
        acts = float(act_bytes(wl, wl.llm, m, s.tp, s.cp, lay)) * min(s.pp - i, b)
        if i == 0:
            st.params += enc.total_params / s.tp
            acts += float(act_bytes(wl, enc, m * wl.images_per_sample, s.tp, s.cp, enc.num_layers)) * min(s.pp, b)
        mems.append(_mem(wl, st, s, acts))
    _tails(prof, wl, stages, [s] * len(stages), "homogeneous")
    total, parts, bubble = _pipeline(stages, b)
    return _finish(prof, stages, s.size, parts, bubble, _slowest_tail(stages), 0.0, 0.0, max(mems), b)


def _eval_colocated(c: Candidate, wl: Workload, prof: Profile, b: int) -> CostBreakdown:
    s, e, w = c.llm[0], c.encoder, c.llm[0].size
    per = distribute(s.layers, s.pp)
    stages = _module_stages(prof, wl, wl.llm, s, per, wl.micro_batch, s.pp > 1, w, True, True, io_last=True, runs=b,
                            data="all")
    llm_peak = max(_mem(wl, st, s, float(act_bytes(wl, wl.llm, wl.micro_batch, s.tp, s.cp, lay)) * min(s.pp - i, b))
                   for i, (st, lay) in enumerate(zip(stages, per)))
    llm_state = max(_mem(wl, st, s, 0.0) for st in stages)
    b_e = wl.global_batch * wl.images_per_sample / e.dp  # images of the rank's encoder-DP share: one pass
    eper = distribute(e.layers, e.pp)
    estages = _module_stages(prof, wl, wl.encoder, e, eper, b_e, e.pp > 1, w, io_last=True, runs=1, data="first")
    enc_state = max(_mem(wl, st, e, 0.0) for st in estages)
    enc_acts = max(float(act_bytes(wl, wl.encoder, b_e, e.tp, e.cp, lay)) for lay in eper)
    _tails(prof, wl, stages, [s] * len(stages), "colocated")
    _tails(prof, wl, estages, [e] * len(estages), "colocated")
    t_llm, parts, bubble = _pipeline(stages, b)
    t_enc, eparts, ebubble = _pipeline(estages, 1)
    parts = {k: parts[k] + eparts[k] for k in parts}
    bnd = float(colocated_boundary(prof, wl, e.tp, e.cp, e.pp, e.dp, s.tp, s.cp, s.pp, s.dp))
    off = 2.0 * enc_state / prof.host_bandwidth if c.offload else 0.0
    ltail, etail = _slowest_tail(stages), _slowest_tail(estages)
    tail = (ltail[0] + etail[0], ltail[1] + etail[1])
    mem = max(llm_state + enc_state + enc_acts, llm_peak + enc_acts + (0.0 if c.offload else enc_state))
    return _finish(prof, stages + estages, w, parts, bubble + ebubble, tail, bnd, off, mem, b)


def _eval_disjoint(c: Candidate, wl: Workload, prof: Profile, b: int) -> CostBreakdown:
    e, w = c.encoder, c.world_size
    mb = wl.micro_batch * max(s.dp for s in c.llm)
    total_llm_stages = sum(s.pp for s in c.llm)
    eper = distribute(e.layers, e.pp)
    stages = _module_stages(prof, wl, wl.encoder, e, eper, mb * wl.images_per_sample / e.dp, e.pp > 1, e.size,
                            io_last=True, runs=b, data="first")
    segs = [e] * e.pp
    pers = list(eper)
    for k, s in enumerate(c.llm):
        per = distribute(s.layers, s.pp)
        st = _module_stages(prof, wl, wl.llm, s, per, mb / s.dp, total_llm_stages > 1, w - e.size,
                            k == 0, k == len(c.llm) - 1, io_last=k == len(c.llm) - 1, runs=b, data="all")
        if k == 0:
            st[0].boundary = float(disjoint_boundary(prof, wl, mb / s.dp, s.cp, w))
        stages += st
        segs += [s] * s.pp
        pers += per
    n = len(stages)
    mems = []
    for i, (st, seg, lay) in enumerate(zip(stages, segs, pers)):
        spec = wl.encoder if i < e.pp else wl.llm
        samples = mb * wl.images_per_sample / e.dp if i < e.pp else mb / seg.dp
        acts = float(act_bytes(wl, spec, samples, seg.tp, seg.cp, lay)) * min(n - i, b)
        mems.append(_mem(wl, st, seg, acts))
    _tails(prof, wl, stages, segs, "disjoint")
    total, parts, bubble = _pipeline(stages, b)
    return _finish(prof, stages, w, parts, bubble, _slowest_tail(stages), 0.0, 0.0, max(mems), b)
