"""Image-caption training data from ANY energon captioning dataset, addressed by GLOBAL sample index.

What a sample becomes (the `data.samples` contract, so `LlavaStageRunner` and the model are unchanged):

  * image -> `features[encoder]` [tokens, feature_dim]: the image (energon decodes it to float RGB in
    [0, 1]) is reduced to `channels` (1: the mean of R, G, B), resized to `image_size` (bilinear,
    antialiased) when it differs, scaled to [-1, 1], and cut into non-overlapping `patch_size` x
    `patch_size` patches in row-major order; each patch is one encoder token of
    channels * patch_size**2 features. So the ENCODER'S TOKENS AND FEATURE_DIM COME FROM THE DATA:
    tokens = (H / p) * (W / p), feature_dim = C * p * p (the digits: 8x8 grey, p = 4 -> 4 tokens of
    16 features). `resolve_config` fills `image_size` and `channels` from the split's first samples
    (grey when all of the first 32 have R = G = B) unless given, and `caption_spec` puts the result
    into the model's `LlavaSpec`. With `--image-processor` (`CaptionDataConfig.image_processor`: the
    vision tower's Hugging Face preprocessor_config.json) the image goes through the tower's own
    preprocessing instead (`data.image_processor`: RGB, resize, center crop, rescale, normalise, the
    pixels transformers' processor gives) and is cut into the same patches; the processor's output
    size is `image_size` and `channels` is 3.
  * caption -> text: `[BOS] [PLACEHOLDER_ID] * tokens  prompt  caption  [EOS]  [PAD] ...`, cut or
    padded to seq_length + 1; the image placeholder span sits at the encoder's `offset` (= 1, right
    after BOS), as in `data.samples`. `tokens` = the first seq_length, `labels` = the next token at
    each position, and `loss_mask` = 1 exactly where the label is a CAPTION token (the caption's
    tokens and its EOS, which ends the caption), 0 for the prompt, BOS, placeholders and padding.
    A caption longer than the sequence is cut (then without EOS).

Reading a run's samples by global index (`data.caption_reader`: random access through energon's
index, or energon's own loader) and batching them per rank (`data.caption_batches.CaptionBatches`)
build on the pieces here: the energon loader (`open_split`), the format (`resolve_config`), the
encoder features (`encoder_features`) and the text sample (`text_sample`, `caption_loss_tokens`).

Trust. A dataset is data: every open first reads it as data (`data.dataset_trust`) and refuses one
that names code (energon Python files and imports, pickle/torch.load-decoded members) unless the
config says `trust_code` (`--trust-dataset-code`); the index reader decodes images only with PIL and
captions only as UTF-8 text, and energon's loader decodes with webdataset's secure mode on unless
trusted.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import replace
from typing import Any, Optional

import torch

from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.data.samples import PLACEHOLDER_ID
from megatron_hetero.data.dataset_trust import UntrustedDataset, check_dataset, secure_decoding
from megatron_hetero.data.image_processor import (
    ImageProcessor,
    caption_features,
    caption_format,
    check_fits,
    load_image_processor,
)
from megatron_hetero.data.tokenizer import CaptionTokenizer

VOCAB_MULTIPLE = 128  # the model's vocabulary is the tokenizer's padded up to a multiple of this (Megatron's default)


@contextlib.contextmanager
def _quiet():
    """energon warns on every loader on CPU (pin_memory, a deprecated handler kwarg)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch


