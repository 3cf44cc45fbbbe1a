"""The gated `linear_fc1` resharding of `megatron_lm/weights.py` (`--swiglu` with a layout).

Megatron's gated MLP holds `[gate_r; up_r]` on TP rank r (`MLP.forward`: silu of the first half of
the fc1 output times the second half). Resharding from one TP to another must keep each rank's gate
and up rows matched; a plain chunk of the concatenated tensor does not (TP1 -> TP2 would give rank 0
the whole gate and rank 1 the whole up projection).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_hetero.megatron_lm.weights import _join, _split

FFN, HIDDEN = 8, 6


def _gated_fc1() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(FFN, HIDDEN, generator=g), torch.randn(FFN, HIDDEN, generator=g)
    return gate, up, torch.cat([gate, up])  # the full tensor in Megatron's global layout


def _rank_activation(piece: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What one TP rank's gated MLP computes from its fc1 piece (before linear_fc2)."""
    a, b = torch.chunk(x @ piece.T, 2, dim=-1)
    return F.silu(a) * b


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_gets_its_gate_and_up_rows(tp):
    gate, up, full = _gated_fc1()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    want = F.silu(x @ gate.T) * (x @ up.T)
    pieces = [_split(full, 0, tp, r, gated=True) for r in range(tp)]
    got = torch.cat([_rank_activation(p, x) for p in pieces], dim=-1)  # ffn columns in rank order
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # matmul shapes differ: rounding only
    assert torch.equal(_join(pieces, 0, gated=True), full)


@pytest.mark.parametrize("a, b", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_tp_a_to_tp_b_equals_a_direct_split(a, b):
    _, _, full = _gated_fc1()
    from_a = _join([_split(full, 0, a, r, gated=True) for r in range(a)], 0, gated=True)
    assert all(torch.equal(_split(from_a, 0, b, r, True), _split(full, 0, b, r, True)) for r in range(b))


def test_a_plain_chunk_would_mix_gate_and_up():
    gate, up, full = _gated_fc1()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    wrong = torch.cat([_rank_activation(p, x) for p in full.chunk(2)], dim=-1)
    assert not torch.allclose(wrong, F.silu(x @ gate.T) * (x @ up.T), atol=1e-3)
    assert torch.equal(_split(full, 0, 2, 0, gated=False), gate)  # rank 0 would hold the whole gate
    assert not torch.equal(_split(full, 0, 2, 0, gated=True), gate)
    # non-gated tensors keep the plain chunk
    assert torch.equal(_join([full[:4], full[4:8], full[8:12], full[12:]], 0, gated=False), full)


def test_odd_gated_size_is_a_value_error():
    with pytest.raises(ValueError, match="odd size 5 along dim 0"):
        _split(torch.zeros(5, 2), 0, 1, 0, gated=True)
