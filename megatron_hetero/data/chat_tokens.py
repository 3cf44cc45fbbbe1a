"""A conversation (with images) -> token ids and the loss mask, through a chat template.

`tokenize_conversation(messages, image_tokens, tok, template)`:

  1. the messages are normalised (`chat_template.normalize_messages`: roles system/user/assistant,
     LLaVA's human/gpt accepted) and rendered with the tokenizer's chat template, with the assistant
     turns' character ranges (`ChatTemplate.assistant_spans`: the template's `{% generation %}` blocks
     where it has them, else by rendering prefixes of the conversation);
  2. the rendered text is tokenised ONCE, without adding special tokens (the template writes BOS and
     the turn markers itself; as `apply_chat_template(tokenize=True)` does), with the image marker
     (`<image>`) as an added special token, so every marker is exactly one token and the text around it
     tokenises as it does in a tokenizer that has `<image>` (a tokenizer without it is copied and given it);
  3. each marker token becomes a run of `image_tokens[k]` placeholder ids (image k, in order; images can
     have different token counts); the placeholder id is the tokenizer's own `<image>` id when it has
     one, else `data.samples.PLACEHOLDER_ID`;
  4. the loss mask is 1 exactly for the tokens whose character range overlaps an assistant span: the
     assistant content and the end-of-turn token that closes it; never system/user turns, role
     headers, the generation prompt or image placeholders.

Markers may appear only in user turns, and the number of markers in the rendered text must equal the
number of images given (ValueError otherwise, naming both counts). `transformers`' own mask
(`return_assistant_tokens_mask=True`) marks the tokens from the one holding a span's first character
to the one holding its last; for a tokenizer whose tokens cover every character (byte-level BPE) that
is the same set (`tests/pure/test_chat_template.py` compares both).

`train_sample(chat, seq_length, pad_id)` turns the result into the `data.samples` sample contract:
`tokens`, `labels` (next token), `loss_mask` (on the label: 1 where the label is an assistant token)
and `image_mask` (1 at placeholder positions of `tokens`), cut or padded to `seq_length`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from megatron_hetero.data.chat_template import ChatTemplate, normalize_messages
from megatron_hetero.data.samples import PLACEHOLDER_ID
from megatron_hetero.data.tokenizer import CaptionTokenizer

IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class ChatTokens:
    """One tokenised conversation: `ids` and `mask` (1 = an assistant token, the loss covers it) of
    equal length, `image_spans` [(start, length)] of each image's placeholder run in `ids`, the
    rendered `text`, its assistant character ranges `char_spans`, and the span `method`."""

    ids: list[int]
    mask: list[int]
    image_spans: list[tuple[int, int]]
    text: str
    char_spans: list[tuple[int, int]]
    method: str

    def __len__(self) -> int:
        return len(self.ids)


def _added_tokens(tokenizer) -> dict[str, int]:
    return {t.content: int(i) for i, t in tokenizer.get_added_tokens_decoder().items()}


_MARKER_TOKENIZERS: dict[tuple, Any] = {}


def marker_tokenizer(tokenizer, marker: str = IMAGE_MARKER, extra: Sequence[str] = ()) -> tuple[Any, int]:
    """(a `tokenizers.Tokenizer` in which `marker` and every `extra` marker (a template's turn markers,
    `ChatTemplate.markers`) are added special tokens, the id of `marker`): `tokenizer` itself when it
    already has them all, else a copy given the missing ones, in that order (cached per tokenizer
    object and markers)."""
    added = _added_tokens(tokenizer)
    # the turn markers first: they take the ids right after the tokenizer's own; the image marker (its
    # placeholders replace it, so its id never reaches the model) comes last
    missing = [m for m in dict.fromkeys([*extra, marker]) if m not in added]
    if not missing:
        return tokenizer, added[marker]
    key = (id(tokenizer), tuple(missing))
    if key not in _MARKER_TOKENIZERS:
        from tokenizers import AddedToken, Tokenizer

        copy = Tokenizer.from_str(tokenizer.to_str())
        copy.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in missing])
        _MARKER_TOKENIZERS[key] = (tokenizer, copy)  # keep the original alive: its id stays unique
    copy = _MARKER_TOKENIZERS[key][1]
    return copy, int(copy.token_to_id(marker))


def conversation_vocab_size(tokenizer, extra: Sequence[str] = (), marker: str = IMAGE_MARKER) -> int:
    """The token ids a tokenised conversation can hold (`tokenize_conversation`): the tokenizer's own
    and the `extra` turn markers it is given; not the image marker, whose placeholders replace it."""
    mtok, _ = marker_tokenizer(tokenizer, marker, extra)
    size = mtok.get_vocab_size(with_added_tokens=True)
    return size - (0 if marker in _added_tokens(tokenizer) else 1)


def image_placeholder_id(tok: CaptionTokenizer, marker: str = IMAGE_MARKER) -> int:
    """The id an image's placeholder run holds: the tokenizer's own `marker` token, else PLACEHOLDER_ID."""
    own = _added_tokens(tok.tokenizer).get(marker)
    return PLACEHOLDER_ID if own is None else own


def tokenize_conversation(
    messages: Sequence[Mapping[str, Any]],
    image_tokens: Sequence[int],
    tok: CaptionTokenizer,
    template: ChatTemplate,
    *,
    marker: str = IMAGE_MARKER,
    placeholder_id: Optional[int] = None,
    method: str = "auto",
    add_generation_prompt: bool = False,
    **template_vars,
) -> ChatTokens:
    """`messages` -> `ChatTokens` (module docstring). `image_tokens[k]` is image k's token count (>= 1).
    ValueError for an unknown role, markers outside user turns, a marker count that differs from
    `len(image_tokens)`, or a template that refuses the conversation. `add_generation_prompt` ends the
    text with the template's assistant header (a prompt for generation; not in the mask)."""
    msgs = normalize_messages(messages)
    counts = [m["content"].count(marker) for m in msgs]
    for i, (m, c) in enumerate(zip(msgs, counts)):
        if c and m["role"] != "user":
            raise ValueError(f"message {i} ({m['role']}): has {c} {marker} marker(s); images belong in user turns")
    if sum(counts) != len(image_tokens):
        raise ValueError(
            f"the conversation has {sum(counts)} {marker} marker(s) but {len(image_tokens)} image(s) were given"
        )
    for k, n in enumerate(image_tokens):
        if int(n) < 1:
            raise ValueError(f"image {k}: token count must be >= 1, got {n}")
    text, spans, used = template.assistant_spans(
        msgs, method=method, add_generation_prompt=add_generation_prompt, **template_vars
    )
    if text.count(marker) != len(image_tokens):
        raise ValueError(
            f"{template.name}: the rendered conversation has {text.count(marker)} {marker} marker(s), the "
            f"messages {len(image_tokens)} (the template drops or repeats message content)"
        )
    mtok, marker_id = marker_tokenizer(tok.tokenizer, marker, template.markers)
    enc = mtok.encode(text, add_special_tokens=False)
    pid = image_placeholder_id(tok, marker) if placeholder_id is None else int(placeholder_id)
    ids: list[int] = []
    mask: list[int] = []
    image_spans: list[tuple[int, int]] = []
    images = iter(int(n) for n in image_tokens)
    for t, (s, e) in zip(enc.ids, enc.offsets):
        if t == marker_id:
            n = next(images)
            image_spans.append((len(ids), n))
            ids.extend([pid] * n)
            mask.extend([0] * n)
            continue
        ids.append(int(t))
        mask.append(int(e > s and any(s < b and e > a for a, b in spans)))
    if len(image_spans) != len(image_tokens):  # a marker the tokenizer did not split off (normaliser)
        raise ValueError(f"{tok.name}: {len(image_spans)} of the {len(image_tokens)} {marker} markers became one token")
    return ChatTokens(ids, mask, image_spans, text, spans, used)


