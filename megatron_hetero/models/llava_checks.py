"""The LLaVA model's checks against a layout that need the model's sizes (experts, output heads,
encoders on CP, sequence parallelism): ValueError with the arithmetic, before any process group
exists. Pure: no torch. `models.llava` builds the modules these checks allow."""

from __future__ import annotations

from megatron_hetero.layout.spec import HeteroLayout, ModuleLayout
from megatron_hetero.layout.validate import check_experts
from megatron_hetero.models.architecture import CP_REASON, check_architecture
from megatron_hetero.plan import roles as plan_roles
from megatron_hetero.config.model import QWEN_VL, EncoderSpec, LlavaSpec


def validate_model(layout: HeteroLayout, spec: LlavaSpec, sequence_parallel: bool = False) -> None:
    """The model's checks against the layout that need the model's sizes (experts, output modules);
    ValueError with the arithmetic, before any group exists. `sequence_parallel`: the job's
    --sequence-parallel (Megatron's MoE layers need it for tp > 1 with ep > 1)."""
    who = plan_roles.roles(layout)
    langs = set(who.language)
    if spec.num_experts is not None and (
        spec.num_experts < 1 or spec.moe_router_topk < 1 or spec.moe_router_topk > spec.num_experts
    ):
        raise ValueError(f"--moe-router-topk {spec.moe_router_topk} must be in 1..--num-experts {spec.num_experts}")
    if spec.moe_aux_loss_coeff < 0:
        raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {spec.moe_aux_loss_coeff}")
    check_experts(layout, {n: spec.num_experts for n in langs})
    for name, enc in spec.encoders.items():
        if name in layout.names:
            check_encoder_cp(name, enc, layout.module(name), spec.transformer_impl)
        if enc.max_tiles and name in layout.names and layout.module(name).pp > 1:
            raise ValueError(
                f"module {name}: variable image tokens (--encoder-max-tiles {enc.max_tiles}) run with the "
                f"encoder on one pipeline stage (its stages would exchange a tile count known only from the "
                f"data); got pp({layout.module(name).pp}); use pp 1 for {name}"
            )
    check_architecture(layout, spec, langs)
    if spec.transformer_impl != "local":
        for name in langs:
            if layout.module(name).cp > 1:
                raise ValueError(
                    f"module {name}: cp({layout.module(name).cp}) > 1 with --transformer-impl "
                    f"{spec.transformer_impl} is not supported yet (context parallelism runs with the local "
                    "impl's core attention); use --transformer-impl local or cp 1"
                )
    for name in langs:
        m = layout.module(name)
        if spec.num_experts and m.ep > 1 and m.tp > 1 and not sequence_parallel:
            raise ValueError(
                f"module {name}: ep({m.ep}) with tp({m.tp}) > 1 needs sequence parallelism in Megatron's "
                "MoE layers: add --sequence-parallel, or use tp 1 with ep > 1 (or ep 1)"
            )
    for name in who.outputs:
        if name not in spec.outputs:
            raise ValueError(
                f"module {name} comes after the language model but the model has no output head "
                f"named {name} (output heads: {sorted(spec.outputs)})"
            )
        m, o = layout.module(name), spec.outputs[name]
        if m.pp != 1 or m.cp != 1:
            raise ValueError(f"module {name}: an output head runs with pp 1 and cp 1, got {m.arithmetic()}")
        if m.tp > 1 and o.hidden_size % m.tp:
            raise ValueError(f"module {name}: its hidden size {o.hidden_size} is not divisible by tp({m.tp})")
        if o.offset < 0 or o.offset + o.tokens > spec.seq_length:
            raise ValueError(
                f"module {name}: positions [{o.offset}, {o.offset + o.tokens}) do not fit in "
                f"--seq-length {spec.seq_length}"
            )
        producers = layout.producers(name)
        if producers != [who.last_language]:
            raise ValueError(
                f"output module {name} must have exactly one edge, '{who.last_language} -> {name}'; "
                f"its producers are {producers}"
            )
        lm = layout.module(who.last_language)
        if lm.cp != 1:
            raise ValueError(
                f"module {lm.name}: cp({lm.cp}) > 1 with output module {name}: the output positions "
                "would be spread over CP ranks; use cp 1 on the language model"
            )


def check_encoder_cp(name: str, enc: EncoderSpec, m: ModuleLayout, impl: str = "local") -> None:
    """ValueError unless encoder `name` can run on `m`'s CP degree: cp 1, or a linear-patch encoder on
    one pipeline stage with the local impl, its tokens (per tile) divisible by 2*cp."""
    if m.cp == 1:
        return
    why = None
    if enc.kind == QWEN_VL:
        why = CP_REASON
    elif enc.kind != "linear":
        why = f"a {enc.kind} tower runs with cp 1"
    elif m.pp != 1:
        why = f"an encoder with cp > 1 runs on one pipeline stage (pp {m.pp})"
    elif impl != "local":
        why = "context parallelism runs with the local impl's core attention (--transformer-impl local)"
    elif enc.tokens % (2 * m.cp):
        why = f"its {enc.tokens} tokens (per tile) are not divisible by 2*cp = {2 * m.cp}"
    if why:
        raise ValueError(f"module {name}: cp({m.cp}) > 1: {why}; use cp 1 for {name}")


def check_sequence_parallel(layout: HeteroLayout, spec: LlavaSpec) -> None:
    """`--sequence-parallel`'s checks (ValueError naming the module, before any group exists): each
    language module with tp > 1 shards its local sequence (seq_length / cp) over tp."""
    for name in plan_roles.roles(layout).language:
        m = layout.module(name)
        if m.tp == 1:
            continue  # Megatron ignores --sequence-parallel at tp 1
        if spec.seq_length % (m.cp * m.tp):
            raise ValueError(
                f"module {name}: --sequence-parallel shards each CP rank's {spec.seq_length} // cp({m.cp}) "
                f"positions over tp({m.tp}): --seq-length {spec.seq_length} is not divisible by "
                f"cp*tp = {m.cp * m.tp}"
            )
