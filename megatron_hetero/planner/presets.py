"""Model-size presets and the simulated regime table (`megatron-hetero search --regime-table`): the
search's pick per (encoder, LLM, context) at cluster scale. Pure (numpy only)."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_hetero.planner.hardware import Profile
from megatron_hetero.config.model import EncoderSpec
from megatron_hetero.planner.search import search
from megatron_hetero.planner.search_space import SearchSpace
from megatron_hetero.planner.workload import ModelSpec, Workload

# Encoders: ViT-style, 1024 patches per image (448 px / 14 px patches of 14 x 14 x 3 features),
# non-gated MLP 4h.
PATCH_FEATURES = 14 * 14 * 3
ENCODER_PRESETS = {
    "1B": ModelSpec("vision-1B", 32, 1536, 6144, 16, 1024, kind="encoder", features=PATCH_FEATURES),
    "3B": ModelSpec("vision-3B", 48, 2304, 9216, 24, 1024, kind="encoder", features=PATCH_FEATURES),
    "6B": ModelSpec("vision-6B", 48, 3200, 12800, 32, 1024, kind="encoder", features=PATCH_FEATURES),
    "12B": ModelSpec("vision-12B", 60, 4096, 16384, 32, 1024, kind="encoder", features=PATCH_FEATURES),
}
# Towers of another structure than the ViT presets, priced as `train` builds them (`planner.model`:
# `search --encoder NAME`, not in the regime table). "qwen2.5-vl": Qwen2.5-VL-7B's vision tower
# (32 blocks, hidden 1280, 16 heads, SwiGLU 3420, patch 14, windows of 112 px, full attention in
# blocks 7, 15, 23, 31) at 448x448 pixels: 1024 patches, 256 merged tokens.
TOWER_PRESETS = {
    "qwen2.5-vl": EncoderSpec(
        kind="qwen2.5-vl",
        num_layers=32,
        hidden_size=1280,
        num_attention_heads=16,
        ffn_hidden_size=3420,
        tokens=256,
        patch_size=14,
        feature_dim=4 * 3 * 2 * 14 * 14,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        activation="silu",
    )
}
# Speech encoders (`search --audio-encoder NAME`, the layout's `audio` module): Whisper's encoders as
# `train --audio-model-type whisper` builds them (`planner.model.encoder_model_spec`), one 30 s chunk
# = 1500 tokens (two log-mel frames a token, 80 mel bins; large-v3: 128), a clip of k chunks k inputs.
WHISPER_CHUNK_TOKENS = 1500
SPEECH_PRESETS = {
    name: EncoderSpec(
        kind="whisper",
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        tokens=WHISPER_CHUNK_TOKENS,
        feature_dim=2 * mels,
        activation="gelu",
    )
    for name, layers, hidden, heads, mels in (
        ("whisper-tiny", 4, 384, 6, 80),
        ("whisper-base", 6, 512, 8, 80),
        ("whisper-small", 12, 768, 12, 80),
        ("whisper-medium", 24, 1024, 16, 80),
        ("whisper-large-v3", 32, 1280, 20, 128),
    )
}
# LLMs: gated (SwiGLU) MLP, 128K vocabulary, untied embeddings; seq is set per context.
LLM_PRESETS = {
    "14B": ModelSpec("llm-14B", 40, 5120, 13824, 40, 8192, vocab=128256, gated=True),
    "70B": ModelSpec("llm-70B", 80, 8192, 24576, 64, 8192, vocab=128256, gated=True),
    "120B": ModelSpec("llm-120B", 96, 10240, 26624, 80, 8192, vocab=128256, gated=True),
}
REGIME_WORLD = {"14B": 64, "70B": 256, "120B": 1024}
REGIME_CONTEXTS = (8192, 32768, 131072)
TOKENS_PER_STEP = 4 * 1024 * 1024


def regime_workload(encoder: str, llm: str, context: int, tokens_per_step: int = TOKENS_PER_STEP) -> Workload:
    """The regime table's workload: global batch = tokens_per_step / context samples, one
    1024-patch image per 8K tokens of context (image tokens = 1/8 of the context)."""
    try:
        enc, lm = ENCODER_PRESETS[encoder], LLM_PRESETS[llm]
    except KeyError as exc:
        raise ValueError(f"unknown preset {exc}; encoders {list(ENCODER_PRESETS)}, LLMs {list(LLM_PRESETS)}") from None
    lm = ModelSpec(lm.name, lm.num_layers, lm.hidden, lm.ffn_hidden, lm.heads, context, vocab=lm.vocab, gated=lm.gated)
    return Workload(enc, lm, global_batch=max(1, tokens_per_step // context), images_per_sample=max(1, context // 8192))


def regime_table(
    prof: Profile,
    encoders: Sequence[str] = tuple(ENCODER_PRESETS),
    llms: Sequence[str] = tuple(LLM_PRESETS),
    contexts: Sequence[int] = REGIME_CONTEXTS,
    world_sizes: Optional[dict] = None,
    memory_limit: Optional[float] = None,
    space: SearchSpace = SearchSpace(),
) -> list[dict]:
    """One row per (encoder, LLM, context): the placement the search picks, its step time, the best
    step time per placement and the predicted gain over the best homogeneous configuration."""
    worlds = dict(REGIME_WORLD, **(world_sizes or {}))
    rows = []
    for lm in llms:
        for enc in encoders:
            for ctx in contexts:
                wl = regime_workload(enc, lm, ctx)
                row = {
                    "encoder": enc,
                    "llm": lm,
                    "context": ctx,
                    "gpus": worlds[lm],
                    "global_batch": wl.global_batch,
                    "picked": None,
                    "layout": None,
                    "step_s": None,
                    "gain": None,
                    "homogeneous_s": None,
                    "colocated_s": None,
                    "disjoint_s": None,
                }
                try:
                    res = search(wl, prof, worlds[lm], memory_limit, space, top=1)
                except ValueError:
                    rows.append(row)
                    continue
                row.update(
                    picked=res.best.candidate.placement,
                    layout=res.best.candidate.describe(),
                    step_s=res.best.breakdown.total,
                    gain=res.gain,
                    evaluated=res.evaluated,
                    space_size=res.space_size,
                    seconds=res.seconds,
                )
                row["breakdowns"] = {}
                for kind, r in res.by_placement.items():
                    row[f"{kind}_s"] = r.breakdown.total
                    row["breakdowns"][kind] = r.breakdown.to_dict()
                rows.append(row)
    return rows


#: the step's parts the regime comparison names (planner/workload.py CostBreakdown)
PARTS = ("compute", "tp_comm", "cp_comm", "pp_comm", "dp_comm", "boundary", "offload", "bubble", "optimizer")


def paper_direction(row: dict) -> str:
    """How a regime row compares with the directions of the paper this project comes from: colocated
    heterogeneity for small (1B, 3B) encoders, disjoint for 6-12B encoders with a 120B LLM (no stated
    direction for 6-12B encoders with a 14B or 70B LLM). Where the pick differs: the expected placement
    does not fit, or its best layout's step is longer, mostly by the part named (its seconds over the
    picked layout's)."""
    if row["encoder"] in ("6B", "12B") and row["llm"] == "120B":
        expected = "disjoint"
    elif row["encoder"] in ("1B", "3B"):
        expected = "colocated"
    else:
        return "no stated direction"
    if row["picked"] == expected:
        return "agrees"
    if row["picked"] is None:
        return "differs: nothing fits (memory)"
    if row.get(f"{expected}_s") is None:
        return f"differs: {expected} does not fit (memory)"
    got, want = row["breakdowns"][row["picked"]], row["breakdowns"][expected]
    part = max(PARTS, key=lambda k: want.get(k, 0.0) - got.get(k, 0.0))
    return (
        f"differs: {expected} {want['total'] - got['total']:.2f} s slower, mostly {part} "
        f"(+{want.get(part, 0.0) - got.get(part, 0.0):.2f} s)"
    )
