"""Answer accuracy (`models/chat_eval.py`) on hand-made ids and logits."""

from __future__ import annotations

import pytest
import torch

from megatron_hetero.models.chat_eval import answer_hits, answer_runs, question_hits

END = [7, 8]  # a two-token end-of-turn marker


def test_runs_and_hits_on_hand_made_ids():
    labels = torch.tensor([[1, 5, 6, 7, 8, 2, 3, 9, 7, 8], [1, 4, 4, 4, 2, 2, 2, 2, 2, 6]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 1]])
    assert answer_runs(mask) == [[(1, 5), (7, 10)], [(1, 3), (9, 10)]]
    ids = labels.clone()
    assert answer_hits(ids, labels, mask, END) == (4, 4)
    ids[0, 3] = 0  # wrong inside the end-of-turn marker: not scored
    ids[0, 9] = 0
    assert answer_hits(ids, labels, mask, END) == (4, 4)
    assert answer_hits(ids, labels, mask) == (2, 4)  # without a marker, the whole run is scored
    ids[1, 2] = 0  # wrong inside an answer (no marker at its end: cut, scored whole)
    ids[0, 7] = 3
    assert answer_hits(ids, labels, mask, END) == (2, 4)
    ids[0, 6] = 0  # outside every answer: never scored
    assert answer_hits(ids, labels, mask, END) == (2, 4)


def test_logits_are_argmaxed_and_a_marker_alone_is_scored():
    labels = torch.tensor([[3, 7, 8, 0]])
    mask = torch.tensor([[0, 1, 1, 0]])  # the run is the marker alone: scored, not emptied
    logits = torch.full((1, 4, 10), -1.0)
    for p, t in enumerate([0, 7, 8, 0]):
        logits[0, p, t] = 1.0
    assert answer_hits(logits, labels, mask, END) == (1, 1)
    logits[0, 2, 8], logits[0, 2, 1] = -1.0, 1.0
    assert answer_hits(logits, labels, mask, END) == (0, 1)
    with pytest.raises(ValueError, match="must all be"):
        answer_hits(labels, labels, mask[:, :3])


class _Words:
    """A hand-made word-level tokenizer (the `tokenizers.Tokenizer` calls `question_hits` makes)."""

    WORDS = ["<s>", "what", "digit", "is", "this?", "seven", "<end>", "odd", "or", "even?", "odd", "two"]

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.WORDS)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(self.WORDS[i] for i in ids if not (skip_special_tokens and self.WORDS[i].startswith("<")))


def test_question_hits_count_the_answers_to_each_question():
    q = {"digit named": "What digit is THIS?", "parity": "odd or even?", "never": "what is two"}
    # <s> what digit is this? [seven <end>] is odd or even? [odd <end>] what digit is this? [seven <end>]
    labels = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 3, 7, 8, 9, 10, 6, 1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]])
    end = [6]
    ids = labels.clone()
    got = question_hits(ids, labels, mask, _Words(), q, end)
    assert got == {"digit named": (2, 2), "parity": (1, 1), "never": (0, 0)}
    ids[0, 17] = 11  # the second digit answer wrong
    ids[0, 12] = 0  # the parity answer's closing marker wrong: not scored
    got = question_hits(ids, labels, mask, _Words(), q, end)
    assert got == {"digit named": (1, 2), "parity": (1, 1), "never": (0, 0)}
    assert sum(h for h, _ in got.values()) == answer_hits(ids, labels, mask, end)[0]
    placeholders = labels.clone()
    placeholders[0, 0] = 99  # an id outside the vocabulary (an image placeholder) is skipped, not decoded
    assert question_hits(ids, placeholders, mask, _Words(), q, end)["digit named"] == (1, 2)
    with pytest.raises(ValueError, match="must all be"):
        question_hits(ids, labels, mask[:, :3], _Words(), q)
