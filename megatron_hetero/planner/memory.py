"""The memory model of what `megatron-hetero train` holds per rank (pure): parameters, gradients and
optimizer state of every module stage a rank serves, with the runtime's features (precision,
optimizer, distributed optimizer). `plan --json` prints it per rank; `train --log-memory` logs it
beside what the rank measures (`training/memory_log.py`).

Parameters per rank: `memory_params.py` (re-exported here: `stage_params`, `StageParams`).

State bytes of P parameters (N trainable, E of them expert parameters), Megatron's optimizer:

* params: P x param bytes (4 fp32, 2 bf16/fp16);
* grads: N x grad bytes (DDP's buffer: 4 with grad_reduce_in_fp32 or in fp32, else 2);
* optimizer: N x (moments + main) bytes, moments 8 for Adam, 4 for SGD (momentum), main 4 when the
  parameters are bf16/fp16 (the fp32 copy) and 0 in fp32; with the distributed optimizer each of
  them is split over the module's DP x CP group (expert parameters: expert-DP = tp*cp*dp/ep/expt_tp);
  DDP's bucket padding is not modelled (at most 128 x DP elements per bucket).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout, Recompute
from megatron_hetero.planner.memory_terms import (
    ActivationFeatures,
    StateFeatures,
    layer_activation_bytes,
    layer_norm_activation_bytes,
    norm_activation_bytes,
)
from megatron_hetero.planner.memory_params import (  # re-exported: the public path of the parameter counts
    StageParams,
    hybrid_stage_symbols,
    stage_params,
)
from megatron_hetero.planner.memory_qwen import qwen_activation_bytes
from megatron_hetero.config.model import EncoderSpec, LlavaSpec
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.plan.roles import language_modules
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.rank_plan import rank_plan


def _expert_dp(m: ModuleLayout) -> int:
    return max(1, m.tp * m.cp * m.dp // (m.ep * m.expt_tp))


def stage_state_bytes(m: ModuleLayout, p: StageParams, features: StateFeatures) -> dict[str, int]:
    """{params, grads, optimizer} bytes of stage parameters `p` of module `m` on one rank."""
    dense_trainable = p.trainable - p.trainable_expert
    opt = features.optimizer_bytes
    if features.distributed_optimizer:
        optimizer = dense_trainable * opt // (m.dp * m.cp) + p.trainable_expert * opt // _expert_dp(m)
    else:
        optimizer = p.trainable * opt
    return {
        "params": p.total * features.param_bytes,
        "grads": p.trainable * features.grad_bytes,
        "optimizer": optimizer,
    }


def rank_state_bytes(
    layout: HeteroLayout, spec: LlavaSpec, rank: int, features: StateFeatures
) -> dict[str, dict[str, int]]:
    """Module -> {params, grads, optimizer} bytes that rank `rank` holds (only the modules it serves)."""
    out: dict[str, dict[str, int]] = {}
    for m in layout.modules:
        if rank not in m.rank_range.ranks():
            continue
        c = coord_of(m, rank)
        out[m.name] = stage_state_bytes(m, stage_params(layout, spec, m.name, c.pp), features)
    return out


def total_bytes(per_module: dict[str, dict[str, int]], offloaded: Optional[set[str]] = None) -> int:
    """The sum over modules and parts (`offloaded` modules excluded)."""
    return sum(sum(v.values()) for k, v in per_module.items() if not offloaded or k not in offloaded)


# -- activations ---------------------------------------------------------------------------------
def module_activation_features(
    m: ModuleLayout, spec: LlavaSpec, sequence_parallel: bool, recompute: Optional[Recompute]
) -> ActivationFeatures:
    """The activation features of module `m`: the model's dtype, Megatron's SP on a tp > 1 language
    module (never on encoders or heads), and the module's recompute (its layout's, else the job's)."""
    r = m.recompute if m.recompute is not None else recompute
    return ActivationFeatures(
        dtype_bytes=2 if (spec.bf16 or spec.fp16) else 4,
        sequence_parallel=sequence_parallel and m.tp > 1 and m.name not in spec.encoders and m.name not in spec.outputs,
        recompute=r.granularity if r is not None else None,
        recompute_num_layers=(r.num_layers or 1) if r is not None and r.granularity == "full" else 1,
        recompute_method=(r.method or "uniform") if r is not None and r.granularity == "full" else "uniform",
    )


