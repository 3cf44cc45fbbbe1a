"""The digits conversation dataset (`megatron-hetero data digits --chat`, `data/digits_chat.py`) read back
through energon with our cooker (`data/chat_data.py`), and tokenised with a chat template.

The answers are checked against scikit-learn's digit labels by a checker written here (it reads the
question, not the builder's code), and every image against the digit it claims to be.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from megatron_hetero import cli
from megatron_hetero.data.chat_data import conversation_of, open_chat_split, read_conversations
from megatron_hetero.data.chat_template import ChatTemplate
from megatron_hetero.data.chat_tokens import tokenize_conversation
from megatron_hetero.data.dataset_trust import UntrustedDataset
from megatron_hetero.data.digits_chat import number_word, write_digits_chat_dataset
from megatron_hetero.data.tokenizer import load_tokenizer

TRAIN, VAL = 240, 60
WORDS = "zero one two three four five six seven eight nine".split()


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("digits-chat")
    args = ["data", "digits", "--chat", "--out", str(out), "--samples", str(TRAIN), "--val-samples", str(VAL)]
    assert cli.main(args + ["--train-shards", "2", "--sizes", "8,16", "--json"]) == 0
    return out, {split: read_conversations(str(out), split) for split in ("train", "val")}


def _expected(question: str, labels: list[int], previous: int | None) -> tuple[str, int | None]:
    """The right answer to `question` about digits `labels` (and the previous numeric answer)."""
    q = question.split("\n")[-1]
    if q == "What digit is this?":
        return WORDS[labels[0]], labels[0]
    if q == "Is it odd or even?":
        return ("odd" if labels[0] % 2 else "even"), None
    if q == "What is it times two?":
        return number_word(2 * labels[0]), None
    if m := re.fullmatch(r"What is it plus (\w+)\?", q):
        return number_word(labels[0] + WORDS.index(m[1])), None
    if q == "What are the two digits?":
        return f"{WORDS[labels[0]]} and {WORDS[labels[1]]}", None
    if q == "What is the sum of the two digits?":
        s = labels[0] + labels[1]
        return f"{number_word(s)} ({s})", None
    if q == "Which one is larger?":
        a, b = labels
        return ("the first" if a > b else "the second" if b > a else "they are equal"), None
    if q == "What is the first minus the second?":
        return number_word(labels[0] - labels[1]), None
    if m := re.fullmatch(r"What is (\w+) plus (\w+)\?", q):
        s = WORDS.index(m[1]) + WORDS.index(m[2])
        return number_word(s), s
    if q == "And that times two?":
        assert previous is not None
        return number_word(2 * previous), None
    raise AssertionError(f"unexpected question {question!r}")


def test_counts_images_and_answers(chat):
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    out, splits = chat
    digits = load_digits()
    assert {k: len(v) for k, v in splits.items()} == {"train": TRAIN, "val": VAL}
    split_yaml = (out / ".nv-meta" / "split.yaml").read_text()  # test = the val shard (energon lint's default)
    assert "test:\n  - val/shard-000000.tar" in split_yaml and "val:\n  - val/shard-000000.tar" in split_yaml
    seen: dict[str, set[int]] = {}
    kinds: Counter = Counter()
    sizes: Counter = Counter()
    turns = 0
    for split, samples in splits.items():
        seen[split] = set()
        for s in samples:
            conv, meta, labels = s.conversation, s.meta, s.meta["labels"]
            kinds[meta["kind"]] += 1
            # well formed: optional system first, then user/assistant pairs, images only in user turns
            roles = [m["role"] for m in conv]
            body = roles[1:] if roles[0] == "system" else roles
            assert body == ["user", "assistant"] * (len(body) // 2) and body, (s.__key__, roles)
            assert sum(m["content"].count("<image>") for m in conv) == len(s.images) == len(labels)
            assert all("<image>" not in m["content"] for m in conv if m["role"] != "user")
            # the images are the digits they claim, at their stored size
            for img, d, size, label in zip(s.images, meta["digits"], meta["sizes"], labels):
                assert int(digits.target[d]) == label
                assert tuple(img.shape) == (3, size, size) and size in (8, 16)
                want = np.kron(np.round(digits.images[d] * 255 / 16), np.ones((size // 8, size // 8))) / 255
                assert torch.allclose(img[0].double(), torch.from_numpy(want), atol=1e-6), s.__key__
                assert (img[0] == img[1]).all() and (img[1] == img[2]).all()
                sizes[size] += 1
                seen[split].add(d)
            # the answers are right for the images
            previous = None
            pairs = conv[1:] if conv[0]["role"] == "system" else conv
            for q, a in zip(pairs[::2], pairs[1::2]):
                want_answer, previous = _expected(q["content"], labels, previous)
                assert a["content"] == want_answer, (s.__key__, q["content"], a["content"], labels)
                turns += 1
    assert not seen["train"] & seen["val"]  # held-out digits only in val
    assert set(kinds) == {"one", "two", "text"} and set(sizes) == {8, 16}
    assert any(len(set(s.meta["sizes"])) == 2 for s in splits["train"])  # two sizes in one conversation
    assert turns > TRAIN + VAL
    n, it = open_chat_split(str(out), "train", shuffle=True, seed=1)  # one shuffled epoch: the same samples
    shuffled = [next(it).__key__ for _ in range(n)]
    assert sorted(shuffled) == sorted(s.__key__ for s in splits["train"]) != shuffled


def test_deterministic_and_cli_errors(chat, tmp_path):
    out, _ = chat
    again = tmp_path / "again"
    write_digits_chat_dataset(again, samples=TRAIN, val_samples=VAL, train_shards=2, prepare=False)
    for tar in sorted((out / "train").glob("*.tar")) + sorted((out / "val").glob("*.tar")):
        assert tar.read_bytes() == (again / tar.relative_to(out)).read_bytes()
    base = ["data", "digits", "--chat", "--samples", str(TRAIN), "--val-samples", str(VAL), "--train-shards", "2"]
    assert cli.main(base + ["--out", str(again)]) == 2  # not empty
    assert cli.main(base + ["--out", str(tmp_path / "s"), "--sizes", "8,12"]) == 2
    assert cli.main(base + ["--out", str(tmp_path / "s"), "--sizes", "big"]) == 2
    assert cli.main(["data", "check", str(out)]) == 0  # names no code: crude dataset of megatron.energon


def test_conversations_tokenise_with_different_image_token_counts(chat):
    """Every val conversation through a ChatML template: image runs of (size/4)^2 tokens, a mask on
    the answers only."""
    _, splits = chat
    tok = load_tokenizer()
    template = ChatTemplate(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        {"eos_token": "</s>"},
    )
    for s in splits["val"]:
        counts = [(img.shape[-1] // 4) ** 2 for img in s.images]
        ct = tokenize_conversation(s.conversation, counts, tok, template)
        assert [n for _, n in ct.image_spans] == counts
        answers = [m["content"] + "</s>" for m in s.conversation if m["role"] == "assistant"]
        assert [ct.text[a:b] for a, b in ct.char_spans] == answers
        masked = [t for t, m in zip(ct.ids, ct.mask) if m]
        assert tok.tokenizer.decode(masked, skip_special_tokens=False) == "".join(answers)


def test_bad_samples_and_untrusted_datasets(chat, tmp_path):
    with pytest.raises(ValueError, match="1 <image> marker.s. but 0 image"):
        conversation_of({"json": {"conversation": [{"role": "user", "content": "<image>"}]}}, "k")
    with pytest.raises(ValueError, match="not in the sample"):
        conversation_of({"json": {"conversation": [{"from": "human", "value": "<image>"}], "images": ["a.png"]}})
    with pytest.raises(ValueError, match="unknown role"):
        conversation_of({"json": {"conversation": [{"role": "tool", "content": "x"}]}}, "k")
    msgs, imgs, _ = conversation_of(
        {"json": {"conversations": [{"from": "human", "value": "<image><image>"}]}, "img10.png": 2, "img2.png": 1}
    )
    assert imgs == [1, 2] and msgs[0]["role"] == "user"  # image parts in natural name order
    # a copy of the dataset that names a sample loader is refused before energon opens it
    out, _ = chat
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".nv-meta").mkdir()
    for f in (out / ".nv-meta").iterdir():
        (bad / ".nv-meta" / f.name).write_bytes(f.read_bytes())
    (bad / ".nv-meta" / "dataset.yaml").write_text(
        json.dumps(
            {"sample_type": {"__module__": "megatron.energon", "__class__": "VQASample"}, "sample_loader": "x.py:f"}
        )
    )
    with pytest.raises(UntrustedDataset, match="sample_loader"):
        open_chat_split(str(bad), "val")
