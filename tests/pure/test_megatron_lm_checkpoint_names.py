"""Which whole-model parameter a pipeline stage's parameter is when a layout run saves
(`megatron_lm/checkpoints.py` `_holdings`): the stage's local layer numbers shifted by the stage's
first layer (Megatron's `layer_number` - 1) and the segment's first layer; a MoE expert's local index
shifted by its EP rank's first expert."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_hetero.megatron_lm.checkpoints import _holdings


class _Layer(torch.nn.Module):
    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number  # Megatron's, 1-based in the module's own model
        self.weight = torch.nn.Parameter(torch.full((1,), float(layer_number)))


class _Decoder(torch.nn.Module):
    def __init__(self, first: int, count: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(first + i) for i in range(count))


class _Gpt(torch.nn.Module):
    def __init__(self, first: int, count: int, post: bool) -> None:
        super().__init__()
        self.decoder = _Decoder(first, count)
        if post:
            self.output_layer = torch.nn.Linear(1, 1, bias=False)


class _Llava(torch.nn.Module):
    def __init__(self, first: int, count: int, post: bool) -> None:
        super().__init__()
        self.language_model = _Gpt(first, count, post)


def test_a_vlm_language_stage_holds_its_global_layers():
    # language pp 2 over 4 decoder layers: the second stage's layers 0-1 are the model's 2-3
    held = _holdings({"language": SimpleNamespace(module=_Llava(3, 2, post=True), pgs=None)}, {"language": 0})
    assert sorted(held) == [
        "language_model.decoder.layers.2.weight",
        "language_model.decoder.layers.3.weight",
        "language_model.output_layer.weight",
    ]
    assert float(held["language_model.decoder.layers.3.weight"][0]) == 4.0  # local layer 1, layer_number 4


def test_a_gpt_segment_stage_adds_the_segment_start():
    # segment language_b = layers 4-7 at pp 2: its second stage's local layers 0-1 are the model's 6-7
    segs = {"language_a": SimpleNamespace(module=_Gpt(1, 4, post=False), pgs=None)}
    segs["language_b"] = SimpleNamespace(module=_Gpt(3, 2, post=True), pgs=None)
    held = _holdings(segs, {"language_a": 0, "language_b": 4})
    assert sorted(n for n in held if "layers" in n) == [f"decoder.layers.{i}.weight" for i in (0, 1, 2, 3, 6, 7)]
    p, state, gated = held["decoder.layers.6.weight"]
    assert state is segs["language_b"] and not gated and float(p[0]) == 3.0


class _Experts(torch.nn.Module):
    def __init__(self, count: int, tag: float) -> None:
        super().__init__()
        self.local_experts = torch.nn.ModuleList(_Expert(tag + k) for k in range(count))


class _Expert(torch.nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((1,), value))


class _MoeLayer(torch.nn.Module):
    def __init__(self, layer_number: int, local: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.config = SimpleNamespace(num_moe_experts=4)
        self.mlp = torch.nn.Module()
        self.mlp.experts = _Experts(local, 10.0 * layer_number)


class _MoeGpt(torch.nn.Module):
    def __init__(self, local: int) -> None:
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_MoeLayer(i + 1, local) for i in range(2))


def _ep(size: int, rank: int):
    group = SimpleNamespace(size=lambda: size, rank=lambda: rank)
    return SimpleNamespace(ep=group, tp=SimpleNamespace(size=lambda: 1, rank=lambda: 0), expt_tp=None)


def test_an_ep_rank_holds_its_global_experts():
    # 4 experts per layer at ep 2: EP rank 1's local experts 0-1 are the model's experts 2-3
    held = _holdings({"language": SimpleNamespace(module=_MoeGpt(2), pgs=_ep(2, 1))}, {"language": 0})
    assert sorted(held) == [f"decoder.layers.{i}.mlp.experts.local_experts.{k}.weight" for i in (0, 1) for k in (2, 3)]
    assert float(held["decoder.layers.1.mlp.experts.local_experts.3.weight"][0][0]) == 21.0  # layer 2, local 1
    held0 = _holdings({"language": SimpleNamespace(module=_MoeGpt(2), pgs=_ep(2, 0))}, {"language": 0})
    assert sorted(n.split("local_experts.")[1] for n in held0) == ["0.weight", "0.weight", "1.weight", "1.weight"]
    # ep 1: every expert, its own index
    whole = _holdings({"language": SimpleNamespace(module=_MoeGpt(4), pgs=_ep(1, 0))}, {"language": 0})
    assert len(whole) == 8 and "decoder.layers.0.mlp.experts.local_experts.3.weight" in whole