def stage_activation_bytes(
    layout: HeteroLayout, spec: LlavaSpec, module: str, pp_rank: int, rows: int, features: ActivationFeatures
) -> tuple[int, int]:
    """(kept, backward_peak) bytes of one forward of `rows` samples through `module`'s stage `pp_rank`:
    `kept` stays saved until that micro-batch's backward; `backward_peak` is that micro-batch's own
    peak during its backward under full recompute (its units' inputs and one unit recomputed; 0
    without full recompute)."""
    m = layout.module(module)
    if module in spec.encoders and spec.encoders[module].kind == "qwen2.5-vl":  # no recompute on the tower
        return qwen_activation_bytes(spec.encoders[module], spec.hidden_size, m, pp_rank, rows, features), 0
    if module in spec.encoders:
        enc = spec.encoders[module]
        rows *= max(1, enc.max_tiles)  # variable image tokens: the encoder's batch is tiles, at most K per sample
        h, heads, ffn = enc.hidden_size, enc.num_attention_heads, enc.ffn_hidden_size or 4 * enc.hidden_size
        tokens, layers, norm = enc.tokens + (1 if enc.kind == "clip" else 0), enc.num_layers // m.pp, "LayerNorm"
        gated, groups, kvc = False, None, None
        last = pp_rank == m.pp - 1
        # the first stage's input features (the patch embedding's input; CLIP: the image's pixels)
        extra = enc.tokens * rows * enc.feature_dim * features.dtype_bytes if pp_rank == 0 else 0
        if enc.kind == "whisper":  # conv1 and its GELU over 2 * tokens frames, conv2 and its GELU, + positions
            extra += (2 * 2 + 3) * enc.tokens * rows * h * features.dtype_bytes
        if last:  # the final LayerNorm (not a SigLIP tower read before its post norm) and the projector
            normed = enc.kind != "siglip" or enc.post_norm
            extra += (norm_activation_bytes(tokens, rows, h, 1, features) if normed else 0) + _projector_act(
                enc, spec, rows, m.tp, features
            )
    elif module in spec.outputs:
        out = spec.outputs[module]
        n = out.tokens * rows
        return (n * spec.hidden_size + 2 * n * out.hidden_size // m.tp) * features.dtype_bytes, 0
    else:
        h, heads, ffn = spec.hidden_size, spec.num_attention_heads, spec.ffn_hidden_size or 4 * spec.hidden_size
        tokens, norm = spec.seq_length // m.cp, spec.normalization
        gated, groups, kvc = spec.swiglu, spec.num_query_groups, spec.kv_channels
        n_layers = m.layers.size if m.layers is not None else spec.num_layers
        layers = n_layers // m.pp
        segs = [s.name for s in language_modules(layout)]
        extra = 0
        if module == segs[-1] and pp_rank == m.pp - 1:  # final norm, output layer input, fp32 logits
            extra += norm_activation_bytes(tokens, rows, h, m.tp, features, norm)
            extra += tokens * rows * h * features.dtype_bytes + tokens * rows * (spec.vocab_size // m.tp) * 4
    if module in spec.encoders and m.cp != 1:
        raise ValueError(f"module {module}: encoders run with cp 1")
    per_layer = layer_activation_bytes(tokens, rows, h, ffn, heads, m.tp, features, gated, kvc, norm, groups)
    if module not in spec.encoders and spec.hybrid_layer_pattern is not None:  # each layer its type's bytes
        symbols = hybrid_stage_symbols(spec.hybrid_layer_pattern, m.pp, pp_rank)
        parts = _hybrid_activation_parts(spec, tokens, rows, m.tp, features)
        layers = len(symbols)
        per_layer = sum(parts[c] for c in symbols) // layers  # their mean (full recompute's units)
        if features.recompute != "full":
            return sum(parts[c] for c in symbols) + extra, 0
    if features.recompute != "full":
        return layers * per_layer + extra, 0
    sp = 1 if module in spec.encoders or not features.sequence_parallel else m.tp
    unit_input = tokens * rows * h // sp * features.dtype_bytes
    n = min(layers, features.recompute_num_layers)
    # A recomputed unit saves its layers again while its backward runs, its input excepted (the unit
    # keeps it already); by then the stage's own extras (final norm, logits, projector) are freed.
    if features.recompute_method == "block":  # the first n layers recomputed one by one, the rest kept
        kept = n * unit_input + (layers - n) * per_layer
        return kept + extra, (kept + per_layer - unit_input) if n else 0
    kept = -(-layers // n) * unit_input  # uniform: units of n layers
    return kept + extra, kept + n * per_layer - unit_input


def _hybrid_activation_parts(
    spec: LlavaSpec, tokens: int, rows: int, tp: int, features: ActivationFeatures
) -> dict[str, int]:
    """Bytes one HybridModel layer of each type saves (`layer_activation_bytes`'s pieces): `*` one
    norm and the attention's, `-` one norm and the MLP's, `E` one norm and its top-k experts' MLP
    inputs (a token's width topk x expert ffn, as the GPT MoE layer's)."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    f = spec.ffn_hidden_size or 4 * h
    args = (heads, tp, features, spec.swiglu, spec.kv_channels, spec.normalization, spec.num_query_groups)
    base = layer_activation_bytes(tokens, rows, h, 0, *args)  # two norms and the attention
    norm = layer_norm_activation_bytes(tokens, rows, h, tp, features, spec.normalization)
    fe = spec.moe_router_topk * (spec.moe_ffn_hidden_size or f) if spec.num_experts else 0
    return {
        "*": base - norm,
        "-": norm + layer_activation_bytes(tokens, rows, h, f, *args) - base,
        "E": norm + layer_activation_bytes(tokens, rows, h, fe, *args) - base,
    }


def other_activation_bytes(
    layout: HeteroLayout, spec: LlavaSpec, module: str, pp_rank: int, rows: int, features: ActivationFeatures
) -> int:
    """Bytes a language stage saves outside its modules' forwards for one micro-batch of `rows`
    samples: on the first stage the embedding's gather indices (int64 per text position and per
    encoder token) and, in a disjoint layout, the encoder tokens it received (the source of the
    `index_copy` into the text embeddings); on the last stage the fp32 loss mask. (Colocated, the
    encoder tokens of the rank's whole share are one received tensor: `rank_activation_bytes`.)"""
    m = layout.module(module)
    if module in spec.encoders or module in spec.outputs:
        return 0
    segs = [x.name for x in language_modules(layout)]
    tokens = spec.seq_length // m.cp
    out = 0
    if module == segs[0] and pp_rank == 0:
        enc_tokens = sum(e.tokens * max(1, e.max_tiles) for n, e in spec.encoders.items() if n in layout.names)
        out += (tokens + enc_tokens) * rows * 8
        if layout.placement == "disjoint":
            out += enc_tokens * rows * spec.hidden_size * features.dtype_bytes
    if module == segs[-1] and pp_rank == m.pp - 1:
        out += tokens * rows * 4
    return out


def _projector_act(enc: EncoderSpec, spec: LlavaSpec, rows: int, tp: int, features: ActivationFeatures) -> int:
    n = enc.tokens * rows
    return (n * enc.hidden_size + 2 * n * spec.hidden_size // tp) * features.dtype_bytes


@dataclass(frozen=True)
class RankActivations:
    """Predicted activation peaks of one rank: per module (each module's own peak in the step) and
    `total` (the largest sum over the rank's modules at one moment)."""

    per_module: dict[str, int]
    total: int
    #: colocated: the encoders' activations held across phase 2, the largest of the language model's
    #: (or a head's) in phase 2, the encoders' recompute in phase 3 (0 disjoint)
    held: int = 0
    phase2: int = 0
    phase3: int = 0


def rank_activation_bytes(
    layout: HeteroLayout,
    spec: LlavaSpec,
    rank: int,
    global_batch: int,
    micro_batch: int,
    sequence_parallel: bool = False,
    recompute: Optional[Recompute] = None,
) -> RankActivations:
    """Activation peaks of rank `rank` in one training step of the layout's schedule:

    * disjoint: the rank's stage keeps the activations of the micro-batches it has run forward and
      not yet backward (the maximum over its schedule table, `plan.schedule`), G / M / dp rows each,
      plus one full-recompute unit during a backward;
    * colocated (three phases): every encoder keeps its forward over this rank's DP share of the step
      (G / dp rows) from phase 1 to its backward in phase 3, while the language model runs Megatron's
      1F1B (stage i of P keeps min(P - i, M) micro-batches of `micro_batch` rows) and each output head
      its forward and backward over its DP share; the encoders' own recompute units come back in phase 3,
      when the language model has freed its activations."""

    plan = rank_plan(layout, rank, global_batch, micro_batch)
    feats = {n: module_activation_features(layout.module(n), spec, sequence_parallel, recompute) for n in plan.modules}
    if layout.placement == "disjoint":
        per: dict[str, int] = {}
        table = plan.disjoint
        if table is None:
            return RankActivations({}, 0)
        name = table.stage.module
        m = layout.module(name)
        rows = plan.micro_batching.samples // m.dp
        kept, transient = stage_activation_bytes(layout, spec, name, table.stage.pp, rows, feats[name])
        other = other_activation_bytes(layout, spec, name, table.stage.pp, rows, feats[name])
        live = peak = 0
        for a in table.compute():
            live += 1 if type(a).__name__ == "Forward" else -1
            peak = max(peak, live)
        per[name] = (peak - 1) * kept + max(kept, transient) if peak else 0
        if other:
            per["other"] = peak * other
        return RankActivations(per, sum(per.values()))
    per = {}
    held = 0  # encoders' activations across phase 2
    phase3 = 0
    for name, mr in plan.modules.items():
        m = layout.module(name)
        if name in spec.encoders:
            rows = len(dp_rows(global_batch, m.dp, mr.coord.dp))
            kept, transient = stage_activation_bytes(layout, spec, name, mr.coord.pp, rows, feats[name])
            per[name] = max(kept, transient)
            held += kept
            phase3 = max(phase3, transient - kept)
    phase2 = 0
    for name, mr in plan.modules.items():
        m = layout.module(name)
        if name in spec.encoders:
            continue
        if name in spec.outputs:
            rows = len(dp_rows(global_batch, m.dp, mr.coord.dp))
            kept, _ = stage_activation_bytes(layout, spec, name, mr.coord.pp, rows, feats[name])
            per[name] = kept
            phase2 = max(phase2, kept)
            continue
        micro_batches = global_batch // m.dp // micro_batch
        kept, transient = stage_activation_bytes(layout, spec, name, mr.coord.pp, micro_batch, feats[name])
        in_flight = min(m.pp - mr.coord.pp, micro_batches)
        per[name] = (in_flight - 1) * kept + max(kept, transient)
        other = in_flight * other_activation_bytes(layout, spec, name, mr.coord.pp, micro_batch, feats[name])
        if name == language_modules(layout)[0].name and mr.coord.pp == 0:  # the step's received encoder tokens
            share = global_batch // m.dp
            enc_tokens = sum(e.tokens * max(1, e.max_tiles) for n, e in spec.encoders.items() if n in layout.names)
            other += share * enc_tokens * spec.hidden_size * feats[name].dtype_bytes
        if other:
            per["other"] = other
        phase2 = max(phase2, per[name] + other)
    return RankActivations(per, held + max(phase2, phase3), held, phase2, phase3)


def predicted_rank_bytes(
    layout: HeteroLayout,
    spec: LlavaSpec,
    rank: int,
    state: StateFeatures,
    global_batch: int,
    micro_batch: int,
    sequence_parallel: bool = False,
    recompute: Optional[Recompute] = None,
) -> dict[str, int]:
    """{'state': resident state bytes, 'activation': activation peak bytes} the model predicts for
    rank `rank` of a training step (`rank_state_bytes`, `rank_activation_bytes`)."""
    return {
        "state": total_bytes(rank_state_bytes(layout, spec, rank, state)),
        "activation": rank_activation_bytes(
            layout, spec, rank, global_batch, micro_batch, sequence_parallel, recompute
        ).total,
    }


def rank_peak_bytes(
    layout: HeteroLayout,
    spec: LlavaSpec,
    rank: int,
    state: StateFeatures,
    global_batch: int,
    micro_batch: int,
    sequence_parallel: bool = False,
    recompute: Optional[Recompute] = None,
    offload_encoders: bool = False,
) -> int:
    """The most device bytes rank `rank` holds at one moment of a step: state + activation peak,
    except with --hetero-offload-encoder on a colocated layout, where the encoders' state leaves the
    device for phase 2: max(all state + the encoders' held activations + their phase-3 recompute,
    the other modules' state + the held activations + the phase-2 peak). (On CPU the "device" is the
    host: only a GPU run measures this; `scripts/gpu_check.sh offload` measures the freed bytes.)"""
    per_state = rank_state_bytes(layout, spec, rank, state)
    acts = rank_activation_bytes(layout, spec, rank, global_batch, micro_batch, sequence_parallel, recompute)
    total_state = total_bytes(per_state)
    if not (offload_encoders and layout.placement == "colocated"):
        return total_state + acts.total
    enc_state = sum(sum(v.values()) for k, v in per_state.items() if k in spec.encoders)
    return max(total_state + acts.held + acts.phase3, total_state - enc_state + acts.held + acts.phase2)