def kept_images(chat: ChatTokens, seq_length: int) -> int:
    """How many of `chat`'s images `train_sample(chat, seq_length, ...)` keeps: the images before the
    first whose placeholder run does not end within the first `seq_length` positions."""
    k = 0
    for start, length in chat.image_spans:
        if start + length > seq_length:
            break
        k += 1
    return k


def train_sample(chat: ChatTokens, seq_length: int, pad_id: int) -> dict:
    """tokens, labels, loss_mask, image_mask [seq_length] of one conversation (module docstring).
    The conversation is cut to seq_length + 1 tokens (an image run that does not lie whole within the
    first seq_length positions, the `tokens`, is dropped from the end whole: its placeholders become
    padding; so `image_mask` holds every kept image's whole run, `kept_images` counts them) or padded
    with `pad_id`."""
    n = seq_length + 1
    ids, mask = list(chat.ids), list(chat.mask)
    is_image = [0] * len(ids)
    kept = kept_images(chat, seq_length)  # an image is whole in `tokens` or absent
    for start, length in chat.image_spans[:kept]:
        is_image[start : start + length] = [1] * length
    if kept < len(chat.image_spans):
        start = chat.image_spans[kept][0]
        ids, mask, is_image = ids[:start], mask[:start], is_image[:start]
    ids, mask, is_image = ids[:n], mask[:n], is_image[:n]
    pad = n - len(ids)
    ids += [pad_id] * pad
    mask += [0] * pad
    is_image += [0] * pad
    t = torch.tensor(ids, dtype=torch.long)
    return {
        "tokens": t[:-1].clone(),
        "labels": t[1:].clone(),
        "loss_mask": torch.tensor(mask[1:], dtype=torch.float32),
        "image_mask": torch.tensor(is_image[:-1], dtype=torch.bool),
    }
