"""Tokenizers for caption data, with nothing to download.

`load_tokenizer(None)` is the tokenizer shipped in this package (`digits_tokenizer.json`): a
byte-level BPE (GPT-2 style: every byte is a base token, so ANY text encodes and decodes back
exactly) whose merges were trained with the `tokenizers` library on the digit captions
(`train_caption_bpe(digit captions)`), so "a handwritten seven" is 3 tokens (306 tokens in all: the
merges stop once every caption word is one token). Its special tokens come first: 0 `<image>` (the
image placeholder, `data.samples.PLACEHOLDER_ID`), 1 `<pad>`, 2 `<s>` (BOS), 3 `</s>` (EOS).

`load_tokenizer(FILE)` loads any Hugging Face `tokenizer.json` (`tokenizers.Tokenizer.from_file`) for
real runs (`train --tokenizer-model FILE`). Its BOS/EOS/PAD are found by the usual token names
(`<s>`, `<|begin_of_text|>`, `<|endoftext|>`, `[CLS]` ...; EOS is required, BOS and PAD default to
EOS); the image placeholder id stays `PLACEHOLDER_ID`: the language model overwrites the embedding
at placeholder positions with the encoder's tokens and the loss never covers them, so its value only
has to be a valid id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megatron_hetero.data.samples import PLACEHOLDER_ID
from megatron_hetero.data.digits import DIGIT_WORDS, digit_caption

SHIPPED_TOKENIZER = Path(__file__).with_name("digits_tokenizer.json")
SPECIAL_TOKENS = ("<image>", "<pad>", "<s>", "</s>")  # ids 0..3 in the shipped tokenizer

BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]", "<|endoftext|>", "<|im_start|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


@dataclass(frozen=True)
class CaptionTokenizer:
    """A `tokenizers.Tokenizer` with the ids caption data needs. `encode` adds no special tokens
    (the caption sample builder places BOS/EOS itself); `decode` drops special tokens."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: int
    eos_id: int
    pad_id: int
    name: str = "shipped"
    placeholder_id: int = PLACEHOLDER_ID

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _find(tok, names: Sequence[str]) -> Optional[int]:
    for n in names:
        i = tok.token_to_id(n)
        if i is not None:
            return int(i)
    return None


def load_tokenizer(path: Optional[str] = None) -> CaptionTokenizer:
    """The shipped digits tokenizer (path None) or a Hugging Face `tokenizer.json` file.
    ValueError when the file is missing, unreadable, or has no EOS token."""
    from tokenizers import Tokenizer

    file = SHIPPED_TOKENIZER if path is None else Path(path)
    if not file.is_file():
        raise ValueError(f"--tokenizer-model {file}: no such file (a Hugging Face tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises its own Exception type on a bad file
        raise ValueError(f"--tokenizer-model {file}: not a Hugging Face tokenizer.json ({exc})") from None
    eos = _find(tok, EOS_NAMES)
    if eos is None:
        raise ValueError(f"--tokenizer-model {file}: no end-of-sequence token (looked for {', '.join(EOS_NAMES)})")
    bos = _find(tok, BOS_NAMES)
    pad = _find(tok, PAD_NAMES)
    return CaptionTokenizer(
        tok,
        bos_id=eos if bos is None else bos,
        eos_id=eos,
        pad_id=eos if pad is None else pad,
        name="shipped" if path is None else str(file),
    )


def train_caption_bpe(texts: Iterable[str], vocab_size: int = 320):
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `texts`, specials `SPECIAL_TOKENS` at
    ids 0..3, then the 256 byte tokens, then merges up to `vocab_size`. This is how the shipped
    `digits_tokenizer.json` was made: `train_caption_bpe(digit captions).save(PATH)`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def build_shipped_tokenizer(path: Path = SHIPPED_TOKENIZER) -> Path:
    """(Re)write the shipped tokenizer from the digit captions (each caption once per digit)."""

    train_caption_bpe([digit_caption(d) for d in range(len(DIGIT_WORDS))]).save(str(path))
    return path
