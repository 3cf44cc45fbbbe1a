"""Held-out ANSWER accuracy for conversation data: is every token of an assistant answer the argmax?

Teacher-forced, as the caption evaluation (`models.caption_eval`): one forward pass of the training
graph gives, at every position, the model's next-token prediction conditioned on the reference text
before it. An ANSWER is one maximal run of consecutive positions whose `loss_mask` is 1 (the labels
of one assistant turn: its content and the template's end-of-turn marker, `chat_tokens`); it counts
as correct when the prediction equals the label at every position of the run, except the closing
end-of-turn marker: when the run's labels end with `end_ids` (the marker's token ids, e.g. ChatML's
`<|im_end|>`) and the run is longer than that, those last positions are not scored; when they do not
(a template whose turns end otherwise, or an answer cut at the end of the sequence), the whole run is
scored. `question_hits` counts the same way per part: the answers to given questions (on the digits
conversations, the questions that read the images). Pure functions of tensors (and a tokenizer).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


def answer_runs(loss_mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of `loss_mask` [N, S], the [start, end) position ranges of its runs of 1s."""
    out = []
    for row in loss_mask.bool().tolist():
        runs, start = [], None
        for p, m in enumerate(row + [False]):
            if m and start is None:
                start = p
            elif not m and start is not None:
                runs.append((start, p))
                start = None
        out.append(runs)
    return out


def answer_hits(
    ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, end_ids: Sequence[int] = ()
) -> tuple[int, int]:
    """(correct answers, answers) of greedy ids [N, S] (or logits [N, S, V]) against `labels` [N, S]
    at the answers of `loss_mask` [N, S] (module docstring). ValueError when the shapes disagree."""
    if ids.dim() == 3:
        ids = ids.argmax(-1)
    if ids.shape != labels.shape or labels.shape != loss_mask.shape:
        raise ValueError(
            f"ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} "
            f"must all be [N, S]"
        )
    end = [int(t) for t in end_ids]
    hits = answers = 0
    for row_ids, row_labels, runs in zip(ids.tolist(), labels.tolist(), answer_runs(loss_mask)):
        for start, stop in runs:
            if end and stop - start > len(end) and row_labels[stop - len(end) : stop] == end:
                stop -= len(end)
            answers += 1
            hits += row_ids[start:stop] == row_labels[start:stop]
    return hits, answers


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """`ids` as text, ids outside the tokenizer's vocabulary (placeholders) and special tokens skipped."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return str(tokenizer.decode([int(t) for t in ids if 0 <= int(t) < size], skip_special_tokens=True))


def question_hits(
    ids: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    tokenizer: Any,
    questions: Mapping[str, str],
    end_ids: Sequence[int] = (),
) -> dict[str, tuple[int, int]]:
    """{part: (correct answers, answers)} for the answers to given questions: an answer counts for a
    part when the text since the previous answer (its question turn: the labels hold the conversation
    shifted by one, decoded by the conversations' `tokenizer` with their markers) holds the part's
    question, case-insensitively; scored as `answer_hits` (every token the argmax, a closing `end_ids`
    not scored). `questions`: {part: question text}. ValueError when the shapes disagree."""
    if ids.dim() == 3:
        ids = ids.argmax(-1)
    if ids.shape != labels.shape or labels.shape != loss_mask.shape:
        raise ValueError(
            f"ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} "
            f"must all be [N, S]"
        )
    end = [int(t) for t in end_ids]
    asked = {part: q.lower() for part, q in questions.items()}
    counts = {part: [0, 0] for part in questions}
    for row_ids, row_labels, runs in zip(ids.tolist(), labels.tolist(), answer_runs(loss_mask)):
        before = 0
        for start, stop in runs:
            turn = _decode(tokenizer, row_labels[before:start]).lower()
            before = stop
            if end and stop - start > len(end) and row_labels[stop - len(end) : stop] == end:
                stop -= len(end)
            for part, q in asked.items():
                if q in turn:
                    counts[part][1] += 1
                    counts[part][0] += row_ids[start:stop] == row_labels[start:stop]
    return {part: (h, n) for part, (h, n) in counts.items()}
