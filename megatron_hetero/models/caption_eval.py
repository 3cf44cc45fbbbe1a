"""Held-out caption accuracy for the digits data: does the model's greedy caption name the right digit?

`greedy_captions(logits, loss_mask, tok)`: for each sample, the argmax token at every CAPTION position
(the positions whose `loss_mask` is 1, i.e. whose label is a caption token or the caption's EOS, as
`energon_data.text_sample` builds them), cut at the first EOS, decoded. This is teacher-forced greedy
decoding: position k's prediction is conditioned on the reference caption before k, which is what
one forward pass of the training graph gives; it agrees with free-running greedy generation up to
the first wrong token, and the digit word is what is scored.

`greedy_digit_accuracy(...)`: the fraction of samples whose greedy caption names exactly one digit
and it is the right one (`digits.digit_of_caption`). Pure functions of tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_hetero.data.digits import digit_of_caption
from megatron_hetero.data.tokenizer import CaptionTokenizer


def greedy_captions(logits: torch.Tensor, loss_mask: torch.Tensor, tok: CaptionTokenizer) -> list[str]:
    """logits [N, S, V] (or [N, S] already-chosen ids), loss_mask [N, S] -> N decoded captions."""
    if logits.shape[:2] != loss_mask.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and loss_mask {tuple(loss_mask.shape)} disagree on [N, S]")
    ids = logits.argmax(-1) if logits.dim() == 3 else logits
    out = []
    for row, mask in zip(ids.tolist(), loss_mask.bool().tolist()):
        picked = [t for t, m in zip(row, mask) if m]
        if tok.eos_id in picked:
            picked = picked[: picked.index(tok.eos_id)]
        out.append(tok.decode(picked))
    return out


def digit_accuracy(captions: Sequence[str], digits: Sequence[int]) -> float:
    """Fraction of `captions` that name exactly the digit in `digits` (same length, > 0)."""
    if len(captions) != len(digits) or not captions:
        raise ValueError(f"{len(captions)} captions for {len(digits)} digits")
    return sum(digit_of_caption(c) == int(d) for c, d in zip(captions, digits)) / len(captions)


def greedy_digit_accuracy(
    logits: torch.Tensor, loss_mask: torch.Tensor, tok: CaptionTokenizer, digits: Sequence[int]
) -> float:
    """`digit_accuracy(greedy_captions(logits, loss_mask, tok), digits)`; the held-out digits come
    from the reference captions: `[digit_of_caption(c) for c in heldout_batch(...)["captions"]]`."""
    return digit_accuracy(greedy_captions(logits, loss_mask, tok), digits)


def digit_hits(ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, tok: CaptionTokenizer) -> int:
    """How many rows of `ids` (greedy token ids [N, S], or logits [N, S, V]) caption the digit their
    reference caption names (the reference: `labels` [N, S] at the same `loss_mask` positions, cut at
    EOS). A row whose reference names no digit never counts. With the references' digits this is
    `greedy_digit_accuracy(...) * N`."""
    preds = greedy_captions(ids, loss_mask, tok)
    refs = greedy_captions(labels, loss_mask, tok)
    hits = 0
    for p, r in zip(preds, refs):
        d = digit_of_caption(r)
        hits += d is not None and digit_of_caption(p) == d
    return hits
