"""The memory model's Qwen2.5-VL tower (pure): the parameters and the activation bytes of an encoder of
kind "qwen2.5-vl" as `models.qwen_encoder` builds and runs it (`memory_params.stage_params` and
`memory.stage_activation_bytes` hand such an encoder here).

Parameters on one rank of TP t (h the tower's width, f its intermediate size, u = merge**2, H the
language model's width): the Conv3d patch embedding `3 T p^2 h` without bias (first stage,
replicated); per block two RMSNorms (h each), QKV `3h/t x h` with bias, the output projection
`h x h/t` with bias h, SwiGLU `2f/t x h` and `h x f/t` with biases; on the last stage `ln_q` (h) and
the merger, Megatron's MLP projector `u h -> u h -> H` (column-, row-parallel, biases). A frozen tower
trains its merger and `ln_q` only.

Activations of one forward of `rows` images (native resolution, `max_tiles` K: rows x K tiles, the
worst case): the runtime packs them into one sequence of
N = rows x tokens x u patches (batch 1) and the local attention masks whole N x N scores (windows and
frames are boolean masks, not a varlen kernel), so a layer keeps `layer_activation_bytes(N, 1, ...)`
(gated MLP, RMSNorm; the scores `heads/t x N^2`, quadratic in the images of one forward) plus the
rotary terms (cos and sin for the query and the key, 4 N x head_dim, and the rotated halves
2 N x h/t); the stage keeps the boolean masks it uses (N^2 bytes for the windows, N^2 for the frames)
and, first, the patches (N x 3 T p^2), last, `ln_q` (a final RMSNorm over N), the merger's inputs
(N x h, then 2 N x h/t) and the window order and its inverse (int64, N/u each). Checked against what
autograd saves (tests/ranks/test_qwen_memory.py). The tower takes no activation recompute.
"""

from __future__ import annotations

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.planner.memory_terms import ActivationFeatures, layer_activation_bytes, norm_activation_bytes
from megatron_hetero.config.model import EncoderSpec


def _stage_blocks(enc: EncoderSpec, m: ModuleLayout, pp_rank: int) -> range:
    """The global indexes of the blocks pipeline stage `pp_rank` holds (an even split)."""
    if enc.num_layers % m.pp:
        raise ValueError(f"the Qwen2.5-VL tower's {enc.num_layers} blocks do not split over pp({m.pp})")
    per = enc.num_layers // m.pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def merger_params(enc: EncoderSpec, llm_hidden: int, tp: int) -> int:
    """`ln_q` and the merger on one rank of TP `tp` (what a frozen tower still trains)."""
    h, u = enc.hidden_size, enc.merge_size**2
    inner = u * h // tp
    return h + inner * u * h + inner + llm_hidden * inner + llm_hidden


def block_params(enc: EncoderSpec, tp: int) -> int:
    """One tower block on one rank of TP `tp`."""
    h = enc.hidden_size
    f = enc.ffn_hidden_size or 4 * h
    attention = (3 * h // tp) * h + 3 * h // tp + h * (h // tp) + h
    mlp = (2 * f // tp) * h + 2 * f // tp + h * (f // tp) + h
    return 2 * h + attention + mlp


def patch_width(enc: EncoderSpec) -> int:
    """Input features of one patch: 3 x temporal_patch x patch**2."""
    return 3 * enc.temporal_patch_size * enc.patch_size**2


def qwen_stage_params(enc: EncoderSpec, llm_hidden: int, m: ModuleLayout, pp_rank: int) -> int:
    """All parameters one rank of the tower's stage `pp_rank` holds (module docstring)."""
    total = len(_stage_blocks(enc, m, pp_rank)) * block_params(enc, m.tp)
    if pp_rank == 0:
        total += patch_width(enc) * enc.hidden_size
    if pp_rank == m.pp - 1:
        total += merger_params(enc, llm_hidden, m.tp)
    return total


def qwen_activation_bytes(
    enc: EncoderSpec, llm_hidden: int, m: ModuleLayout, pp_rank: int, rows: int, features: ActivationFeatures
) -> int:
    """Bytes one forward of `rows` images through the tower's stage `pp_rank` keeps for its backward
    (module docstring; no recompute, no sequence parallelism on the tower)."""
    if m.cp != 1:
        raise ValueError(f"module {m.name}: the Qwen2.5-VL tower runs with cp 1, got {m.arithmetic()}")
    h, heads, tp = enc.hidden_size, enc.num_attention_heads, m.tp
    f = enc.ffn_hidden_size or 4 * h
    u, b = enc.merge_size**2, features.dtype_bytes
    n = rows * max(1, enc.max_tiles) * enc.tokens * u  # native resolution: the worst case, K tiles a sample
    plain = ActivationFeatures(dtype_bytes=b, keeps_scores=features.keeps_scores)
    layer = layer_activation_bytes(n, 1, h, f, heads, tp, plain, gated=True, normalization="RMSNorm")
    layer += (4 * n * (h // heads) + 2 * n * h // tp) * b  # rotary: cos, sin (query, key); rotated halves
    blocks = _stage_blocks(enc, m, pp_rank)
    full = set(enc.fullatt_block_indexes)
    kinds = {i in full for i in blocks}
    out = len(blocks) * layer + len(kinds) * n * n  # the boolean masks the stage's blocks use
    if pp_rank == 0:
        out += n * patch_width(enc) * b
    if pp_rank == m.pp - 1:
        out += norm_activation_bytes(n, 1, h, 1, plain, "RMSNorm")
        out += (n * h + 2 * n * h // tp) * b + 2 * (n // u) * 8
    return out
