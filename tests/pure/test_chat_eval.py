"""Answer accuracy (`models/chat_eval.py`) on hand-made ids and logits."""

from __future__ import annotations

import pytest
import torch

from megatron_hetero.models.chat_eval import answer_hits, answer_runs

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
