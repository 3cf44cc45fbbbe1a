"""Which whole-model parameter a pipeline stage's parameter is when a layout run saves
(`megatron_lm/checkpoints.py` `_holdings`): the stage's local layer numbers shifted by the stage's
first layer (Megatron's `layer_number` - 1) and the segment's first layer."""

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
    held = _holdings({"language": SimpleNamespace(module=_Llava(3, 2, post=True))}, {"language": 0})
    assert sorted(held) == [
        "language_model.decoder.layers.2.weight",
        "language_model.decoder.layers.3.weight",
        "language_model.output_layer.weight",
    ]
    assert float(held["language_model.decoder.layers.3.weight"][0]) == 4.0  # local layer 1, layer_number 4


def test_a_gpt_segment_stage_adds_the_segment_start():
    # segment language_b = layers 4-7 at pp 2: its second stage's local layers 0-1 are the model's 6-7
    segs = {"language_a": SimpleNamespace(module=_Gpt(1, 4, post=False))}
    segs["language_b"] = SimpleNamespace(module=_Gpt(3, 2, post=True))
    held = _holdings(segs, {"language_a": 0, "language_b": 4})
    assert sorted(n for n in held if "layers" in n) == [f"decoder.layers.{i}.weight" for i in (0, 1, 2, 3, 6, 7)]
    p, state, gated = held["decoder.layers.6.weight"]
    assert state is segs["language_b"] and not gated and float(p[0]) == 3.0