def open_split(
    path: str,
    split: str,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = False,
    shuffle_buffer_size: int = 100,
    max_samples_per_sequence: int = 100,
    trust_code: bool = False,
    task_encoder: Any = None,
):
    """(number of samples, iterator of single CaptioningSamples) over one epoch of `split`, read as
    rank 0 of 1 (no process group). shuffle False: the split's stored order. Every open checks the
    dataset first (`dataset_trust.check_dataset`: `UntrustedDataset` when it names code and not
    `trust_code`) and sets webdataset's secure decoding unless `trust_code`. `task_encoder`: an energon
    task encoder of this package (e.g. `chat_data`'s cooker for crude datasets); None: energon's
    default, which yields the dataset's own sample type."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset
    from megatron.energon.errors import reraise_exception

    check_dataset(path, trust=trust_code)
    secure_decoding(trust_code)

    wc = WorkerConfig(
        rank=0, world_size=1, num_workers=0, seed_offset=epoch_seed(seed, epoch), global_error_handler=reraise_exception
    )  # a bad sample stops the run, never shifts indices
    encoder = {} if task_encoder is None else {"task_encoder": task_encoder}
    with _quiet():
        if shuffle:
            ds = get_train_dataset(
                path,
                split_part=split,
                worker_config=wc,
                batch_size=None,
                repeat=False,
                shuffle_buffer_size=shuffle_buffer_size,
                max_samples_per_sequence=max_samples_per_sequence,
                **encoder,
            )
        else:
            ds = get_val_dataset(path, split_part=split, worker_config=wc, batch_size=None, **encoder)
        return len(ds), iter(get_loader(ds))


def _next(it):
    with _quiet():
        return next(it)


def resolve_config(cfg: CaptionDataConfig, probe: int = 32) -> CaptionDataConfig:
    """`cfg` with `image_size` (the first sample's) and `channels` (1 if the first `probe` samples
    of the split, in stored order, are all grey, else 3) filled in where None; validated. With
    `image_processor` the processor fixes both (its output size, RGB) and an `image_size` given
    (a CLIP encoder's) must be that output size."""
    cfg.validate()
    if cfg.image_processor:
        proc = image_processor_of(cfg)
        if cfg.image_size is not None:
            check_fits(proc, tuple(cfg.image_size))
        cfg = replace(cfg, **caption_format(proc, cfg.patch_size))
        cfg.validate()
    if cfg.resolved():
        return cfg
    try:
        n, it = open_split(cfg.path, cfg.split, trust_code=cfg.trust_code)
    except UntrustedDataset:
        raise
    except Exception as exc:
        raise ValueError(
            f"--data-path {cfg.path}: cannot open split '{cfg.split}' as an energon dataset "
            f"({type(exc).__name__}: {exc})"
        ) from None
    if n == 0:
        raise ValueError(f"--data-path {cfg.path}: split '{cfg.split}' is empty")
    probes = [_next(it) for _ in range(min(n, probe))]
    first = probes[0]
    if not (isinstance(getattr(first, "image", None), torch.Tensor) and hasattr(first, "caption")):
        raise ValueError(
            f"--data-path {cfg.path}: split '{cfg.split}' yields {type(first).__name__} samples, not "
            f"captioning samples (an image tensor and a caption; energon's CaptioningSample)"
        )
    grey = all(
        s.image.shape[0] == 1 or bool((s.image[0] == s.image[1]).all() and (s.image[1] == s.image[2]).all())
        for s in probes
    )
    size = cfg.image_size or (int(first.image.shape[-2]), int(first.image.shape[-1]))
    out = replace(cfg, image_size=tuple(size), channels=cfg.channels or (1 if grey else 3))
    out.validate()
    return out


@functools.lru_cache(maxsize=8)
def _load_processor(path: str) -> ImageProcessor:
    return load_image_processor(path)


def image_processor_of(cfg: CaptionDataConfig) -> ImageProcessor:
    """The processor of `cfg.image_processor` (read once per process); ValueError naming the flag."""
    assert cfg.image_processor
    try:
        return _load_processor(str(cfg.image_processor))
    except ValueError as exc:
        raise ValueError(f"--image-processor {cfg.image_processor}: {exc}") from None


def encoder_features(image: torch.Tensor, cfg: CaptionDataConfig) -> torch.Tensor:
    """One decoded image -> its encoder features [tokens, feature_dim]: through the tower's own
    preprocessing when `cfg.image_processor` is set (`image_processor.caption_features`), else
    `patchify`."""
    if cfg.image_processor:
        return caption_features(image, image_processor_of(cfg), cfg.patch_size)
    return patchify(image, cfg)


def patchify(image: torch.Tensor, cfg: CaptionDataConfig) -> torch.Tensor:
    """[C0, H0, W0] (or [H0, W0]) float image in [0, 1] -> [tokens, feature_dim] encoder input."""
    h, w = cfg._size()
    x = image.float()
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if cfg.channels == 1:
        x = x.mean(0, keepdim=True)
    elif x.shape[0] == 1:
        x = x.expand(3, -1, -1)
    if tuple(x.shape[-2:]) != (h, w):
        x = torch.nn.functional.interpolate(
            x.unsqueeze(0), size=(h, w), mode="bilinear", align_corners=False, antialias=True
        ).squeeze(0)
    x = (x - 0.5) / 0.5
    p, c = cfg.patch_size, x.shape[0]
    return (
        x.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), c * p * p).contiguous()
    )


