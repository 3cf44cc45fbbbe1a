"""Caption tokenizers: the shipped byte-level BPE (no download) and Hugging Face tokenizer.json files."""

from __future__ import annotations

import json

import pytest

from megatron_hetero.data.samples import PLACEHOLDER_ID
from megatron_hetero.data.digits import DIGIT_WORDS, digit_caption
from megatron_hetero.data.tokenizer import SHIPPED_TOKENIZER, SPECIAL_TOKENS, load_tokenizer, train_caption_bpe

TEXTS = [
    "a handwritten seven",
    "A Handwritten SEVEN.",
    "zwei Äpfel, drei Birnen",
    "数字 7 😀",
    "  spaces\tand\nlines ",
    "",
]


def test_shipped_tokenizer_specials_come_first():
    tok = load_tokenizer()
    assert SHIPPED_TOKENIZER.is_file() and tok.name == "shipped"
    assert [tok.tokenizer.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.placeholder_id == PLACEHOLDER_ID == tok.tokenizer.token_to_id("<image>")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (1, 2, 3)
    assert tok.vocab_size == 306  # 4 specials + 256 bytes + the merges of the caption words


@pytest.mark.parametrize("text", TEXTS + [digit_caption(d) for d in range(10)])
def test_shipped_tokenizer_round_trips_any_text(text):
    tok = load_tokenizer()
    ids = tok.encode(text)
    assert all(4 <= i < tok.vocab_size for i in ids)  # no special token from plain text
    assert tok.decode(ids) == text


def test_digit_captions_are_three_tokens_with_the_digit_word_last():
    tok = load_tokenizer()
    encoded = [tok.encode(digit_caption(d)) for d in range(10)]
    assert all(len(ids) == 3 for ids in encoded)
    assert all(ids[:2] == encoded[0][:2] for ids in encoded)  # "a", " handwritten"
    assert len({ids[2] for ids in encoded}) == 10
    assert [tok.decode(ids[2:]).strip() for ids in encoded] == list(DIGIT_WORDS)


def test_decode_drops_special_tokens():
    tok = load_tokenizer()
    ids = [tok.bos_id, PLACEHOLDER_ID, PLACEHOLDER_ID] + tok.encode("a handwritten two") + [tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "a handwritten two"


def test_shipped_file_is_what_training_on_the_captions_gives():
    retrained = train_caption_bpe([digit_caption(d) for d in range(10)])
    shipped = load_tokenizer().tokenizer
    assert retrained.get_vocab() == shipped.get_vocab()
    for text in TEXTS:
        assert retrained.encode(text).ids == shipped.encode(text).ids


def _word_level(path, vocab: dict, **specials):
    """A Hugging Face tokenizer.json (WordLevel model, whitespace pre-tokenizer) written by `tokenizers`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens(list(specials.values()))
    tok.save(str(path))
    return path


def test_hf_tokenizer_json_is_loaded_with_its_specials(tmp_path):
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "a": 2, "handwritten": 3, "seven": 4, "cat": 5}
    path = _word_level(tmp_path / "tokenizer.json", vocab, eos="<|endoftext|>")
    assert json.loads(path.read_text())["model"]["type"] == "WordLevel"
    tok = load_tokenizer(str(path))
    assert tok.name == str(path) and tok.vocab_size == 6
    # GPT-2 style: one <|endoftext|> serves as BOS, EOS and PAD
    assert tok.eos_id == tok.bos_id == tok.pad_id == 1
    assert tok.encode("a handwritten seven") == [2, 3, 4]
    assert tok.decode([1, 2, 3, 4, 1]) == "a handwritten seven"
    assert tok.encode("a dog") == [2, 0]  # unknown word -> [UNK]


def test_hf_tokenizer_json_with_separate_bos_eos_pad(tmp_path):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "[UNK]": 4, "hello": 5}
    tok = load_tokenizer(str(_word_level(tmp_path / "t.json", vocab, bos="<s>", eos="</s>", pad="<pad>")))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    assert tok.encode("hello") == [5]


def test_bad_tokenizer_files_are_input_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(bad))
    no_eos = _word_level(tmp_path / "no_eos.json", {"[UNK]": 0, "a": 1})
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_tokenizer(str(no_eos))
