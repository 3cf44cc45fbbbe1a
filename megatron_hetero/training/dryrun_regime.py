"""`dryrun --regime-row ENC,LLM,CONTEXT`: a row of the search's regime table (`planner.presets`) as a
job train can run, on the layout the search picks at the dry run's world size, so the modules the
dry run builds on the meta device are the paper's sizes and their state bytes can be held against the
planner's two memory models: `planner.memory` (per rank, from the module's exact parameter counts)
and the search's own (`planner.stages.module_stages`: per pipeline-stage class of a candidate).

The job is the search's `Workload` defaults: bf16 with fp32 main gradients, Adam, the distributed
optimizer, sequence parallelism; the encoder a ViT-style `linear` encoder of the preset's sizes
(1024 patch tokens of 14x14x3 features), the LLM a Llama-style model (RMSNorm, SwiGLU, rope, no
linear biases, untied embeddings, 128,256 tokens) with the row's context.
"""

from __future__ import annotations

from typing import Any

from megatron_hetero.layout.spec import HeteroLayout
from megatron_hetero.config.job import JobConfig, JobDraft
from megatron_hetero.plan.placement import coord_of
from megatron_hetero.planner.hardware import Profile
from megatron_hetero.planner.hardware_presets import DEFAULT_HARDWARE, load_hardware
from megatron_hetero.config.model import EncoderSpec
from megatron_hetero.planner.presets import ENCODER_PRESETS, LLM_PRESETS, regime_workload
from megatron_hetero.planner.search import search
from megatron_hetero.planner.stages import module_stages
from megatron_hetero.config.optim import OptimConfig


def parse_row(text: str) -> tuple[str, str, int]:
    """`1B,14B,8192` -> (encoder preset, LLM preset, context). ValueError naming the presets."""

    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or parts[0] not in ENCODER_PRESETS or parts[1] not in LLM_PRESETS or not parts[2].isdigit():
        raise ValueError(
            f"--regime-row {text!r}: give ENCODER,LLM,CONTEXT with an encoder of {list(ENCODER_PRESETS)}, "
            f"an LLM of {list(LLM_PRESETS)} and a context in tokens (e.g. 1B,14B,8192)"
        )
    return parts[0], parts[1], int(parts[2])


def regime_case(text: str, world_size: int, hardware: str | None = None) -> tuple[JobDraft, Any, Any]:
    """(job, workload, candidate) of the regime row `text` on `world_size` ranks: the job a `JobDraft`
    of the search's best candidate (default hardware preset) as a layout and the `JobConfig` of the
    module docstring."""
    from megatron_hetero.models.llava import LlavaSpec

    enc_name, llm_name, context = parse_row(text)
    wl = regime_workload(enc_name, llm_name, context)
    prof = Profile.from_hardware(load_hardware(hardware or DEFAULT_HARDWARE))
    cand = search(wl, prof, world_size, top=1).best.candidate
    layout = cand.to_layout()
    e, lm = wl.encoder, wl.llm
    encoder = EncoderSpec(
        num_layers=e.num_layers,
        hidden_size=e.hidden,
        num_attention_heads=e.heads,
        tokens=e.seq * wl.images_per_sample,
        feature_dim=e.features,
        ffn_hidden_size=e.ffn_hidden,
    )
    spec = LlavaSpec(
        num_layers=lm.num_layers,
        hidden_size=lm.hidden,
        num_attention_heads=lm.heads,
        ffn_hidden_size=lm.ffn_hidden,
        vocab_size=lm.vocab,
        seq_length=lm.seq,
        encoders={"vision": encoder},
        normalization="RMSNorm",
        swiglu=lm.gated,
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        bf16=True,
    )
    optim = OptimConfig(bf16=True, use_distributed_optimizer=wl.distributed_optimizer)
    job = JobConfig(
        spec=spec,
        global_batch_size=wl.global_batch,
        micro_batch_size=wl.micro_batch,
        train_iters=1,
        optim=optim,
        sequence_parallel=wl.sequence_parallel,
    )
    return JobDraft(layout, job), wl, cand


def search_state_bytes(wl, cand, layout: HeteroLayout, rank: int) -> dict[str, float]:
    """Module -> the search's state bytes (weights, grads, optimizer) of rank `rank`'s stage of it:
    `planner.stages.module_stages` of the candidate's module (one row), the stage class of the
    rank's pipeline stage (first, middle, last; layers split evenly, as the runtime requires)."""

    prof = Profile.from_hardware(load_hardware(DEFAULT_HARDWARE))
    out: dict[str, float] = {}
    segs = list(cand.llm)
    for i, m in enumerate(layout.modules):
        if rank not in m.rank_range.ranks():
            continue
        pp = coord_of(m, rank).pp
        if i == 0:  # the encoder
            seg, spec, first, last = cand.encoder, wl.encoder, False, False
        else:
            seg, spec = segs[i - 1], wl.llm
            first, last = i == 1, i == len(segs)
        st = module_stages(
            prof,
            wl,
            spec,
            seg.tp,
            seg.cp,
            seg.pp,
            seg.dp,
            seg.layers,
            1,
            runs=1,
            p2p=seg.pp > 1,
            inter=True,
            placement=cand.placement if cand.placement != "homogeneous" else "colocated",
            embed_first=first,
            embed_last=last,
            io_last=last,
            ep=seg.ep,
        )
        cls = 0 if pp == 0 else (3 if pp == seg.pp - 1 else 2)
        out[m.name] = float(st.state[0, cls])
    return out


def with_search_state(doc: dict, wl, cand, layout: HeteroLayout) -> dict:
    """`doc` (a dry run's) with each rank's `state_bytes.search` (the search's model, summed) and
    per module."""
    ranks = []
    for r in doc["ranks"]:
        s = search_state_bytes(wl, cand, layout, r["rank"])
        sb = dict(r["state_bytes"])
        sb["search"] = sum(s.values())
        sb["modules"] = {n: dict(v, search=s.get(n)) for n, v in sb["modules"].items()}
        ranks.append(dict(r, state_bytes=sb))
    return dict(doc, ranks=ranks, regime={"candidate": cand.describe(), "global_batch": wl.global_batch})


__all__ = ["parse_row", "regime_case", "search_state_bytes", "with_search_state"]