def caption_text(caption: Any) -> str:
    return caption if isinstance(caption, str) else str(caption[0])


def text_sample(caption: str, tok: CaptionTokenizer, *, seq_length: int, image_tokens: int, prompt: str = "") -> dict:
    """tokens, labels, loss_mask [seq_length] of one caption (layout: module docstring)."""
    cap = tok.encode(caption) + [tok.eos_id]
    head = [tok.bos_id] + [PLACEHOLDER_ID] * image_tokens + (tok.encode(prompt) if prompt else [])
    full = (head + cap)[: seq_length + 1]
    is_caption = [0] * len(head) + [1] * len(cap)
    is_caption = is_caption[: seq_length + 1]
    pad = seq_length + 1 - len(full)
    full += [tok.pad_id] * pad
    is_caption += [0] * pad
    t = torch.tensor(full, dtype=torch.long)
    return {
        "tokens": t[:-1].clone(),
        "labels": t[1:].clone(),
        "loss_mask": torch.tensor(is_caption[1:], dtype=torch.float32),
    }


def caption_spec(spec, cfg: CaptionDataConfig, tok: CaptionTokenizer, vocab_size: Optional[int] = None):
    """`spec` (a `models.llava.LlavaSpec` with ONE encoder) made to fit the caption data: the encoder's
    `tokens` and `feature_dim` from the (resolved) image format, and the vocabulary from the tokenizer
    (its size padded up to a multiple of 128, or `vocab_size` if given and large enough).
    ValueError when the encoder is not at offset 1, the sequence cannot hold BOS + image + prompt +
    one caption token + EOS, or `vocab_size` is too small."""
    if len(spec.encoders) != 1:
        raise ValueError(f"caption data feeds one image encoder; the layout has encoders {sorted(spec.encoders)}")
    ((name, enc),) = spec.encoders.items()
    if enc.offset != 1:
        raise ValueError(f"encoder {name}: caption data puts the image right after BOS (offset 1), not at {enc.offset}")
    need = 1 + cfg.image_tokens + (len(tok.encode(cfg.prompt)) if cfg.prompt else 0) + 2
    if spec.seq_length + 1 < need:
        raise ValueError(
            f"--seq-length {spec.seq_length}: a caption sample needs at least {need - 1} positions "
            f"(BOS 1 + image tokens {cfg.image_tokens} + prompt + one caption token + EOS)"
        )
    if vocab_size is None:
        vocab_size = -(-tok.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    elif vocab_size < tok.vocab_size:
        raise ValueError(
            f"--vocab-size {vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens ({tok.name})"
        )
    enc = replace(enc, tokens=cfg.image_tokens, feature_dim=cfg.feature_dim)
    return replace(spec, vocab_size=vocab_size, encoders={name: enc})


def caption_loss_tokens(caption: str, tok: CaptionTokenizer, *, seq_length: int, head: int) -> int:
    """`text_sample(caption, ...)["loss_mask"].sum()` from the caption's token count alone: the
    caption's tokens and EOS that fit after the `head` positions (BOS, placeholders, prompt)."""
    return max(0, min(head + len(tok.encode(caption)) + 1, seq_length + 1) - head)
