"""Held-out accuracy PER MODALITY on the spoken-digits conversations (`data.digits_speech`): is
the digit SHOWN (the image) right, is the digit SAID (the clip) right?

Teacher-forced, as `models.chat_eval.answer_hits`: the answers are the runs of `loss_mask`, the
prediction at a position is the argmax. Which question an answer belongs to is read from the labels
before it (the labels hold the conversation's text shifted by one; placeholders and turn markers
are skipped when decoding):

  * "What digit is shown, and which digit was said?" -> "seven and three": the tokens of "seven" count
    for `digit shown`, the tokens after "seven and" (" three") for `digit said`;
  * "Which digit was said?" -> "three": the answer's tokens count for `digit said`.

Other answers (odd/even, arithmetic) count for neither. A part is a hit when every one of its tokens
is predicted. Pure functions of tensors and a `tokenizers.Tokenizer`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from megatron_hetero.models.chat_eval import answer_runs

SHOWN, SAID = "digit shown", "digit said"
PARTS = (SHOWN, SAID)
_BOTH = "what digit is shown, and which digit was said?"
_SAID = "which digit was said?"


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return str(tokenizer.decode([int(t) for t in ids if 0 <= int(t) < size], skip_special_tokens=True))


def _prefix(tokenizer: Any, ids: Sequence[int], text: str) -> int:
    """The fewest leading `ids` that decode to `text` (stripped); -1 when none do."""
    for k in range(1, len(ids) + 1):
        if _decode(tokenizer, ids[:k]).strip() == text:
            return k
    return -1


def modality_hits(
    ids: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    tokenizer: Any,
    end_ids: Sequence[int] = (),
) -> dict[str, tuple[int, int]]:
    """{"digit shown": (hits, answers), "digit said": (hits, answers)} of greedy ids [N, S] (or logits
    [N, S, V]) against `labels` [N, S] at the answers of `loss_mask` [N, S] (module docstring).
    `tokenizer`: the conversations' tokenizer (with their markers: `chat_tokens.marker_tokenizer`)."""
    if ids.dim() == 3:
        ids = ids.argmax(-1)
    if ids.shape != labels.shape or labels.shape != loss_mask.shape:
        raise ValueError(
            f"ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} "
            "must all be [N, S]"
        )
    end = [int(t) for t in end_ids]
    counts = {p: [0, 0] for p in PARTS}
    for row_ids, row_labels, runs in zip(ids.tolist(), labels.tolist(), answer_runs(loss_mask)):
        before = 0
        for start, stop in runs:
            question = _decode(tokenizer, row_labels[before:start]).lower()
            before = stop
            if end and stop - start > len(end) and row_labels[stop - len(end) : stop] == end:
                stop -= len(end)
            want, got = row_labels[start:stop], row_ids[start:stop]
            if _BOTH in question:
                words = _decode(tokenizer, want).strip().split(" and ")
                shown = _prefix(tokenizer, want, words[0])
                said = _prefix(tokenizer, want, f"{words[0]} and")
                counts[SHOWN][1] += 1
                counts[SAID][1] += 1
                if shown > 0 and said > 0:
                    counts[SHOWN][0] += got[:shown] == want[:shown]
                    counts[SAID][0] += got[said:] == want[said:]
            elif _SAID in question:
                counts[SAID][1] += 1
                counts[SAID][0] += got == want
    return {p: (h, n) for p, (h, n) in counts.items()}
