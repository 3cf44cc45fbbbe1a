"""The Qwen2.5-VL encoder kind and the M-RoPE language module of the training runtime
(`models.qwen_encoder`, `models.llava.LanguageModule` with `position_embedding_type` "mrope") equal
the building blocks that match transformers (`models.qwen_vision.QwenVisionTower` on the image
processor's patches and grid; `models.qwen_vl.QwenVLLanguage`: ids from the tokens by `rope_index`,
one row per sample) on the same weights, world 1; the planner's parameter count of the tower is
the built module's."""

from __future__ import annotations

import dataclasses

import torch

from megatron_hetero.planner.model import workload
from megatron_hetero.runtime.launcher import run_ranks

from qwen_train_case import SPEC


def _compare() -> dict:
    """On a world of one: (the runtime modules' logits, the building blocks', the ids after the image)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_weights import world_of_one, world_of_one_layout
    from megatron_hetero.models.qwen_vl import QwenVLLanguage
    from megatron_hetero.training.setup import build_module

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    spec = dataclasses.replace(SPEC, seq_length=16)
    enc = spec.encoders["vision"]
    layout = world_of_one_layout(["vision"])
    with world_of_one(layout) as topo:
        vision = build_module("vision", layout, spec, topo.pg_collection("vision")).cpu().eval()
        lm = build_module("language", layout, spec, topo.pg_collection("language")).cpu().eval()
        g = torch.Generator().manual_seed(3)
        b = 2
        x = torch.randn(b, enc.tokens, enc.feature_dim, generator=g)
        with torch.no_grad():
            got_tokens = vision(x)
            # the tower on the processor's flat patches, images one after the other, grid (1, 4, 6)
            grid = torch.tensor([[1, 4, 6]] * b)
            want_tokens = vision.tower(x.reshape(-1, enc.feature_dim // 4), grid).view(b, enc.tokens, -1)
            assert torch.equal(got_tokens, want_tokens)
            tokens = torch.randint(3, 100, (b, spec.seq_length), generator=g)
            tokens[:, enc.offset - 1] = 120  # vision start
            tokens[:, enc.offset : enc.offset + enc.tokens] = 121  # image tokens
            got = lm(lm.embed(tokens, {"vision": got_tokens}))  # logits [b, s, vocab]
            ref = QwenVLLanguage(lm.gpt, image_token=121, vision_start=120, merge=2)
            want = ref(tokens, got_tokens.reshape(-1, got_tokens.shape[-1]), grid)
        after = lm.mrope_ids[:, 0, enc.offset + enc.tokens].tolist()
    params = sum(p.numel() for p in vision.parameters())
    return {"got": got, "want": want, "after": after, "offset": enc.offset, "params": params}


def test_runtime_modules_equal_the_building_blocks():
    (r,) = run_ranks(1, _compare, timeout=120)
    got, want = r["got"], r["want"]
    rel = float((got - want).abs().max() / want.abs().max())
    print(f"\nQwen2.5-VL runtime language module vs QwenVLLanguage: {rel:.2e} relative")
    assert rel <= 1e-6, rel
    # the ids differ from 1-D positions after the image (a non-square image: 2 x 3 merged tokens)
    assert r["after"] == [r["offset"] + 3] * 3
    # the planner counts the tower's parameters as built (`planner.model.qwen_encoder_spec`)
    assert workload(SPEC, global_batch=4, micro_batch=2).encoder.params == r["params"]


def _native() -> float:
    """World 1: the module's output for tiles [2, 0, 1] against the tower run on each sample's image
    alone (4 x 3 and 2 x 3 merged tokens), and the output with each tile its own image: their
    largest differences relative to the reference's largest value."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_weights import world_of_one, world_of_one_layout
    from megatron_hetero.training.setup import build_module

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    enc = dataclasses.replace(SPEC.encoders["vision"], max_tiles=2)
    spec = dataclasses.replace(SPEC, encoders={"vision": enc})
    layout = world_of_one_layout(["vision"])
    with world_of_one(layout) as topo:
        vision = build_module("vision", layout, spec, topo.pg_collection("vision")).cpu().eval()
        x = torch.randn(3, enc.tokens, enc.feature_dim, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            got = vision(x, tiles=[2, 0, 1]).reshape(-1, SPEC.hidden_size)
            tall = vision.tower(x[:2].reshape(-1, enc.feature_dim // 4), torch.tensor([[1, 8, 6]]))
            short = vision.tower(x[2:].reshape(-1, enc.feature_dim // 4), torch.tensor([[1, 4, 6]]))
            per_tile = vision(x).reshape(-1, SPEC.hidden_size)  # each tile its own image: differs
    want = torch.cat([tall, short])
    return [float((y - want).abs().max() / want.abs().max()) for y in (got, per_tile)]


def test_native_resolution_a_samples_tiles_are_one_image():
    ((got, per_tile),) = run_ranks(1, _native, timeout=120)
    print(f"\nnative resolution: {got:.1e} relative; each tile its own image: {per_tile:.1e}")
    assert got <= 1e-6, got
    assert per_tile > 1e-4, per_tile  # the tall image's full attention crosses its tiles


def _native_language() -> float:
    """World 1: the runtime language module on a batch of a 4 x 3 and a 2 x 3 image with the M-RoPE ids
    of `batch_mrope_ids` against `QwenVLLanguage` (ids from the tokens and the grid): relative difference."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_weights import world_of_one, world_of_one_layout
    from megatron_hetero.models.qwen_positions import batch_mrope_ids
    from megatron_hetero.models.qwen_vl import QwenVLLanguage
    from megatron_hetero.training.setup import build_module

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    enc = dataclasses.replace(SPEC.encoders["vision"], max_tiles=2)
    spec = dataclasses.replace(SPEC, seq_length=20, encoders={"vision": enc})
    layout = world_of_one_layout(["vision"])
    with world_of_one(layout) as topo:
        lm = build_module("language", layout, spec, topo.pg_collection("language")).cpu().eval()
        g = torch.Generator().manual_seed(4)
        tokens = torch.randint(3, 100, (2, spec.seq_length), generator=g)
        mask = torch.zeros(2, spec.seq_length, dtype=torch.bool)
        mask[0, 2:14], mask[1, 2:8] = True, True  # 2 tiles (4 x 3 tokens), 1 tile (2 x 3)
        tokens[:, 1], tokens[mask] = 120, 121
        images = torch.randn(2, 12, spec.hidden_size, generator=g)  # row 1: 6 tokens, then padding
        with torch.no_grad():
            lm.set_mrope_ids(batch_mrope_ids(enc, mask, [2, 1]))
            got = lm(lm.embed(tokens, {"vision": images}, {"vision": mask}))
            ref = QwenVLLanguage(lm.gpt, image_token=121, vision_start=120, merge=2)
            want = ref(tokens, torch.cat([images[0], images[1, :6]]), torch.tensor([[1, 8, 6], [1, 4, 6]]))
    return float((got - want).abs().max() / want.abs().max())


def test_native_resolution_m_rope_ids_follow_each_image():
    (rel,) = run_ranks(1, _native_language, timeout=120)
    print(f"\nnative-resolution M-RoPE language module vs QwenVLLanguage: {rel:.2e} relative")
    assert rel <= 1e-6, rel
