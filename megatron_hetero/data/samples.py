"""Synthetic LLaVA-style data, deterministic per global sample index.

Every rank materialises exactly the samples it needs, by global index, so all layouts see the same
data: step t covers global samples [t*G, (t+1)*G) of a global batch G; a module's DP rank d owns the
contiguous samples [d*G/dp, (d+1)*G/dp) of the step (the boundary plans use the same rule), and the
language model splits its share into micro-batches in order.

A sample: `tokens` [S] (text; each encoder's placeholder span holds `PLACEHOLDER_ID`), `labels` [S]
(next token), `loss_mask` [S] (0 where the label is a placeholder or past the end), and for each
encoder `features[name]` [tokens, feature_dim] (e.g. image patch features).

Variable image tokens (an encoder with `max_tiles` K >= 1, `--encoder-max-tiles`): sample i carries
n_i tiles of `tokens` tokens each, n_i drawn uniformly from 0..K (0: a text-only sample), all tile
counts drawn before any feature so that `image_tiles` reads them without drawing features. Its
placeholders are the n_i*tokens positions from `offset` (the rest of the encoder's reserved span
[offset, offset + K*tokens) is text), `features[name]` is [n_i, tokens, feature_dim], `tiles[name]`
is n_i and `image_mask[name]` [S] marks its placeholders. A batch concatenates the rows' tiles along
the first dimension ([sum n_i, tokens, feature_dim], row by row) and stacks `tiles` [rows] and
`image_mask` [rows, S]; the language model puts the encoder's tokens where the mask is set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PLACEHOLDER_ID = 0


@dataclass(frozen=True)
class EncoderInput:
    """One encoder's input: `tokens` feature vectors of size `feature_dim`, placed at text positions
    [offset, offset + tokens); with `max_tiles` K >= 1, 0..K tiles of `tokens` vectors each, placed
    from `offset` (module docstring)."""

    tokens: int
    feature_dim: int
    offset: int
    max_tiles: int = 0

    @property
    def span(self) -> int:
        """Text positions reserved for this encoder's placeholders."""
        return self.tokens * max(1, self.max_tiles)


@dataclass(frozen=True)
class DataConfig:
    seq_length: int
    vocab_size: int
    encoders: dict[str, EncoderInput] = field(default_factory=dict)
    seed: int = 1234
    documents: int = 0  # >= 1: EOD-separated documents (`data.documents`)
    pack_documents: bool = True

    def validate(self) -> None:
        if self.documents:  # EOD-separated documents: `data.synthetic.validate` checks them
            return
        spans = sorted((e.offset, e.offset + e.span, n) for n, e in self.encoders.items())
        for n, e in self.encoders.items():
            if e.tokens < 1 or e.feature_dim < 1 or e.offset < 0 or e.max_tiles < 0:
                raise ValueError(f"encoder {n}: tokens, feature_dim must be >= 1, offset, max_tiles >= 0, got {e}")
            if e.offset + e.span > self.seq_length:
                raise ValueError(
                    f"encoder {n}: placeholder span [{e.offset}, {e.offset + e.span}) does not fit "
                    f"in --seq-length {self.seq_length}"
                )
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"encoders {an} [{a0}, {a1}) and {bn} [{b0}, {b1}) have overlapping placeholder spans")
        if self.vocab_size < 2:
            raise ValueError(f"vocab size must be >= 2, got {self.vocab_size}")


def variable_encoders(cfg: DataConfig) -> list[str]:
    """The encoders with variable image tokens (`max_tiles` >= 1), sorted."""
    return sorted(n for n, e in cfg.encoders.items() if e.max_tiles)


