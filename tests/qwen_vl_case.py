"""A tiny random `Qwen2_5_VLForConditionalGeneration` (transformers) and a batch of two conversations
with three images of different sizes (row 0: one 4x6-patch image; row 1: a 6x4 one and a two-frame
4x4 one), shared by the whole-model tests of the world-1 (tests/e2e) and TP (tests/ranks) tiers."""

from __future__ import annotations

import re

import torch

from qwen_vision_case import CONFIG as VISION

S, V = 40, 128
IMAGE, START, END = 120, 121, 122
TEXT = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    tie_word_embeddings=False,
)
GRIDS = [[[1, 4, 6]], [[1, 6, 4], [2, 4, 4]]]


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [2, S], patches of the batch's images, grid_thw [3, 3])."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for grids in GRIDS:
        row = torch.randint(0, 100, (3,), generator=g).tolist()
        for t, h, w in grids:
            row += [START] + [IMAGE] * (t * h * w // 4) + [END] + torch.randint(0, 100, (2,), generator=g).tolist()
        row += torch.randint(0, 100, (S - len(row),), generator=g).tolist()
        rows.append(row)
    grid = torch.tensor([x for grids in GRIDS for x in grids])
    patches = torch.randn(int(grid.prod(dim=1).sum()), 24, generator=g)
    return torch.tensor(rows), patches, grid


def reference() -> tuple[dict, dict, dict]:
    """(config dict, state dict, transformers' {"logits", "loss"} on `batch()` with labels = tokens,
    image tokens ignored)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(VISION, out_hidden_size=TEXT["hidden_size"])
    cfg = Qwen2_5_VLConfig(
        text_config=dict(TEXT),
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=123,
        attn_implementation="eager",
    )
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tokens, patches, grid = batch()
    labels = tokens.masked_fill(tokens == IMAGE, -100)
    with torch.no_grad():
        out = model(input_ids=tokens, pixel_values=patches, image_grid_thw=grid, labels=labels)
        pos = model.model.get_rope_index(tokens, grid, None, None, None)[0]
    ref = {"logits": out.logits, "loss": out.loss, "position_ids": pos}
    return cfg.to_dict(), {k: v.clone() for k, v in model.state_dict().items()}, ref


def vl_rank(cfg: dict, hf: dict, layout_doc: dict) -> dict:
    """Build the tower on the vision module's ranks and the M-RoPE language model on the language
    module's, load the weights (this rank's TP shards), run: the vision module's first rank broadcasts
    the merged tokens to every rank (colocated or disjoint alike); the language ranks return logits
    (vocabulary gathered over TP), the mean loss over the text labels and their position ids."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.convert.hf_qwen_vision import hf_to_tower
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.qwen_vision import QwenVisionSpec, QwenVisionTower
    from megatron_hetero.models.qwen_vl import QwenTextSpec, QwenVLLanguage, build_language, language_from_hf
    from megatron_hetero.runtime.topology import Topology

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    layout = layout_from_dict(layout_doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    vspec, tspec = QwenVisionSpec.from_hf(cfg["vision_config"]), QwenTextSpec.from_hf(cfg["text_config"])
    tokens, patches, grid = batch()
    images = torch.empty(int(grid.prod(dim=1).sum()) // 4, tspec.hidden_size)
    if topo.modules["vision"].member:
        vpg = topo.pg_collection("vision")
        tower = QwenVisionTower(vspec, layout.module("vision"), vpg).eval()
        shard = hf_to_tower(
            hf, vspec.depth, vspec.num_heads, prefix="model.visual.", tp_rank=vpg.tp.rank(), tp=vpg.tp.size()
        )
        tower.load_state_dict(shard, strict=False)
        with torch.no_grad():
            images = tower(patches, grid)
    vranks = layout.module("vision").ranks
    dist.broadcast(images, src=vranks.start if vranks is not None else 0)
    res: dict = {}
    if topo.modules["language"].member:
        lpg = topo.pg_collection("language")
        language = build_language(tspec, layout.module("language"), lpg, S)
        whole = language_from_hf(hf.__getitem__, tspec)
        tp, r = lpg.tp.size(), lpg.tp.rank()
        off = language.decoder.layers[0].layer_number - 1  # this pipeline stage's first layer
        with torch.no_grad():
            for name, p in language.named_parameters():
                full = whole[
                    re.sub(r"^decoder\.layers\.(\d+)\.", lambda mt: f"decoder.layers.{int(mt.group(1)) + off}.", name)
                ]
                dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
                p.copy_(full if dim < 0 else _glu(full, tp, r) if "linear_fc1" in name else full.chunk(tp, dim=dim)[r])
        lm = QwenVLLanguage(language, IMAGE, START, vspec.spatial_merge_size).eval()
        labels = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
        keep = labels != IMAGE  # transformers: a label -100 where the next token is an image token
        keep[:, -1] = False
        with torch.no_grad():
            logits = _stages(lm, lpg, tokens, images, grid)
            per_token = _stages(lm, lpg, tokens, images, grid, labels)
        if lpg.pp.rank() != lpg.pp.size() - 1:
            topo.destroy()
            return {}
        if tp > 1:  # vocab-parallel output layer: gather the columns
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=lpg.tp)
            logits = torch.cat(parts, dim=-1)
        loss_sum = (per_token * keep[:, _positions(lpg)]).sum()
        if lpg.cp.size() > 1:  # this rank's chunks: the whole sequence's logits and loss from all
            parts = [torch.empty_like(logits) for _ in range(lpg.cp.size())]
            dist.all_gather(parts, logits.contiguous(), group=lpg.cp)
            whole = torch.empty(logits.shape[0], S, logits.shape[2])
            for c, part in enumerate(parts):
                whole[:, _positions(lpg, c)] = part
            logits = whole
            dist.all_reduce(loss_sum, group=lpg.cp)
        res = {
            "logits": logits,
            "loss": loss_sum / keep.sum(),
            "position_ids": lm.position_ids(tokens, grid),
        }
        if topo.modules["vision"].member and lpg.pp.size() == 1:  # both modules here: the gradients
            tower.train(), lm.train()
            per_token = lm(tokens, tower(patches, grid), grid, labels=labels)
            ((per_token * keep).sum() / keep.sum()).backward()
            res["grads"] = {
                "vision": {k: p.grad.clone() for k, p in tower.named_parameters()},
                "language": {k: p.grad.clone() for k, p in language.named_parameters()},
                "dims": {
                    k: p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
                    for k, p in language.named_parameters()
                },
            }
    topo.destroy()
    return res


def reference_grads(cfg: dict, hf: dict) -> dict:
    """transformers' gradients of its loss on `batch()` (labels -100 at image tokens), by in-memory name."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg, attn_implementation="eager"))
    model.load_state_dict(hf)
    tokens, patches, grid = batch()
    labels = tokens.masked_fill(tokens == IMAGE, -100)
    model(input_ids=tokens, pixel_values=patches, image_grid_thw=grid, labels=labels).loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def whole_grads(per_rank: list[dict]) -> dict:
    """The TP ranks' gradient shards (rank order) put together: the tower's as `tower_to_hf` reads them
    (a list of shards), the language model's whole (column/row pieces joined, SwiGLU halves apart)."""
    dims = per_rank[0]["dims"]
    language = {}
    for k, dim in dims.items():
        parts = [r["language"][k] for r in per_rank]
        if dim < 0:
            language[k] = parts[0]
        elif "linear_fc1" in k:
            halves = [p.chunk(2, dim=0) for p in parts]
            language[k] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            language[k] = torch.cat(parts, dim=dim)
    return {"vision": [r["vision"] for r in per_rank], "language": language}


def grads_as_hf(grads: dict, cfg: dict) -> dict:
    """Our modules' gradients (`whole_grads`) under transformers' in-memory names."""
    from megatron_hetero.convert.hf_qwen_vision import tower_to_hf
    from megatron_hetero.models.hf_names import language_to_hf
    from megatron_hetero.models.qwen_vision import QwenVisionSpec
    from megatron_hetero.models.qwen_vl import QwenTextSpec

    vspec, tspec = QwenVisionSpec.from_hf(cfg["vision_config"]), QwenTextSpec.from_hf(cfg["text_config"])
    out = tower_to_hf(grads["vision"], vspec.depth, vspec.num_heads, prefix="model.visual.")
    lang = language_to_hf({"gpt." + k: v for k, v in grads["language"].items()}, tspec.names_view())
    out.update({("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in lang.items()})
    return out


def _positions(lpg, rank=None) -> torch.Tensor:
    """The sequence positions CP rank `rank` (default: this one) of the language module holds."""
    from megatron_hetero.models.cp_attention import cp_chunk_positions

    return cp_chunk_positions(S, lpg.cp.rank() if rank is None else rank, lpg.cp.size())


def _stages(lm, lpg, tokens, images, grid, labels=None):
    """This rank's pipeline stage of `lm`: the hidden states [s, b, h] come from the previous stage's
    rank and go to the next one's by point-to-point (what Megatron's schedules would hand over)."""
    import torch.distributed as dist

    ranks, r = dist.get_process_group_ranks(lpg.pp), lpg.pp.rank()
    hidden = None
    if r > 0:
        hidden = torch.empty(S // lpg.cp.size(), tokens.shape[0], lm.language.config.hidden_size)
        dist.recv(hidden, src=ranks[r - 1])
    out = lm(tokens, images, grid, labels=labels, hidden=hidden)
    if r < len(ranks) - 1:
        dist.send(out.contiguous(), dst=ranks[r + 1])
    return out


def _glu(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp, dim=0)[r], up.chunk(tp, dim=0)[r]])
