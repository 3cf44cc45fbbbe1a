"""The planner's memory model (`planner/memory.py`) against the modules `megatron-hetero train`
builds: every rank's parameter count per module stage (all, experts, trainable) equals the count of
the module's own parameters, over layouts and model variants (TP, PP, EP, disjoint, frozen
encoders, a CLIP encoder, a Qwen2.5-VL tower, SigLIP encoders with and without their post norm and pooling head, GQA/RMSNorm/SwiGLU/no biases/rope, tied embeddings, MoE)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.planner.memory import stage_params
from megatron_hetero.config.model import EncoderSpec
from megatron_hetero.runtime.launcher import run_ranks

from qwen_train_case import SPEC as QWEN_SPEC

LLAMA = LlavaSpec(
    normalization="RMSNorm",
    swiglu=True,
    add_bias_linear=False,
    position_embedding_type="rope",
    num_query_groups=2,
    num_layers=4,
)
CLIP = EncoderSpec(kind="clip", patch_size=2, tokens=4, feature_dim=12, num_layers=1)
# SigLIP: conv bias, no class token or ln_pre, the post norm (trains with post_norm), the pooling
# head (never trains), an MLP width of its own
SIGLIP = EncoderSpec(
    kind="siglip",
    patch_size=2,
    tokens=4,
    feature_dim=12,
    num_layers=1,
    ffn_hidden_size=48,
    norm_epsilon=1e-6,
    activation="gelu_pytorch_tanh",
    post_norm=True,
    pooling_head=True,
)

# Whisper: two convolutions, the position table (never trains), pre-LN layers, final LayerNorm
WHISPER = EncoderSpec(
    kind="whisper", tokens=4, feature_dim=16, num_layers=1, ffn_hidden_size=48, activation="gelu", offset=10
)


def _counts(doc: dict, spec: LlavaSpec) -> dict:
    """Module -> (predicted, counted) (all, expert, trainable) parameters on this rank."""
    from megatron_hetero.models.llava import _is_expert
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import JobConfig, build_module
    from megatron_hetero.training.trainer import prepare_rank

    prepare_rank(JobConfig(spec=spec, global_batch_size=4, micro_batch_size=1, train_iters=1))
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    out = {}
    try:
        for m in layout.modules:
            if dist.get_rank() not in m.rank_range.ranks():
                continue
            pgs = topo.pg_collection(m.name)
            mod = build_module(m.name, layout, spec, pgs)
            params = list(mod.named_parameters())
            counted = (
                sum(p.numel() for _, p in params),
                sum(p.numel() for n, p in params if _is_expert(n)),
                sum(p.numel() for _, p in params if p.requires_grad),
            )
            p = stage_params(layout, spec, m.name, pgs.pp.rank())
            out[m.name] = ((p.total, p.expert, p.trainable), counted)
    finally:
        topo.destroy()
    return out


CASES = {
    "colocated vision dp2 + language tp2": (
        {"modules": {"vision": {"dp": 2}, "language": {"tp": 2}}, "edges": ["vision -> language"]},
        LlavaSpec(),
        2,
    ),
    "llama-style language pp2, frozen vision": (
        {
            "modules": {"vision": {"dp": 2, "frozen": True}, "language": {"pp": 2}},
            "edges": ["vision -> language"],
        },
        LLAMA,
        2,
    ),
    "disjoint clip @0 -> tied language tp2 @1-2": (
        {
            "placement": "disjoint",
            "modules": {"vision": {"ranks": "0"}, "language": {"tp": 2, "ranks": "1-2"}},
            "edges": ["vision -> language"],
        },
        dataclasses.replace(LlavaSpec(), encoders={"vision": CLIP}, untie_embeddings_and_output_weights=False),
        3,
    ),
    "siglip tp2 (post norm, head), siglip cut before its post norm, frozen siglip": (
        {
            "modules": {
                "vision": {"tp": 2},
                "cut_vision": {"dp": 2},
                "frozen_vision": {"dp": 2, "frozen": True},
                "language": {"tp": 2},
            },
            "edges": ["vision -> language", "cut_vision -> language", "frozen_vision -> language"],
        },
        dataclasses.replace(
            LlavaSpec(),
            encoders={
                "vision": SIGLIP,
                "cut_vision": dataclasses.replace(SIGLIP, offset=5, post_norm=False, pooling_head=False),
                "frozen_vision": dataclasses.replace(SIGLIP, offset=9),
            },
        ),
        2,
    ),
    "whisper audio tp2 beside vision dp2, frozen whisper": (
        {
            "modules": {
                "vision": {"dp": 2},
                "audio": {"tp": 2},
                "frozen_audio": {"dp": 2, "frozen": True},
                "language": {"tp": 2},
            },
            "edges": ["vision -> language", "audio -> language", "frozen_audio -> language"],
        },
        dataclasses.replace(
            LlavaSpec(seq_length=40),
            encoders={
                "vision": EncoderSpec(offset=1),
                "audio": WHISPER,
                "frozen_audio": dataclasses.replace(WHISPER, offset=20),
            },
        ),
        2,
    ),
    # the Qwen2.5-VL tower (`planner/memory_qwen.py`); frozen, its merger and ln_q still train
    "qwen2.5-vl tower tp2 + m-rope language tp2": (
        {"modules": {"vision": {"tp": 2}, "language": {"tp": 2}}, "edges": ["vision -> language"]},
        QWEN_SPEC,
        2,
    ),
    "frozen qwen2.5-vl tower dp2 + language pp2": (
        {"modules": {"vision": {"dp": 2, "frozen": True}, "language": {"pp": 2}}, "edges": ["vision -> language"]},
        QWEN_SPEC,
        2,
    ),
    # the tower on two pipeline stages: the patch embedding on the first, the merger on the last
    "qwen2.5-vl tower pp2 + m-rope language dp2": (
        {"modules": {"vision": {"pp": 2}, "language": {"dp": 2}}, "edges": ["vision -> language"]},
        QWEN_SPEC,
        2,
    ),
    "frozen qwen2.5-vl tower tp2·pp2 + language dp4": (
        {
            "modules": {"vision": {"tp": 2, "pp": 2, "frozen": True}, "language": {"dp": 4}},
            "edges": ["vision -> language"],
        },
        QWEN_SPEC,
        4,
    ),
    "moe language dp2·ep2, segments": (
        {
            "placement": "disjoint",
            "modules": {
                "vision": {"ranks": "0"},
                "language_a": {"dp": 2, "ep": 2, "layers": "0-0", "ranks": "1-2"},
                "language_b": {"layers": "1-1", "ranks": "3"},
            },
            "edges": ["vision -> language_a", "language_a -> language_b"],
        },
        dataclasses.replace(LlavaSpec(), num_experts=4, add_bias_linear=False),
        4,
    ),
    # HybridModel language models (`--hybrid-layer-pattern`): each layer its type's parameters
    "hybrid '*-|*E' language pp2 (the pattern's stages)": (
        {"modules": {"vision": {"dp": 2}, "language": {"pp": 2}}, "edges": ["vision -> language"]},
        dataclasses.replace(
            LlavaSpec(), num_layers=4, hybrid_layer_pattern="*-|*E", num_experts=4, add_bias_linear=False
        ),
        2,
    ),
    "hybrid '*-*E' language dp2·ep2": (
        {"modules": {"vision": {"dp": 2}, "language": {"dp": 2, "ep": 2}}, "edges": ["vision -> language"]},
        dataclasses.replace(
            LlavaSpec(), num_layers=4, hybrid_layer_pattern="*-*E", num_experts=4, add_bias_linear=False
        ),
        2,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_parameter_counts_match_the_built_modules(case):
    doc, spec, world = CASES[case]
    per_rank = run_ranks(world, _counts, doc, spec)
    seen = 0
    for rank, mods in enumerate(per_rank):
        for name, (predicted, counted) in mods.items():
            assert predicted == counted, (case, rank, name, predicted, counted)
            seen += 1
    assert seen >= world


def _decoder_saved_bytes(spec: LlavaSpec, tp: int, sp: bool, recompute: str | None) -> tuple[int, int]:
    """(measured, predicted) bytes autograd saves in one forward of the language decoder on this
    rank (one sample, the distinct storages of the saved tensors that are not weights)."""
    import torch

    from megatron_hetero.layout.spec import Recompute
    from megatron_hetero.planner.memory import ActivationFeatures, layer_activation_bytes, norm_activation_bytes
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import JobConfig, build_module
    from megatron_hetero.training.trainer import prepare_rank

    prepare_rank(JobConfig(spec=spec, global_batch_size=4, micro_batch_size=1, train_iters=1))
    doc = {"modules": {"vision": {"dp": tp}, "language": {"tp": tp}}, "edges": ["vision -> language"]}
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    try:
        r = Recompute(granularity="selective") if recompute == "selective" else None
        mod = build_module("language", layout, spec, topo.pg_collection("language"), r, sequence_parallel=sp).train()
        s, h = spec.seq_length, spec.hidden_size
        x = torch.randn(s // tp if sp else s, 1, h, generator=torch.Generator().manual_seed(0), requires_grad=True)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
        weights = {p.untyped_storage().data_ptr() for p in mod.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights and t is not mask:
                seen.setdefault(ptr, t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mod.gpt.decoder(hidden_states=x, attention_mask=mask)
        y.sum().backward()
        seen.pop(mask.untyped_storage().data_ptr(), None)
        feats = ActivationFeatures(dtype_bytes=4, sequence_parallel=sp and tp > 1, recompute=recompute)
        per_layer = layer_activation_bytes(
            s,
            1,
            h,
            spec.ffn_hidden_size or 4 * h,
            spec.num_attention_heads,
            tp,
            feats,
            gated=spec.swiglu,
            normalization=spec.normalization,
            query_groups=spec.num_query_groups,
        )
        final = norm_activation_bytes(s, 1, h, tp, feats, spec.normalization)  # the decoder's final norm
        return sum(seen.values()), spec.num_layers * per_layer + final
    finally:
        topo.destroy()


LAYER_CASES = {
    "gpt tp1": (LlavaSpec(), 1, False, None),
    "gpt tp2": (LlavaSpec(), 2, False, None),
    "gpt tp2 sp": (LlavaSpec(), 2, True, None),
    "gpt 4 layers tp1 swiglu": (dataclasses.replace(LlavaSpec(), num_layers=4, swiglu=True), 1, False, None),
    "llama tp2 sp selective": (dataclasses.replace(LLAMA, num_layers=2), 2, True, "selective"),
    "llama tp1": (LLAMA, 1, False, None),
}


@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_activation_bytes_match_what_autograd_saves(case):
    spec, tp, sp, recompute = LAYER_CASES[case]
    for measured, predicted in run_ranks(tp, _decoder_saved_bytes, spec, tp, sp, recompute):
        print(f"{case}: measured {measured} bytes, predicted {predicted}")
        assert abs(predicted - measured) <= 0.01 * measured, (case, measured, predicted)


def _job(**kw):
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig

    base = dict(
        spec=LlavaSpec(num_layers=4),
        global_batch_size=8,
        micro_batch_size=1,
        train_iters=1,
        optim=OptimConfig(optimizer="adam", lr=1e-3),
        log_memory=True,
    )
    return JobConfig(**{**base, **kw})


#: the switched-on variant of every layout: the distributed optimizer and full recompute (uniform,
#: 1 layer), with sequence parallelism where the language model has tp 2, bf16 on one layout
ON = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MEMORY_CASES = {
    "colocated vision dp2 + language tp2": (
        {"modules": {"vision": {"dp": 2}, "language": {"tp": 2}}, "edges": ["vision -> language"]},
        2,
        {},
        {**ON, "sequence_parallel": True},
    ),
    "colocated vision dp2 + language pp2": (
        {"modules": {"vision": {"dp": 2}, "language": {"pp": 2}}, "edges": ["vision -> language"]},
        2,
        {},
        ON,
    ),
    "disjoint vision @0 -> language pp2 @1-2": (
        {
            "placement": "disjoint",
            "modules": {"vision": {"ranks": "0"}, "language": {"pp": 2, "ranks": "1-2"}},
            "edges": ["vision -> language"],
        },
        3,
        {},
        ON,
    ),
    "colocated vision dp2 + whisper audio tp2 + language tp2": (
        {
            "modules": {"vision": {"dp": 2}, "audio": {"tp": 2}, "language": {"tp": 2}},
            "edges": ["vision -> language", "audio -> language"],
        },
        2,
        {
            "spec": LlavaSpec(
                num_layers=4,
                seq_length=64,
                encoders={
                    "vision": EncoderSpec(offset=1),
                    "audio": dataclasses.replace(WHISPER, tokens=8, offset=12, num_layers=2),
                },
            )
        },
        ON,
    ),
    "colocated qwen2.5-vl tower dp2 + m-rope language tp2": (
        {"modules": {"vision": {"dp": 2}, "language": {"tp": 2}}, "edges": ["vision -> language"]},
        2,
        {"spec": QWEN_SPEC},
        {**ON, "sequence_parallel": True},
    ),
    "colocated qwen2.5-vl tower pp2 + m-rope language dp2": (
        {"modules": {"vision": {"pp": 2}, "language": {"dp": 2}}, "edges": ["vision -> language"]},
        2,
        {"spec": QWEN_SPEC},
        ON,
    ),
    "disjoint vision dp2 @0-1 -> language tp2 @2-3": (
        {
            "placement": "disjoint",
            "modules": {"vision": {"dp": 2, "ranks": "0-1"}, "language": {"tp": 2, "ranks": "2-3"}},
            "edges": ["vision -> language"],
        },
        4,
        {"micro_batch_size": 2},
        {**ON, "sequence_parallel": True, "bf16": True},
    ),
}


@pytest.mark.parametrize("switched", ["plain", "distributed-optimizer", "both"])
@pytest.mark.parametrize("case", MEMORY_CASES)
def test_predicted_memory_matches_the_measured_within_10_percent(case, switched):
    """`train --log-memory`'s records carry, per rank, the memory model's prediction (state +
    activation peak, `planner/memory.py`) beside the measured bytes (the state's tensors and the
    activation meter's peak over the step): within 10% on every rank, for each layout plain, with the
    distributed optimizer, and with it and full recompute (with SP where tp > 1, bf16 on one layout):
    each switch off and on."""
    from megatron_hetero.runtime.module_state import OptimConfig

    from parity import run_job

    doc, world, kw, on = MEMORY_CASES[case]
    extra = dict(kw)
    distributed = switched in ("distributed-optimizer", "both")
    bf16 = switched == "both" and on.get("bf16", False)
    if switched == "both":
        extra.update({k: v for k, v in on.items() if k != "bf16"})
    extra["optim"] = OptimConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed, bf16=bf16)
    if bf16:
        extra["spec"] = dataclasses.replace(LlavaSpec(num_layers=4), bf16=True)
    rec = run_job(doc, world, _job(**extra))[0]["records"][-1]
    mem = rec["memory_bytes"]
    assert sorted(mem, key=int) == [str(r) for r in range(world)]
    for r, m in mem.items():
        print(
            f"{case} {switched} rank {r}: predicted {m['predicted']} "
            f"(state {m['predicted_state']}, activations {m['predicted_activation']}), measured {m['measured']} "
            f"({m['predicted'] / m['measured'] - 1:+.3f})"
        )
        assert abs(m["predicted"] / m["measured"] - 1) <= 0.10, (case, switched, r, m)
        acts = rec["activation_peak_bytes_total"][r]
        assert abs(m["predicted_activation"] / acts - 1) <= 0.10, (case, switched, r, m, acts)


@pytest.mark.parametrize("switched", ["plain", "full-recompute"])
def test_hybrid_predicted_memory_matches_the_measured_within_10_percent(switched):
    """A HybridModel language model of `*-*|-` (the pattern's own uneven stages, 3 + 1 layers) on
    pp2: the memory model counts each stage's own layers by type (`planner/memory.py`); the
    prediction and its activations within 10% of what each rank measures."""
    from parity import run_job

    extra = dict(ON) if switched == "full-recompute" else {}
    spec = LlavaSpec(num_layers=4, hybrid_layer_pattern="*-*|-")
    doc = {"modules": {"vision": {"dp": 2}, "language": {"pp": 2}}, "edges": ["vision -> language"]}
    rec = run_job(doc, 2, _job(spec=spec, **extra))[0]["records"][-1]
    for r, m in rec["memory_bytes"].items():
        acts = rec["activation_peak_bytes_total"][r]
        print(
            f"hybrid '*-*|-' pp2 {switched} rank {r}: predicted {m['predicted']} (activations "
            f"{m['predicted_activation']}), measured {m['measured']} (activations {acts})"
        )
        assert abs(m["predicted"] / m["measured"] - 1) <= 0.10, (switched, r, m)
        assert abs(m["predicted_activation"] / acts - 1) <= 0.10, (switched, r, m, acts)