def _start(cfg: DataConfig, index: int) -> tuple[torch.Generator, int, dict[str, int]]:
    """(generator, first token, tiles per variable encoder) of sample `index`: the draws that come
    before any feature."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    first = int(torch.randint(1, cfg.vocab_size, (1,), generator=g))
    tiles = {n: int(torch.randint(0, cfg.encoders[n].max_tiles + 1, (1,), generator=g)) for n in variable_encoders(cfg)}
    return g, first, tiles


def sample(cfg: DataConfig, index: int) -> dict:
    """Global sample `index` (deterministic in (seed, index), independent of any layout)."""
    g, first, tiles = _start(cfg, index)
    # A learnable text: a random first token, then a fixed affine bigram rule (so the loss falls).
    tokens = torch.empty(cfg.seq_length + 1, dtype=torch.long)
    tokens[0] = first
    for k in range(cfg.seq_length):
        tokens[k + 1] = (int(tokens[k]) * 7 + 3) % (cfg.vocab_size - 1) + 1
    placeholder = torch.zeros(cfg.seq_length + 1, dtype=torch.bool)
    features, image_mask = {}, {}
    for name in sorted(cfg.encoders):
        e = cfg.encoders[name]
        if name in tiles:
            n = tiles[name]
            placeholder[e.offset : e.offset + n * e.tokens] = True
            features[name] = torch.randn(n, e.tokens, e.feature_dim, generator=g)
            image_mask[name] = torch.zeros(cfg.seq_length, dtype=torch.bool)
            image_mask[name][e.offset : e.offset + n * e.tokens] = True
            continue
        placeholder[e.offset : e.offset + e.tokens] = True
        features[name] = torch.randn(e.tokens, e.feature_dim, generator=g)
    tokens[placeholder] = PLACEHOLDER_ID
    loss_mask = (~placeholder[1:]).float()
    out = {"tokens": tokens[:-1].clone(), "labels": tokens[1:].clone(), "loss_mask": loss_mask, "features": features}
    if tiles:
        out["tiles"], out["image_mask"] = tiles, image_mask
    return out


def batch(cfg: DataConfig, start: int, count: int) -> dict:
    """Samples [start, start+count) stacked on a leading batch dimension (a variable encoder's tiles
    concatenated: module docstring)."""
    return stack(cfg, [sample(cfg, i) for i in range(start, start + count)])


def stack(cfg: DataConfig, items: list[dict]) -> dict:
    """Rows (`sample` dicts) stacked on a leading batch dimension, a variable encoder's tiles
    concatenated (module docstring)."""
    var = variable_encoders(cfg)
    out = {
        "tokens": torch.stack([s["tokens"] for s in items]),
        "labels": torch.stack([s["labels"] for s in items]),
        "loss_mask": torch.stack([s["loss_mask"] for s in items]),
        "features": {
            n: torch.cat([s["features"][n] for s in items])
            if n in var
            else torch.stack([s["features"][n] for s in items])
            for n in cfg.encoders
        },
    }
    if var:
        out["tiles"] = {n: torch.tensor([s["tiles"][n] for s in items], dtype=torch.long) for n in var}
        out["image_mask"] = {n: torch.stack([s["image_mask"][n] for s in items]) for n in var}
    return out


def image_tiles(cfg: DataConfig, start: int, count: int) -> dict[str, list[int]]:
    """Tiles per sample of samples [start, start+count) for each variable encoder, without drawing
    any feature or text (what every rank reads to size a boundary message)."""
    rows = [_start(cfg, i)[2] for i in range(start, start + count)]
    return {n: [r[n] for r in rows] for n in variable_encoders(cfg)}


def loss_tokens_per_sample(cfg: DataConfig) -> int:
    """Loss tokens of every sample (the placeholder spans are the same for all samples), so a step's
    per-token loss normaliser is global_batch * this. ValueError with variable image tokens (the
    count differs per sample: `loss_tokens`)."""
    if variable_encoders(cfg):
        raise ValueError("variable image tokens: the loss tokens differ per sample; use loss_tokens")
    return int(sample(cfg, 0)["loss_mask"].sum().item())


def loss_tokens(cfg: DataConfig, start: int, count: int) -> int:
    """Loss tokens of samples [start, start+count): the labels that are not placeholders (label k is
    text position k+1), from the tile counts alone."""
    if not variable_encoders(cfg):
        return loss_tokens_per_sample(cfg) * count
    fixed = sum(len(range(max(e.offset, 1), e.offset + e.tokens)) for e in cfg.encoders.values() if not e.max_tiles)
    total = 0
    for n, tiles in image_tiles(cfg, start, count).items():
        e = cfg.encoders[n]
        total += sum(len(range(max(e.offset, 1), e.offset + t * e.tokens)) for t in tiles)
    return count * (cfg.seq_length - fixed) - total
