"""What is being trained and how it is laid out, as the cost model sees it: model sizes
(`ModelSpec`), one training step (`Workload`), a configuration (`Candidate` of `Segment`s: a module
or an LLM pipeline segment on its `Degrees`), and the result type (`CostBreakdown`). Pure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.degrees import Degrees
from megatron_hetero.planner.memory_terms import ActivationFeatures, StateFeatures
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout, RankRange
from megatron_hetero.layout.validate import resolve_layout

PLACEMENT_KINDS = ("homogeneous", "colocated", "disjoint")


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
    num_experts: int = 0  # > 0: every layer's MLP is a mixture of `num_experts` experts
    moe_topk: int = 2
    moe_ffn_hidden: Optional[int] = None  # each expert's MLP width (default ffn_hidden)
    features: int = 0  # an encoder's input features per token (its patch embedding's input width)
    # A HybridModel language model (`--hybrid-layer-pattern`): the shares (attention, dense MLP, MoE)
    # of the pattern's layers of each type (each layer is one of them); a layer is priced as their
    # mix (`layer_mix_of`). None: GPT layers, each attention + an MLP (the experts' with num_experts).
    layer_mix: Optional[tuple[float, float, float]] = None
    # A windowed encoder (Qwen2.5-VL's tower: `planner.qwen_vision_cost.attention_span`): the mean
    # number of keys a token's query meets per layer (window layers their window, full layers their
    # frame); None: seq (every token attends to the whole input). out_tokens: tokens an input hands
    # the next module (a patch merger's fewer); None: seq.
    attention_span: Optional[float] = None
    out_tokens: Optional[int] = None

    def __post_init__(self):
        for key in ("num_layers", "hidden", "ffn_hidden", "heads", "seq"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name}: {key} must be a positive integer, got {v!r}")

    @property
    def span(self) -> float:
        """Keys per query in a layer's attention (`attention_span`, else seq)."""
        return self.seq if self.attention_span is None else self.attention_span

    @property
    def has_experts(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return bool(self.num_experts) and self.mix[2] > 0

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
        attn, mlp, moe = self.mix
        dense = attn * 4 * self.hidden**2 + mlp * m * self.hidden * self.ffn_hidden
        return dense + moe * self.hidden * self.num_experts + self.expert_layer_params

    @property
    def mix(self) -> tuple[float, float, float]:
        """A layer's shares of (attention, dense MLP, MoE): `layer_mix`, or a GPT layer's (1, 1, 0),
        with experts (1, 0, 1)."""
        if self.layer_mix is not None:
            return self.layer_mix
        return (1.0, 0.0, 1.0) if self.num_experts else (1.0, 1.0, 0.0)

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def expert_layer_params(self) -> float:
        """Parameters of one layer's experts (0 for a dense model): they shard over EP, not TP."""
        m = 3 if self.gated else 2
        return float(self.mix[2] * self.num_experts * m * self.hidden * self.expert_ffn) if self.num_experts else 0.0

    @property
    def flops_ffn(self) -> int:
        """The MLP width a token's FLOPs see: ffn_hidden, or top-k experts of expert_ffn each."""
        return self.moe_topk * self.expert_ffn if self.num_experts else self.ffn_hidden

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

    extra_encoders: more encoder modules beside `encoder` (e.g. a speech encoder beside the vision
    one), each with `extra_inputs` inputs of its own `seq` tokens per sample (default 1 each; a speech
    encoder: seq the tokens of one chunk, inputs the chunks of a clip, so its tokens per sample are set
    by the clip's length, not by the language context); every encoder's tokens feed the
    language model, whose `seq` already holds them. `encoder_views` gives one single-encoder workload
    per encoder: the cost model prices each encoder with the one-encoder terms.
    """

    encoder: ModelSpec
    llm: ModelSpec
    global_batch: int
    micro_batch: int = 1
    images_per_sample: int = 1
    dtype_bytes: int = 2
    # The features of the run being priced, as train's flags set them (`planner.memory_terms` turns
    # them into bytes). The defaults are a production run train can run: --use-distributed-optimizer
    # --sequence-parallel --recompute-granularity selective (which keeps no attention scores);
    # `planner.model.workload` prices train's own defaults instead.
    optimizer: str = "adam"
    distributed_optimizer: bool = True
    sequence_parallel: bool = True
    recompute: Optional[str] = "selective"  # None, "selective", or "full" (uniform, one layer per unit)
    keeps_scores: bool = True  # Megatron-core's local attention keeps its softmax output (unless recomputed)
    extra_encoders: tuple[ModelSpec, ...] = ()
    extra_inputs: tuple[int, ...] = ()

    def __post_init__(self):
        for key in ("global_batch", "micro_batch", "images_per_sample", "dtype_bytes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"workload: {key} must be a positive integer, got {v!r}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"workload: dtype_bytes must be 2 (bf16) or 4 (fp32), got {self.dtype_bytes}")
        _ = self.state_features  # ValueError for an unknown optimizer
        self.activation_features(False)  # ValueError for an unknown recompute
        if self.extra_inputs and len(self.extra_inputs) != len(self.extra_encoders):
            raise ValueError(
                f"workload: {len(self.extra_inputs)} extra_inputs for {len(self.extra_encoders)} extra encoders"
            )
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.extra_inputs):
            raise ValueError(f"workload: extra_inputs must be positive integers, got {self.extra_inputs}")
        names = [e.name for e in self.encoders]
        if len(set(names)) != len(names):
            raise ValueError(f"workload: encoder names must differ, got {names}")

    @property
    def encoders(self) -> tuple[ModelSpec, ...]:
        """Every encoder: `encoder`, then `extra_encoders`."""
        return (self.encoder, *self.extra_encoders)

    def encoder_views(self) -> list["Workload"]:
        """One single-encoder workload per encoder (in `encoders` order): this workload without the
        extra encoders, then each extra encoder in the place of `encoder` with its `extra_inputs`."""
        if not self.extra_encoders:
            return [self]
        one = dataclasses.replace(self, extra_encoders=(), extra_inputs=())
        inputs = self.extra_inputs or (1,) * len(self.extra_encoders)
        return [one] + [
            dataclasses.replace(one, encoder=e, images_per_sample=k) for e, k in zip(self.extra_encoders, inputs)
        ]

    @property
    def state_features(self) -> StateFeatures:
        return StateFeatures(
            precision="fp32" if self.dtype_bytes == 4 else "bf16",
            optimizer=self.optimizer,
            distributed_optimizer=self.distributed_optimizer,
        )

    def activation_features(self, sequence_parallel: bool) -> ActivationFeatures:
        """The activation features of a module (`sequence_parallel`: whether SP applies to it)."""
        return ActivationFeatures(
            dtype_bytes=self.dtype_bytes,
            sequence_parallel=sequence_parallel,
            recompute=self.recompute,
            keeps_scores=self.keeps_scores,
        )

    @property
    def weight_bytes(self) -> float:
        return float(self.state_features.param_bytes)

    @property
    def grad_bytes(self) -> float:
        return float(self.state_features.grad_bytes)

    @property
    def optimizer_bytes(self) -> float:
        return float(self.state_features.optimizer_bytes)

    def encoder_io_params(self, tp=1) -> tuple:
        """(first stage, last stage) parameters per rank of TP `tp` that the encoder holds outside its
        layers, as the runtime builds it (`planner.memory`): on its first stage the patch embedding
        (features x h + h) and the positions (seq x h), replicated over TP; on its last stage the
        final LayerNorm (2h) and the projector h -> H -> H (column- then row-parallel: (h H + H +
        H^2) / tp, and the row-parallel bias H). (0, 0) when the encoder's `params` are given: they
        include these already (`planner.model.workload`). `tp` may be a numpy array."""
        e, big = self.encoder, self.llm.hidden
        if e.params is not None:
            return 0.0, 0.0
        h = e.hidden
        first = float((e.features + 1) * h + e.seq * h) if e.features else 0.0
        return first, 2 * h + (h * big + big + big * big) / tp + big

    @property
    def image_tokens(self) -> int:
        """Encoder tokens entering the LLM per sample."""
        return self.images_per_sample * (self.encoder.out_tokens or self.encoder.seq)


@dataclass(frozen=True)
class Segment:
    """A module (or a pipeline segment of the LLM) on its degrees, holding `layers` layers."""

    par: Degrees
    layers: int = 0

    @classmethod
    def of(cls, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, layers: int = 0, ep: int = 1) -> "Segment":
        return cls(Degrees(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep), layers)

    tp = property(lambda self: self.par.tp)
    cp = property(lambda self: self.par.cp)
    pp = property(lambda self: self.par.pp)
    dp = property(lambda self: self.par.dp)
    size = property(lambda self: self.par.size)
    ep = property(lambda self: self.par.ep)

    def short(self) -> str:
        return self.par.short()

    def to_dict(self) -> dict:
        d = {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "layers": self.layers}
        if self.ep > 1:
            d["ep"] = self.ep
        return d


@dataclass(frozen=True)
class Candidate:
    """One configuration. encoder_ranks: size of the encoder island (disjoint; else 0).
    extra_encoders: the layouts of the workload's `extra_encoders` (one Segment each, in order; disjoint:
    each on its own island after the first encoder's, colocated: on the same ranks).
    offload: colocated encoder state offloaded during the LLM phase. first_stage_layers:
    homogeneous with pp > 1, the LLM layers sharing stage 0 with the encoder. The LLM is one
    segment, or (disjoint) a chain of segments with their own TP/DP and contiguous layers."""

    placement: str
    encoder: Segment
    llm: tuple
    encoder_ranks: int = 0
    offload: bool = False
    first_stage_layers: int = 0
    extra_encoders: tuple = ()

    @property
    def encoders(self) -> tuple:
        """Every encoder's Segment: `encoder`, then `extra_encoders`."""
        return (self.encoder, *self.extra_encoders)

    @property
    def world_size(self) -> int:
        if self.placement == "disjoint":
            return sum(e.size for e in self.encoders) + sum(s.size for s in self.llm)
        return self.llm[0].size

    def describe(self) -> str:
        llm = " + ".join(f"{s.short()}[{s.layers}L]" if len(self.llm) > 1 else s.short() for s in self.llm)
        text = f"{self.placement}: encoder {self.encoder.short()}"
        text += "".join(f", encoder {i + 2} {e.short()}" for i, e in enumerate(self.extra_encoders))
        text += f", LLM {llm}"
        if self.placement == "disjoint":
            islands = [e.size for e in self.encoders] + [self.world_size - sum(e.size for e in self.encoders)]
            text += ", islands " + "+".join(str(x) for x in islands)
        if self.offload:
            text += ", encoder offload"
        if self.placement == "homogeneous" and self.llm[0].pp > 1:
            text += f", stage-0 LLM layers {self.first_stage_layers}"
        return text

    def to_dict(self) -> dict:
        return {
            "placement": self.placement,
            "encoder": self.encoder.to_dict(),
            "llm": [s.to_dict() for s in self.llm],
            "encoder_ranks": self.encoder_ranks,
            "offload": self.offload,
            "first_stage_layers": self.first_stage_layers,
            **({"extra_encoders": [e.to_dict() for e in self.extra_encoders]} if self.extra_encoders else {}),
        }

    def to_layout(self, encoder_name: str = "vision", llm_name: str = "language", extra_names: tuple = ("audio",)):
        """The resolved `HeteroLayout` of this candidate (homogeneous -> colocated, equal layouts):
        the encoders (`encoder_name`, then `extra_names` for the extra encoders), each with an edge to
        the language model's first module, then the language model's modules in a chain."""

        names = (encoder_name, *extra_names)
        if len(names) < len(self.encoders):
            raise ValueError(f"to_layout: {len(self.encoders)} encoders, names for {len(names)}: {list(names)}")
        encs = [ModuleLayout(name=n, tp=e.tp, cp=e.cp, pp=e.pp, dp=e.dp) for n, e in zip(names, self.encoders)]
        if len(self.llm) == 1:
            s = self.llm[0]
            mods = [*encs, ModuleLayout(name=llm_name, tp=s.tp, cp=s.cp, pp=s.pp, dp=s.dp, ep=s.ep)]
        else:
            mods, start = list(encs), 0
            for i, s in enumerate(self.llm):
                mods.append(
                    ModuleLayout(
                        name=f"{llm_name}_{chr(ord('a') + i)}",
                        tp=s.tp,
                        cp=s.cp,
                        pp=s.pp,
                        dp=s.dp,
                        ep=s.ep,
                        layers=RankRange(start, start + s.layers - 1),
                    )
                )
                start += s.layers
        chain = [m.name for m in mods[len(encs) - 1 :]]
        edges = tuple(Edge(m.name, chain[1]) for m in encs[:-1]) + tuple(Edge(a, b) for a, b in zip(chain, chain[1:]))
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


def distribute(layers: int, stages: int) -> list[int]:
    """Layers per stage: as even as possible, the extra layers on the first stages."""
    return [layers // stages + (1 if i < layers % stages else 0) for i in range(stages)]


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
        raise ValueError(
            f"global batch {wl.global_batch} is not divisible by micro-batch {wl.micro_batch} * "
            f"LLM dp {max(s.dp for s in llm)} = {mb}"
        )
    for s in llm:
        if s.ep > 1 and (not wl.llm.num_experts or wl.llm.num_experts % s.ep or s.par.stage_size % s.ep):
            raise ValueError(
                f"segment {s.short()}: ep({s.ep}) must divide the LLM's {wl.llm.num_experts} experts and "
                f"its stage's tp*cp*dp = {s.par.stage_size}"
            )
        if mb % s.dp:
            raise ValueError(f"pipeline micro-batch {mb} is not divisible by segment dp {s.dp}")
        if s.layers < s.pp:
            raise ValueError(f"segment {s.short()} holds {s.layers} layers, fewer than its pp {s.pp}")
    if len(c.extra_encoders) != len(wl.extra_encoders):
        raise ValueError(
            f"the candidate lays out {len(c.encoders)} encoders, the workload has {len(wl.encoders)}: "
            f"{[x.name for x in wl.encoders]}"
        )
    batch = mb if c.placement == "disjoint" else wl.global_batch
    for e, spec in zip(c.encoders, wl.encoders):
        if e.layers != spec.num_layers or e.layers < e.pp:
            raise ValueError(
                f"encoder {spec.name}'s segment holds {e.layers} layers; it has {spec.num_layers} (>= pp {e.pp})"
            )
        if batch % e.dp:
            raise ValueError(
                f"encoder {spec.name}: dp {e.dp} does not divide the {batch} samples crossing the boundary"
            )
    if c.placement == "homogeneous":
        s = llm[0]
        for e in c.encoders:
            if (e.tp, e.cp, e.pp, e.dp) != (s.tp, s.cp, s.pp, s.dp):
                raise ValueError(f"homogeneous: encoder {e.short()} must equal the LLM's layout {s.short()}")
        if s.pp > 1 and not 1 <= c.first_stage_layers <= s.layers - (s.pp - 1):
            raise ValueError(f"homogeneous: first_stage_layers {c.first_stage_layers} outside 1..{s.layers - s.pp + 1}")
    return wl.global_batch // mb
