"""Synthetic LLaVA-style data, deterministic per global sample index.

Every rank materialises exactly the samples it needs, by global index, so all layouts see the same
data: step t covers global samples [t*G, (t+1)*G) of a global batch G; a module's DP rank d owns the
contiguous samples [d*G/dp, (d+1)*G/dp) of the step (the boundary plans use the same rule), and the
language model splits its share into micro-batches in order.

A sample: `tokens` [S] (text; each encoder's placeholder span holds `PLACEHOLDER_ID`), `labels` [S]
(next token), `loss_mask` [S] (0 where the label is a placeholder or past the end), and for each
encoder `features[name]` [tokens, feature_dim] (e.g. image patch features).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PLACEHOLDER_ID = 0


@dataclass(frozen=True)
class EncoderInput:
    """One encoder's input: `tokens` feature vectors of size `feature_dim`, placed at text positions
    [offset, offset + tokens)."""

    tokens: int
    feature_dim: int
    offset: int


@dataclass(frozen=True)
class DataConfig:
    seq_length: int
    vocab_size: int
    encoders: dict[str, EncoderInput] = field(default_factory=dict)
    seed: int = 1234

    def validate(self) -> None:
        spans = sorted((e.offset, e.offset + e.tokens, n) for n, e in self.encoders.items())
        for n, e in self.encoders.items():
            if e.tokens < 1 or e.feature_dim < 1 or e.offset < 0:
                raise ValueError(f"encoder {n}: tokens, feature_dim must be >= 1 and offset >= 0, got {e}")
            if e.offset + e.tokens > self.seq_length:
                raise ValueError(
                    f"encoder {n}: placeholder span [{e.offset}, {e.offset + e.tokens}) does not fit "
                    f"in --seq-length {self.seq_length}"
                )
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"encoders {an} [{a0}, {a1}) and {bn} [{b0}, {b1}) have overlapping placeholder spans")
        if self.vocab_size < 2:
            raise ValueError(f"vocab size must be >= 2, got {self.vocab_size}")


def sample(cfg: DataConfig, index: int) -> dict:
    """Global sample `index` (deterministic in (seed, index), independent of any layout)."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
    # A learnable text: a random first token, then a fixed affine bigram rule (so the loss falls).
    tokens = torch.empty(cfg.seq_length + 1, dtype=torch.long)
    tokens[0] = int(torch.randint(1, cfg.vocab_size, (1,), generator=g))
    for k in range(cfg.seq_length):
        tokens[k + 1] = (int(tokens[k]) * 7 + 3) % (cfg.vocab_size - 1) + 1
    placeholder = torch.zeros(cfg.seq_length + 1, dtype=torch.bool)
    features = {}
    for name in sorted(cfg.encoders):
        e = cfg.encoders[name]
        placeholder[e.offset : e.offset + e.tokens] = True
        features[name] = torch.randn(e.tokens, e.feature_dim, generator=g)
    tokens[placeholder] = PLACEHOLDER_ID
    loss_mask = (~placeholder[1:]).float()
    return {"tokens": tokens[:-1].clone(), "labels": tokens[1:].clone(), "loss_mask": loss_mask, "features": features}


def batch(cfg: DataConfig, start: int, count: int) -> dict:
    """Samples [start, start+count) stacked on a leading batch dimension."""
    items = [sample(cfg, i) for i in range(start, start + count)]
    return {
        "tokens": torch.stack([s["tokens"] for s in items]),
        "labels": torch.stack([s["labels"] for s in items]),
        "loss_mask": torch.stack([s["loss_mask"] for s in items]),
        "features": {n: torch.stack([s["features"][n] for s in items]) for n in cfg.encoders},
    }


def loss_tokens_per_sample(cfg: DataConfig) -> int:
    """Loss tokens of every sample (the placeholder spans are the same for all samples), so a step's
    per-token loss normaliser is global_batch * this."""
    return int(sample(cfg, 0)["loss_mask"].sum().item())
