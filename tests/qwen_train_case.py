"""A tiny model with the Qwen2.5-VL tower as its vision encoder (`EncoderSpec.kind` "qwen2.5-vl": two
blocks, the second with full attention, windows of 2 x 2 merged tokens over a 2 x 3 token image) and
a Qwen2.5 language model with M-RoPE, shared by the runtime's parity (tests/ranks) and module
(tests/e2e) tests; `TOWER`, the tower alone, also by the planner's pure tests; `JOB`, the parity
tests' job. Pure: no torch."""

from __future__ import annotations

import dataclasses

from megatron_hetero.config.job import JobConfig
from megatron_hetero.config.model import EncoderSpec, LlavaSpec
from megatron_hetero.config.optim import OptimConfig

TOWER = EncoderSpec(
    kind="qwen2.5-vl",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=2,
    ffn_hidden_size=48,
    tokens=6,
    image_rows=2,
    patch_size=2,
    feature_dim=4 * 3 * 2 * 2 * 2,
    window_size=8,
    fullatt_block_indexes=(1,),
    activation="silu",
)
QWEN = dataclasses.replace(TOWER, offset=2)
SPEC = LlavaSpec(
    seq_length=24,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    swiglu=True,
    add_bias_linear=False,
    add_qkv_bias=True,
    position_embedding_type="mrope",
    mrope_section=(2, 3, 3),
    rotary_base=10000.0,
    encoders={"vision": QWEN},
)

#: two SGD steps of SPEC (large steps: a wrong gradient shows in the parameters), the parity tests' job
JOB = JobConfig(
    spec=SPEC, global_batch_size=4, micro_batch_size=2, train_iters=2, optim=OptimConfig(optimizer="sgd", lr=0.5)
)
