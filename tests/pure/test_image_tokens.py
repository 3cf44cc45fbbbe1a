"""Variable image tokens: the synthetic data's tiles and loss tokens, the edge tensor's packing and
the language model's placement by image mask, each against a plain per-row loop."""

from __future__ import annotations

import pytest
import torch

from megatron_hetero.data import samples as data_mod
from megatron_hetero.data import synthetic
from megatron_hetero.models.image_tokens import edge_seq, pack_tiles, place_by_mask

CFG = data_mod.DataConfig(
    seq_length=32,
    vocab_size=50,
    encoders={
        "vision": data_mod.EncoderInput(tokens=4, feature_dim=6, offset=1, max_tiles=3),
        "audio": data_mod.EncoderInput(tokens=2, feature_dim=5, offset=14),
    },
)


def test_tiles_masks_and_loss_tokens_agree_sample_by_sample():
    b = data_mod.batch(CFG, 10, 12)
    tiles = b["tiles"]["vision"].tolist()
    assert data_mod.image_tiles(CFG, 10, 12) == {"vision": tiles}  # no feature drawn for these
    assert set(tiles) == {0, 1, 2, 3}  # text-only rows and every tile count occur
    assert b["features"]["vision"].shape == (sum(tiles), 4, 6)
    assert b["features"]["audio"].shape == (12, 2, 5)  # a fixed encoder beside it is unchanged
    for r, n in enumerate(tiles):
        where = torch.nonzero(b["image_mask"]["vision"][r]).flatten().tolist()
        assert where == list(range(1, 1 + 4 * n))
        assert (b["tokens"][r, where] == data_mod.PLACEHOLDER_ID).all()
        s = data_mod.sample(CFG, 10 + r)
        assert torch.equal(b["features"]["vision"][sum(tiles[:r]) : sum(tiles[: r + 1])], s["features"]["vision"])
    assert data_mod.loss_tokens(CFG, 10, 12) == int(b["loss_mask"].sum())
    with pytest.raises(ValueError, match="differ per sample"):
        data_mod.loss_tokens_per_sample(CFG)


def test_reserved_spans_are_validated():
    bad = data_mod.DataConfig(seq_length=12, vocab_size=50, encoders={"vision": data_mod.EncoderInput(4, 6, 1, 3)})
    with pytest.raises(ValueError, match=r"\[1, 13\) does not fit"):
        bad.validate()


def test_edge_seq_rounds_to_the_chunking_and_is_never_empty():
    assert edge_seq([0, 3, 1], 4, 1) == 12
    assert edge_seq([0, 3, 1], 4, 8) == 16
    assert edge_seq([0, 0], 4, 4) == 4


def test_pack_then_place_puts_each_row_tokens_at_its_placeholders():
    g = torch.Generator().manual_seed(0)
    tiles, t, h, s = [2, 0, 1, 3], 3, 5, 16
    y = torch.randn(sum(tiles), t, h, generator=g, requires_grad=True)
    packed = pack_tiles(y, tiles, seq=12)
    assert packed.shape == (4, 12, h)
    mask = torch.zeros(4, s, dtype=torch.bool)
    starts = [2, 0, 7, 1]
    for r, (n, a) in enumerate(zip(tiles, starts)):
        mask[r, a : a + n * t] = True
    emb = torch.randn(s, 4, h, generator=g)
    out = place_by_mask(emb, packed, mask, "test")
    expect = emb.clone()
    first = 0
    for r, (n, a) in enumerate(zip(tiles, starts)):
        row = y[first : first + n].reshape(n * t, h)
        expect[a : a + n * t, r] = row
        assert (packed[r, n * t :] == 0).all()
        first += n
    assert torch.equal(out, expect.detach())
    out.sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y))  # every image token used once, padding never


def test_mismatched_tiles_are_input_errors():
    y = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="returned 3 tiles"):
        pack_tiles(y, [1, 1], seq=8)
    with pytest.raises(ValueError, match="do not fit"):
        pack_tiles(y, [3], seq=4)
    with pytest.raises(ValueError, match="image masks of"):
        place_by_mask(torch.zeros(8, 1, 4), torch.zeros(1, 2, 4), torch.ones(1, 8, dtype=torch.bool), "edge x")


def test_a_packed_row_is_its_documents_one_after_the_other():
    import dataclasses

    from megatron_hetero.data.documents import document, eod_id

    cfg = data_mod.DataConfig(
        seq_length=64,
        vocab_size=50,
        encoders={"vision": data_mod.EncoderInput(tokens=2, feature_dim=6, offset=1, max_tiles=2)},
        documents=4,
    )
    synthetic.validate(cfg)
    packed = synthetic.batch(cfg, 1, 2)
    unpacked = synthetic.batch(dataclasses.replace(cfg, pack_documents=False), 4, 8)
    for r in range(2):
        docs = [document(cfg, j)["tokens"] for j in range(4 * (1 + r), 4 * (2 + r))]
        joined = torch.cat(docs)
        assert torch.equal(packed["tokens"][r, : len(joined)], joined)
        assert (packed["tokens"][r, len(joined) :] == eod_id(cfg)).all()
        assert packed["loss_mask"][r].sum() == unpacked["loss_mask"][4 * r : 4 * r + 4].sum()
        assert packed["tiles"]["vision"][r] == unpacked["tiles"]["vision"][4 * r : 4 * r + 4].sum()
    assert torch.equal(packed["features"]["vision"], unpacked["features"]["vision"])  # the same tiles, in order
    assert synthetic.loss_tokens(cfg, 1, 2) == int(packed["loss_mask"].sum())
    assert synthetic.image_tiles(cfg, 1, 2) == {"vision": packed["tiles"]["vision"].tolist()}
    with pytest.raises(ValueError, match="give it --encoder-max-tiles"):
        synthetic.validate(dataclasses.replace(cfg, encoders={"vision": data_mod.EncoderInput(2, 6, 1)}))
