"""Spoken-digits conversations as tokens: `<image>` and `<speech>` placeholder runs in text order,
speech clips cut into chunks, and the per-modality held-out counts (digit shown, digit said)."""

from __future__ import annotations

import pytest
import torch

from megatron_hetero.data.chat_default import chat_template_for
from megatron_hetero.data.chat_tokens import marker_tokenizer, tokenize_conversation
from megatron_hetero.data.speech_batches import clip_chunks, clip_features, tokenize_speech_conversation
from megatron_hetero.models.speech_eval import SAID, SHOWN, modality_hits
from megatron_hetero.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def template():
    return chat_template_for(None)


def _conv(q: str, a: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def test_markers_become_runs_in_text_order(tok, template):
    msgs = _conv("<speech>\n<image>\nWhat digit is shown, and which digit was said?", "seven and three")
    ct, kinds = tokenize_speech_conversation(msgs, [4], [32], tok, template)
    assert kinds == ("speech", "image")
    assert [length for _, length in ct.image_spans] == [32, 4]  # the clip's run first: it comes first
    # the same as tokenising with two image markers of those lengths (the text around is unchanged)
    ref = tokenize_conversation(
        _conv(msgs[0]["content"].replace("<speech>", "<image>"), "seven and three"), [32, 4], tok, template
    )
    assert ct.ids == ref.ids and ct.mask == ref.mask and ct.image_spans == ref.image_spans
    with pytest.raises(ValueError, match=r"1 <speech> marker\(s\) but 2 clip"):
        tokenize_speech_conversation(msgs, [4], [16, 16], tok, template)
    with pytest.raises(ValueError, match=r"1 <image> marker\(s\) but 0 image"):
        tokenize_speech_conversation(msgs, [], [16], tok, template)


def test_a_clip_is_cut_into_chunks_of_two_frames_a_token():
    mel = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3) + 1.0  # 10 frames, 3 bins
    assert [clip_chunks(f, 2) for f in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    got = clip_features(mel, 2)  # 4 frames a chunk: 3 chunks, the last with 2 frames of filling
    assert got.shape == (3, 2, 6)
    assert torch.equal(got[0, 0], torch.cat([mel[0], mel[1]])) and torch.equal(got[1, 1], torch.cat([mel[6], mel[7]]))
    assert torch.equal(got[2, 0], torch.cat([mel[8], mel[9]]))
    assert torch.equal(got[2, 1], torch.full((6,), 1.0))  # the clip's smallest value


def _labels_and_mask(ct):
    ids = torch.tensor(ct.ids)
    return ids[1:].unsqueeze(0), torch.tensor(ct.mask[1:], dtype=torch.float32).unsqueeze(0)


def test_modality_hits_count_the_digit_shown_and_the_digit_said(tok, template):
    mtok, _ = marker_tokenizer(tok.tokenizer, extra=template.markers)
    end = list(mtok.encode(template.eos_token, add_special_tokens=False).ids)
    both, _ = tokenize_speech_conversation(
        _conv("<image>\n<speech>\nWhat digit is shown, and which digit was said?", "seven and three"),
        [4],
        [16],
        tok,
        template,
    )
    said, _ = tokenize_speech_conversation(
        _conv("<speech>\nWhich digit was said?", "three") + _conv("Is it odd or even?", "odd"), [], [16], tok, template
    )
    for ct, want in ((both, {SHOWN: (1, 1), SAID: (1, 1)}), (said, {SHOWN: (0, 0), SAID: (1, 1)})):
        labels, mask = _labels_and_mask(ct)
        assert modality_hits(labels.clone(), labels, mask, mtok, end) == want  # a perfect prediction
    labels, mask = _labels_and_mask(both)
    start = int(mask[0].nonzero()[0])
    wrong_shown = labels.clone()
    wrong_shown[0, start] = labels[0, start] + 1  # the first token of "seven"
    assert modality_hits(wrong_shown, labels, mask, mtok, end) == {SHOWN: (0, 1), SAID: (1, 1)}
    wrong_said = labels.clone()
    last = int(mask[0].nonzero()[-1]) - len(end)  # the last token of "three" (the end marker is not scored)
    wrong_said[0, last] = labels[0, last] + 1
    assert modality_hits(wrong_said, labels, mask, mtok, end) == {SHOWN: (1, 1), SAID: (0, 1)}
    # the closing end-of-turn marker is not scored
    wrong_end = labels.clone()
    wrong_end[0, int(mask[0].nonzero()[-1])] += 1
    assert modality_hits(wrong_end, labels, mask, mtok, end) == {SHOWN: (1, 1), SAID: (1, 1)}
    text, _ = tokenize_speech_conversation(_conv("What is two plus two?", "four"), [], [], tok, template)
    labels, mask = _labels_and_mask(text)
    assert modality_hits(labels, labels, mask, mtok, end) == {SHOWN: (0, 0), SAID: (0, 0)}  # neither modality
