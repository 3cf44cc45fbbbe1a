"""The workloads of `megatron-hetero bench e2e` (`bench/e2e.py`): the tiny LLaVA models at `WORLD` ranks,
each with the language model's fixed degrees, its homogeneous layout and the search space around it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_hetero.bench.planner_configs import BenchModel, _colo
from megatron_hetero.planner import search_space as SP
from megatron_hetero.config.model import EncoderSpec, LlavaSpec


WORLD = 4


@dataclass(frozen=True)
class E2EWorkload:
    """A workload: the model, the language model's fixed degrees, its homogeneous layout."""

    name: str
    model: BenchModel
    llm_tp: int
    llm_cp: int
    homogeneous: dict  # layout document
    why: str
    search_pp: tuple = (1, 2)

    def space(self) -> SP.SearchSpace:
        m = self.model
        enc_tp = tuple(t for t in (1, 2, 4) if t <= WORLD and m.encoder.num_attention_heads % t == 0)
        return SP.SearchSpace(
            placements=("colocated", "disjoint"),
            tp=(self.llm_tp,),
            cp=(self.llm_cp,),
            pp=self.search_pp,
            encoder_tp=enc_tp,
            encoder_cp=(1,),
            encoder_pp=(1, 2),
            offload=(False,),
            runtime=True,
        )


WORKLOADS = (
    E2EWorkload(
        "inherited-tp",
        BenchModel(
            LlavaSpec(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                seq_length=160,
                vocab_size=128,
                encoders={
                    "vision": EncoderSpec(
                        num_layers=8, hidden_size=64, num_attention_heads=4, tokens=128, feature_dim=48
                    )
                },
            ),
            global_batch_size=16,
            micro_batch_size=2,
        ),
        llm_tp=2,
        llm_cp=1,
        homogeneous=_colo({"tp": 2, "dp": 2}, {"tp": 2, "dp": 2}),
        why="language model fixed at TP2 (its memory); the encoder (128 image tokens, 8 layers) inherits TP2",
    ),
    E2EWorkload(
        "long-context",
        BenchModel(
            LlavaSpec(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                seq_length=256,
                vocab_size=128,
                encoders={
                    "vision": EncoderSpec(
                        num_layers=8, hidden_size=64, num_attention_heads=4, tokens=64, feature_dim=48
                    )
                },
            ),
            global_batch_size=16,
            micro_batch_size=2,
        ),
        llm_tp=1,
        llm_cp=2,
        homogeneous=_colo({"tp": 2, "dp": 2}, {"cp": 2, "dp": 2}),
        why="language model needs CP2 (sequence 256); the encoder's 64 tokens (8 layers) take no CP, so the homogeneous "
        "layout gives it the language model's 2-way group as TP",
    ),
)


def quick_workloads() -> tuple:
    """Smaller models for `--quick` (the smoke test): the same layouts and constraints."""
    out = []
    for w in WORKLOADS:
        m = dataclasses.replace(w.model.resized(encoder_num_layers=2, num_layers=2), global_batch_size=8)
        if w.name == "inherited-tp":
            m = m.resized(encoder_tokens=64, seq_length=80)
        out.append(dataclasses.replace(w, model=m))
    return tuple(out)
