"""Conversation (visual instruction) samples from an energon dataset: conversations + decoded images.

What energon 7.4.1 offers. Its typed samples have no multi-turn conversation: `VQASample` is one
image, one question (`context`) and its answers; `InterleavedSample` is a sequence of images and
texts without roles; `CaptioningSample` one image and a caption. For any other format energon's
intended route is a *crude* dataset: `.nv-meta/dataset.yaml` names `megatron.energon`'s
`CrudeWebdataset` (no code), each sample arrives as a plain dict of its decoded parts, and a `Cooker`
in the TASK ENCODER (the reading program's code, here this module) turns it into a typed sample. So
the dataset names no code, and `data.dataset_trust` accepts it; a dataset that brings its own
`sample_loader.py` is refused unless `--trust-dataset-code`, as everywhere.

A conversation sample (the layout `data.digits_chat` writes):

    KEY.json      {"conversation": [{"role": "user", "content": "<image>\\nWhat digit is this?"},
                                    {"role": "assistant", "content": "seven"}],
                   "images": ["img0.png"], ...any other keys (kept as `meta`)}
    KEY.img0.png  one part per image, named in "images" in the order of the <image> markers

LLaVA's own JSON is accepted too: `"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]`.
Without an "images" list, the image parts (png, jpg, jpeg, webp) are taken in name order. Text-only
samples have no image parts.

`open_chat_split(path, split)` -> (number of samples, iterator of `ChatSample`): `conversation`
(normalised `{role, content}` messages), `images` (float [3, H, W] tensors in [0, 1], energon's
default decoding; images of one sample may differ in size) and `meta`. It opens the split with
`data.energon_data.open_split` and this module's cooker, so the same trust path runs first: `dataset_trust.check_dataset` (refuses a dataset naming
code unless `trust_code`) and webdataset's secure decoding. The split is read as rank 0 of a world of 1,
epoch seed `energon_data.epoch_seed(seed, epoch)`, like the caption data. A typed `VQASample`
(question -> first answer) or `CaptioningSample` (image -> caption) dataset is read as one-turn
conversations.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterator, Optional

from megatron_hetero.data.chat_template import normalize_messages
from megatron_hetero.data.chat_tokens import IMAGE_MARKER
from megatron_hetero.data.energon_data import _quiet, open_split

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
_IMAGE_PART = re.compile(r"^(.*\.)?(" + "|".join(IMAGE_EXTENSIONS) + r")$")


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def conversation_of(raw: dict, key: str = "?") -> tuple[list[dict[str, str]], list[Any], dict]:
    """(messages, images, meta) of one crude sample dict (its decoded parts by part name).
    ValueError naming the sample for a missing conversation, an unknown role, a missing image part, or
    an <image> marker count that differs from the images."""
    doc = raw.get("json")
    if not isinstance(doc, dict):
        raise ValueError(f"sample {key}: no JSON part (KEY.json with a 'conversation')")
    conv = doc.get("conversation", doc.get("conversations"))
    if conv is None:
        raise ValueError(f"sample {key}: its JSON has no 'conversation' (or LLaVA's 'conversations')")
    try:
        messages = normalize_messages(conv)
    except ValueError as exc:
        raise ValueError(f"sample {key}: {exc}") from None
    names = doc.get("images")
    if names is None:
        names = sorted((p for p in raw if isinstance(p, str) and _IMAGE_PART.match(p)), key=_natural)
    missing = [n for n in names if n not in raw]
    if missing:
        raise ValueError(f"sample {key}: image part(s) {missing} named in its JSON are not in the sample")
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if markers != len(names):
        raise ValueError(f"sample {key}: {markers} {IMAGE_MARKER} marker(s) but {len(names)} image(s)")
    meta = {k: v for k, v in doc.items() if k not in ("conversation", "conversations", "images")}
    return messages, [raw[n] for n in names], meta


@functools.cache
def chat_sample_type() -> type:
    """`ChatSample`, an energon `Sample` (made on first use: importing this module needs no energon)."""
    from megatron.energon import Sample, edataclass

    @edataclass
    class ChatSample(Sample):
        """One conversation: normalised messages, its images ([3, H, W] float in [0, 1]) and meta."""

        conversation: list
        images: list
        meta: dict

    return ChatSample


def _task_encoder():
    """A `DefaultTaskEncoder` whose one cooker turns crude conversation samples into `ChatSample`s."""
    from megatron.energon import Cooker, DefaultTaskEncoder, basic_sample_keys, stateless

    cls = chat_sample_type()

    @stateless
    def cook_conversation(raw: dict):
        key = str(raw.get("__key__", "?"))
        messages, images, meta = conversation_of(raw, key)
        return cls(**basic_sample_keys(raw), conversation=messages, images=images, meta=meta)

    class ChatTaskEncoder(DefaultTaskEncoder):
        cookers = [Cooker(cook_conversation)]

    return ChatTaskEncoder()


def as_chat_sample(sample):
    """A `ChatSample` from what the loader yields: a cooked conversation, a `VQASample` (question ->
    its first answer) or a `CaptioningSample` (image -> caption). ValueError for other sample types."""
    cls = chat_sample_type()
    if isinstance(sample, cls):
        return sample
    name = type(sample).__name__
    base = dict(__key__=sample.__key__, __restore_key__=sample.__restore_key__, __subflavors__=sample.__subflavors__)
    if name == "VQASample":
        answer = (sample.answers or [""])[0]
        conv = [
            {"role": "user", "content": f"{IMAGE_MARKER}\n{sample.context}"},
            {"role": "assistant", "content": answer},
        ]
        return cls(**base, conversation=conv, images=[sample.image], meta={})
    if name == "CaptioningSample":
        conv = [{"role": "user", "content": IMAGE_MARKER}, {"role": "assistant", "content": sample.caption}]
        return cls(**base, conversation=conv, images=[sample.image], meta={})
    raise ValueError(
        f"{name} samples are not conversations (a crude conversation dataset, VQASample or CaptioningSample)"
    )


def open_chat_split(
    path: str,
    split: str,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = False,
    shuffle_buffer_size: int = 100,
    max_samples_per_sequence: int = 100,
    trust_code: bool = False,
) -> tuple[int, Iterator[Any]]:
    """(number of samples, iterator of `ChatSample`) over one epoch of `split` (module docstring).
    `UntrustedDataset` (a ValueError) when the dataset names code and not `trust_code`."""
    with _quiet():
        te = _task_encoder()
    n, it = open_split(
        path,
        split,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence,
        trust_code=trust_code,
        task_encoder=te,
    )

    def samples() -> Iterator[Any]:
        while True:
            with _quiet():
                try:
                    s = next(it)
                except StopIteration:
                    return
            yield as_chat_sample(s)

    return n, samples()


def read_conversations(path: str, split: str, *, limit: Optional[int] = None, trust_code: bool = False) -> list:
    """Every `ChatSample` of `split` in stored order (the first `limit` when given)."""
    n, it = open_chat_split(path, split, trust_code=trust_code)
    n = n if limit is None else min(n, limit)
    return [next(it) for _ in range(n)]
