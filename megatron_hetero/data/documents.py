"""Synthetic EOD-separated documents, packed several to a sequence or one per sequence: the data of
sequence packing (`LlavaSpec.documents`, `pack_documents`).

Document j (deterministic in (seed, j)) has L_j tokens, L_j drawn from [D // 2, D] with D =
seq_length // P (P = `documents`): a random first token, the same affine bigram rule as
`data.samples` (ids 1..V-2), and the EOD token (id V-1) last. Each variable encoder (`max_tiles` K
>= 1) gives it n_j tiles (0..K) whose n_j*T placeholders start at the document's own position
`offset`. All lengths and tile counts are drawn before any feature, so `document_tiles` and
`document_loss_tokens` read no feature.

Row i of the packed data (`pack_documents`) is documents [i*P, (i+1)*P) one after the other; row i
of the unpacked data is document i alone. Rows are padded with EOD to seq_length + 1 and cut into
`tokens` and `labels` (the next token) as in `data.samples`. The loss mask is Megatron's with
--eod-mask-loss: a label counts unless its input token is EOD (so no label crosses from one document
into the next, and padding never counts) or it is an image placeholder. The packed run of G rows and
the unpacked run of G*P rows therefore train on the same documents and the same loss tokens;
with Megatron's --reset-attention-mask and --reset-position-ids on the packed run, every token
sees exactly what it sees unpacked.
"""

from __future__ import annotations

import torch

from megatron_hetero.data.samples import PLACEHOLDER_ID, DataConfig, variable_encoders


def eod_id(cfg: DataConfig) -> int:
    """The EOD token: the vocabulary's last id."""
    return cfg.vocab_size - 1


def validate_documents(cfg: DataConfig) -> None:
    """ValueError unless every document's shortest length holds each variable encoder's longest
    placeholder run, and every encoder is variable (a document has its own tile count)."""
    if cfg.documents < 1 or cfg.seq_length // cfg.documents < 4:
        raise ValueError(f"{cfg.documents} documents per sequence of {cfg.seq_length}: each needs at least 4 tokens")
    if cfg.vocab_size < 3:
        raise ValueError(f"documents need a vocabulary of at least 3 ids (text, EOD), got {cfg.vocab_size}")
    shortest = (cfg.seq_length // cfg.documents) // 2
    for n, e in cfg.encoders.items():
        if not e.max_tiles:
            raise ValueError(f"encoder {n}: documents carry a tile count each; give it --encoder-max-tiles")
        if e.offset < 1 or e.offset + e.span > shortest - 1:
            raise ValueError(
                f"encoder {n}: its placeholders [{e.offset}, {e.offset + e.span}) must lie inside the "
                f"shortest document's text [1, {shortest - 1})"
            )


def _head(cfg: DataConfig, j: int) -> tuple[torch.Generator, int, int, dict[str, int]]:
    """(generator, length, first token, tiles per variable encoder) of document j."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + j)
    d = cfg.seq_length // cfg.documents
    length = int(torch.randint(d // 2, d + 1, (1,), generator=g))
    first = int(torch.randint(1, cfg.vocab_size - 1, (1,), generator=g))
    tiles = {n: int(torch.randint(0, cfg.encoders[n].max_tiles + 1, (1,), generator=g)) for n in variable_encoders(cfg)}
    return g, length, first, tiles


def document(cfg: DataConfig, j: int) -> dict:
    """Document j: `tokens` [L] (EOD last, placeholders in), `placeholder` [L] bool per encoder,
    `features` per encoder [n, T, F], `tiles` per encoder."""
    g, length, first, tiles = _head(cfg, j)
    tokens = torch.empty(length, dtype=torch.long)
    tokens[0] = first
    for k in range(length - 2):
        tokens[k + 1] = (int(tokens[k]) * 7 + 3) % (cfg.vocab_size - 2) + 1
    tokens[-1] = eod_id(cfg)
    placeholder, features = {}, {}
    for n in sorted(tiles):
        e = cfg.encoders[n]
        placeholder[n] = torch.zeros(length, dtype=torch.bool)
        placeholder[n][e.offset : e.offset + tiles[n] * e.tokens] = True
        tokens[placeholder[n]] = PLACEHOLDER_ID
        features[n] = torch.randn(tiles[n], e.tokens, e.feature_dim, generator=g)
    return {"tokens": tokens, "placeholder": placeholder, "features": features, "tiles": tiles}


def row_documents(cfg: DataConfig, i: int) -> range:
    """The documents of row i."""
    per = cfg.documents if cfg.pack_documents else 1
    return range(i * per, (i + 1) * per)


def document_rows(cfg: DataConfig, start: int, count: int) -> list[dict]:
    """Rows [start, start+count) as `data.samples.sample` dicts (tokens, labels, loss_mask, features,
    tiles, image_mask)."""
    eod, n = eod_id(cfg), cfg.seq_length + 1
    out = []
    for i in range(start, start + count):
        docs = [document(cfg, j) for j in row_documents(cfg, i)]
        row = torch.full((n,), eod, dtype=torch.long)
        is_image = {name: torch.zeros(n, dtype=torch.bool) for name in variable_encoders(cfg)}
        at = 0
        for d in docs:
            row[at : at + len(d["tokens"])] = d["tokens"]
            for name, m in d["placeholder"].items():
                is_image[name][at : at + len(m)] = m
            at += len(d["tokens"])
        tokens, labels = row[:-1].clone(), row[1:].clone()
        any_image = torch.zeros(n, dtype=torch.bool)
        for m in is_image.values():
            any_image |= m
        loss_mask = ((tokens != eod) & ~any_image[1:]).float()
        out.append(
            {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": loss_mask,
                "features": {name: torch.cat([d["features"][name] for d in docs]) for name in is_image},
                "tiles": {name: sum(d["tiles"][name] for d in docs) for name in is_image},
                "image_mask": {name: m[:-1].clone() for name, m in is_image.items()},
            }
        )
    return out


def document_tiles(cfg: DataConfig, start: int, count: int) -> dict[str, list[int]]:
    """Tiles per row of rows [start, start+count), from the documents' heads only."""
    heads = [[_head(cfg, j)[3] for j in row_documents(cfg, i)] for i in range(start, start + count)]
    return {n: [sum(h[n] for h in row) for row in heads] for n in variable_encoders(cfg)}


def document_loss_tokens(cfg: DataConfig, start: int, count: int) -> int:
    """Loss tokens of rows [start, start+count): per document L - 1 labels (its inputs before EOD)
    less its placeholders (all of them labels: they start at position >= 1)."""
    total = 0
    for i in range(start, start + count):
        for j in row_documents(cfg, i):
            _, length, _, tiles = _head(cfg, j)
            total += length - 1 - sum(t * cfg.encoders[n].tokens for n, t in tiles.items())
    return total
