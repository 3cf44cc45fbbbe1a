"""Image-caption training data from ANY energon captioning dataset, addressed by GLOBAL sample index.

What a sample becomes (the `models.data` contract, so `LlavaStageRunner` and the model are unchanged):

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
    preprocessing instead (`models.image_processor`: RGB, resize, center crop, rescale, normalise, the
    pixels transformers' processor gives) and is cut into the same patches; the processor's output
    size is `image_size` and `channels` is 3.
  * caption -> text: `[BOS] [PLACEHOLDER_ID] * tokens  prompt  caption  [EOS]  [PAD] ...`, cut or
    padded to seq_length + 1; the image placeholder span sits at the encoder's `offset` (= 1, right
    after BOS), as in `models.data`. `tokens` = the first seq_length, `labels` = the next token at
    each position, and `loss_mask` = 1 exactly where the label is a CAPTION token (the caption's
    tokens and its EOS, which ends the caption), 0 for the prompt, BOS, placeholders and padding.
    A caption longer than the sequence is cut (then without EOS).

Determinism across layouts. The samples of a run are ONE global stream, the same on every rank and
for every layout: global sample i is sample i % N of epoch i // N (N samples in the split), and epoch
e reads the split's stored positions (its shards in `split.yaml` order, each shard in tar order) in
the order `epoch_order(N, seed, e, shuffle)`: `random.Random(seed * 1_000_003 + e).shuffle` of
0..N-1, each epoch exactly a permutation of the split. Step t covers global samples [t*G, (t+1)*G).

What each rank reads. The reader is random access (`IndexSource`: `models.caption_index` over
energon's `.nv-meta/index.sqlite`; no process group, no layout). The stage runner asks `batch` for
the global indices a module's DP rank needs, and gets a lazy `RowBatch`: an encoder's first stage
reads `features`, so this rank decodes and patchifies exactly the images of its encoder rows; a
language stage reads `tokens`/`labels`/`loss_mask`, so it tokenises exactly the captions of its
language rows; a middle pipeline stage reads nothing. With --num-workers N > 0 a thread pool decodes
the same rows of the next step while this one computes (values are pure functions of the global
index: identical batches for any N); before this process forks, the workers finish and end.
Decoded rows are kept for the current and the previous step.

The loss-token count. `loss_tokens(step)`, the per-token normaliser every rank must agree on, is
counted from the caption text of the whole step: G caption members read (tens of bytes each, no
image read or decoded) and tokenised, each counted as `text_sample` masks it (`caption_loss_tokens`:
the caption's tokens + EOS that fit after BOS, the placeholders and the prompt). Exact, deterministic,
the same on every rank for any layout, and no communication; its cost is G tokenisations of short
text per step per rank (for the digits ~4 ms per step of 8).

Position (for checkpoints). Because the data is addressed by global index, the iteration number
alone fixes the position; `state_dict()` is plain data (ints and strings, JSON-safe, no pickle):
    {"consumed": C, "epoch": C // N, "index_in_epoch": C % N, "samples_per_epoch": N,
     "seed": ..., "split": ..., "shuffle": ..., "order": "permutation"}
where C is the number of global samples of the steps read so far. On restore `load_state_dict`
checks that seed, split, shuffle, N (and `order`, when the position has it) match (ValueError
otherwise: other data) and the reader is at C at once: one epoch permutation (~0.1 s per 100,000
samples) and indexed lookups, nothing replayed. Energon's own savable loader state is a pickle and is
never read.

Datasets the index does not read (`caption_index.indexable`: a metadataset, another sample type, or
a dataset that names code and runs under --trust-dataset-code) are read by `StreamSource`: energon's
loader as rank 0 of 1, epoch e shuffled by energon with seed offset `epoch_seed(seed, e)`, a position
reached by replay within the epoch, every sample's image decoded, no workers. The previous version of
this module read every dataset that way (the order of a run on the digits changed with this reader).

Trust. A dataset is data: every open first reads it as data (`models.dataset_trust`) and refuses one
that names code (energon Python files and imports, pickle/torch.load-decoded members) unless the
config says `trust_code` (`--trust-dataset-code`); the index reader decodes images only with PIL and
captions only as UTF-8 text, and energon's loader decodes with webdataset's secure mode on unless
trusted.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Optional

import torch

from megatron_hetero.models.caption_config import CaptionDataConfig
from megatron_hetero.models.caption_index import CaptionIndex, indexable
from megatron_hetero.models.data import PLACEHOLDER_ID
from megatron_hetero.models.dataset_trust import UntrustedDataset, check_dataset, secure_decoding
from megatron_hetero.models.image_processor import (
    ImageProcessor,
    caption_features,
    caption_format,
    check_fits,
    load_image_processor,
)
from megatron_hetero.models.tokenizer import CaptionTokenizer

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
):
    """(number of samples, iterator of single CaptioningSamples) over one epoch of `split`, read as
    rank 0 of 1 (no process group). shuffle False: the split's stored order. Every open checks the
    dataset first (`dataset_trust.check_dataset`: `UntrustedDataset` when it names code and not
    `trust_code`) and sets webdataset's secure decoding unless `trust_code`."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset
    from megatron.energon.errors import reraise_exception

    check_dataset(path, trust=trust_code)
    secure_decoding(trust_code)

    wc = WorkerConfig(
        rank=0, world_size=1, num_workers=0, seed_offset=epoch_seed(seed, epoch), global_error_handler=reraise_exception
    )  # a bad sample stops the run, never shifts indices
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
            )
        else:
            ds = get_val_dataset(path, split_part=split, worker_config=wc, batch_size=None)
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


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Stored split positions in the order epoch `epoch` reads them: `random.Random(epoch_seed(seed,
    epoch)).shuffle` of 0..n-1 (Python's Mersenne Twister and shuffle, stable across versions), or
    the stored order when not `shuffle`."""
    order = list(range(n))
    if shuffle:
        random.Random(epoch_seed(seed, epoch)).shuffle(order)
    return order


class IndexSource:
    """Global sample i -> key, caption, image by random access (`caption_index.CaptionIndex`): global
    sample i is split position `epoch_order(...)[i % N]` of epoch i // N. Positioning is O(1) (the
    epoch's permutation is computed once, ~0.1 s per 100,000 samples); nothing is replayed."""

    order = "permutation"
    replayed = 0  # never: kept for the same interface as StreamSource

    def __init__(self, cfg: CaptionDataConfig) -> None:
        self.cfg = cfg
        self.index = CaptionIndex(cfg.path, cfg.split)
        self.samples_per_epoch = len(self.index)
        self._orders: "OrderedDict[int, list[int]]" = OrderedDict()
        self._lock = threading.Lock()

    def position(self, i: int) -> int:
        epoch, j = divmod(i, self.samples_per_epoch)
        with self._lock:
            if epoch not in self._orders:
                c = self.cfg
                self._orders[epoch] = epoch_order(self.samples_per_epoch, c.seed, epoch, c.shuffle)
                while len(self._orders) > 2:
                    self._orders.popitem(last=False)
            return self._orders[epoch][j]

    def seek(self, i: int) -> None:
        self.position(i)

    def key(self, i: int) -> str:
        return self.index.key(self.position(i))

    def caption(self, i: int) -> str:
        return self.index.caption(self.position(i))

    def image(self, i: int) -> torch.Tensor:
        return self.index.image(self.position(i))


class StreamSource:
    """Global sample i -> key, caption, image through energon's own sequential loader (rank 0 of 1):
    for datasets the index reader does not read (`caption_index.indexable`: a metadataset, another
    sample type, a dataset that runs code under --trust-dataset-code). Epoch e is energon's shuffle
    with seed offset `epoch_seed(seed, e)`; reaching a position replays the epoch up to it (at most
    one epoch, ~1,800 samples/s for the digits on one core), and the last `window` samples read stay
    cached. Every sample read decodes its image (energon's loader does), wanted or not."""

    order = "energon-shuffle"

    def __init__(self, cfg: CaptionDataConfig, window: int = 64) -> None:
        self.cfg, self.window = cfg, window
        self._epoch, self._next, self._it = -1, 0, None
        self._cache: "OrderedDict[int, tuple[str, torch.Tensor, str]]" = OrderedDict()
        self.samples_per_epoch = self._open(0)
        self.replayed = 0  # samples read only to reach a position (restore, going back)

    def _open(self, epoch: int) -> int:
        c = self.cfg
        n, self._it = open_split(
            c.path,
            c.split,
            seed=c.seed,
            epoch=epoch,
            shuffle=c.shuffle,
            shuffle_buffer_size=c.shuffle_buffer_size,
            max_samples_per_sequence=c.max_samples_per_sequence,
            trust_code=c.trust_code,
        )
        self._epoch, self._next = epoch, 0
        return n

    def _take(self) -> tuple[str, torch.Tensor, str]:
        """The next sample energon gives, kept in the window (a step's rows come in any order)."""
        s = _next(self._it)
        out = (str(s.__key__), s.image, caption_text(s.caption))
        self._cache[self._epoch * self.samples_per_epoch + self._next] = out
        self._next += 1
        while len(self._cache) > self.window:
            self._cache.popitem(last=False)
        return out

    def seek(self, index: int) -> None:
        """Make sample `index` the next one energon reads (replaying the epoch up to it)."""
        epoch, j = divmod(index, self.samples_per_epoch)
        if epoch != self._epoch or j < self._next:
            self._open(epoch)
        while self._next < j:
            self._take()
            self.replayed += 1

    def read(self, index: int) -> tuple[str, torch.Tensor, str]:
        if index in self._cache:
            return self._cache[index]
        epoch, j = divmod(index, self.samples_per_epoch)
        if epoch == self._epoch and self._next <= j:
            while self._next <= j:  # reading ahead within the epoch is not a replay
                out = self._take()
            return out
        self.seek(index)
        return self._take()

    def key(self, i: int) -> str:
        return self.read(i)[0]

    def caption(self, i: int) -> str:
        return self.read(i)[2]

    def image(self, i: int) -> torch.Tensor:
        return self.read(i)[1]


def open_source(cfg: CaptionDataConfig, window: int = 64) -> "IndexSource | StreamSource":
    """The reader of `cfg.split`: `IndexSource` for a dataset that is plain data and indexable (the
    digits, any `energon prepare`d CaptioningSample folder), else `StreamSource`. Either way the
    dataset is checked first (`dataset_trust.check_dataset`: refused when it names code and not
    `trust_code`); a dataset that names code (trusted) is read by energon, which runs it."""
    found = check_dataset(cfg.path, trust=cfg.trust_code)
    secure_decoding(cfg.trust_code)
    if not found and indexable(cfg.path) is None:
        return IndexSource(cfg)
    return StreamSource(cfg, window=window)


#: every CaptionBatches of this process, quiesced before a fork (the fork launcher forks ranks)
_LIVE: "weakref.WeakSet[CaptionBatches]" = weakref.WeakSet()


def _quiesce_all() -> None:
    for b in list(_LIVE):
        b.quiesce()


os.register_at_fork(before=_quiesce_all)


class RowBatch(Mapping):
    """The rows `samples` of one step, as `models.data.batch` gives them (tokens, labels, loss_mask
    [rows, S], features {encoder: [rows, tokens, feature_dim]}), built on first access of each key:
    an encoder stage reads only `features` (images decoded), a language stage only the text keys
    (captions tokenised), a middle pipeline stage nothing."""

    _KEYS = ("tokens", "labels", "loss_mask", "features")

    def __init__(self, owner: "CaptionBatches", samples: range) -> None:
        self._owner, self._samples = owner, samples
        self._got: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(key)
        if key not in self._got:
            o = self._owner
            if key == "features":
                self._got[key] = {o.encoder: torch.stack([o.features(i) for i in self._samples])}
            else:
                self._got[key] = torch.stack([o.text(i)[key] for i in self._samples])
        return self._got[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)


class CaptionBatches:
    """The caption samples of a training run by global sample index, for one rank (see the module
    docstring): `batch(samples)` (lazy `RowBatch`), `loss_tokens(step)`, `keys(step)`, `step_batch`
    (a whole step, decoded: tests and tools), `state_dict`/`load_state_dict` (plain data).

    What this rank reads: the images of the rows an encoder stage asks for and the captions of the
    rows a language stage asks for (decoded once, kept for the current and the previous step), plus
    the caption text of every sample of a step for `loss_tokens`. `image_reads` / `text_reads` list
    the global samples whose image / text sample were built (tests count them).

    Workers (`num_workers` > 0, `train --num-workers`; index reader only): a thread pool that decodes
    images ahead. When a step's row is first asked for, the same row of the next step is submitted
    (a layout asks for the same rows of every step), so while step t computes, step t+1's images are
    decoded. The values are pure functions of the global index: the batches are identical for any N."""

    def __init__(
        self,
        cfg: CaptionDataConfig,
        tok: CaptionTokenizer,
        *,
        encoder: str,
        seq_length: int,
        global_batch: int,
        num_workers: Optional[int] = None,
    ) -> None:
        if not cfg.resolved():
            raise ValueError("CaptionBatches needs a resolved config (resolve_config)")
        workers = cfg.num_workers if num_workers is None else num_workers
        if workers < 0:
            raise ValueError(f"--num-workers {workers}: must be >= 0")
        self.cfg, self.tok, self.encoder = cfg, tok, encoder
        self.seq_length, self.global_batch = seq_length, global_batch
        self.source = open_source(cfg, window=2 * global_batch)
        if self.source.samples_per_epoch == 0:
            raise ValueError(f"--data-path {cfg.path}: split '{cfg.split}' is empty")
        self.num_workers = workers if isinstance(self.source, IndexSource) else 0
        self._pool: Optional[ThreadPoolExecutor] = None  # started on the first prefetch
        _LIVE.add(self)
        self._head = 1 + cfg.image_tokens + (len(tok.encode(cfg.prompt)) if cfg.prompt else 0)
        self._features: dict[int, Any] = {}  # global index -> features tensor, or a Future of it
        self._texts: dict[int, dict] = {}
        self._captions: dict[int, str] = {}
        self._loss: dict[int, int] = {}
        self._step = -1
        self.image_reads: list[int] = []
        self.text_reads: list[int] = []
        self.consumed = 0

    # -- per sample ------------------------------------------------------------------------------
    def _decode(self, i: int) -> torch.Tensor:
        self.image_reads.append(i)  # list.append is atomic: safe from worker threads
        return encoder_features(self.source.image(i), self.cfg)

    def features(self, i: int) -> torch.Tensor:
        """Encoder features [tokens, feature_dim] of global sample i (decoded once)."""
        self._touch(i)
        v = self._features.get(i)
        if v is None:
            v = self._features[i] = self._decode(i)
        elif isinstance(v, Future):
            v = self._features[i] = v.result()
        self._ahead(i, image=True)
        return v

    def caption(self, i: int) -> str:
        if i not in self._captions:
            self._captions[i] = self.source.caption(i)
        return self._captions[i]

    def text(self, i: int) -> dict:
        """tokens, labels, loss_mask [seq_length] of global sample i (tokenised once)."""
        self._touch(i)
        if i not in self._texts:
            self.text_reads.append(i)
            self._texts[i] = text_sample(
                self.caption(i),
                self.tok,
                seq_length=self.seq_length,
                image_tokens=self.cfg.image_tokens,
                prompt=self.cfg.prompt,
            )
        self._ahead(i, image=False)
        return self._texts[i]

    def _ahead(self, i: int, image: bool) -> None:
        """Submit the same row of the next step to the workers (images; captions are read by the
        caller: tokenisation stays on this thread)."""
        if not self.num_workers or not image:
            return
        j = i + self.global_batch
        if j not in self._features:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, "caption-data")
            self._features[j] = self._pool.submit(self._decode, j)

    def _touch(self, i: int) -> None:
        """Entering a new step: drop what is older than the previous step (and, after a jump back,
        what lies beyond the next one)."""
        step = i // self.global_batch
        if step == self._step:
            return
        self._step = step
        lo, hi = (step - 1) * self.global_batch, (step + 2) * self.global_batch
        for d in (self._features, self._texts, self._captions):
            for k in [k for k in d if not lo <= k < hi]:
                v = d.pop(k)
                if isinstance(v, Future):
                    v.cancel()
        for s in [s for s in self._loss if s < step - 1]:
            del self._loss[s]
        self.consumed = max(self.consumed, (step + 1) * self.global_batch)

    # -- per step --------------------------------------------------------------------------------
    def _rows(self, samples: range) -> int:
        step, lo = divmod(samples.start, self.global_batch)
        if lo + len(samples) > self.global_batch:
            raise ValueError(f"samples {samples} cross the end of step {step} (global batch {self.global_batch})")
        return step

    def batch(self, samples: range) -> RowBatch:
        """Global samples `samples` (within one step), stacked as `models.data.batch` stacks them;
        each key is built when first read (`RowBatch`)."""
        self._rows(samples)
        return RowBatch(self, samples)

    def loss_tokens(self, step: int) -> int:
        """Caption loss tokens of the whole global batch of `step`: every sample's caption text is
        read and tokenised (no image is decoded), and counted as `text_sample` masks it
        (`caption_loss_tokens`). Exact and the same on every rank, with no communication."""
        if step not in self._loss:
            g = self.global_batch
            self._touch(step * g)
            self._loss[step] = sum(
                caption_loss_tokens(self.caption(i), self.tok, seq_length=self.seq_length, head=self._head)
                for i in range(step * g, (step + 1) * g)
            )
        return self._loss[step]

    def keys(self, step: int) -> list[str]:
        """The sample keys of `step` (no decoding on the index reader)."""
        g = self.global_batch
        return [self.source.key(i) for i in range(step * g, (step + 1) * g)]

    def step_batch(self, step: int) -> dict:
        """Every sample of global step `step`, stacked: tokens, labels, loss_mask [G, S], features
        {encoder: [G, tokens, feature_dim]}, and keys, captions (lists). Decodes the whole step."""
        g = self.global_batch
        rows = self.batch(range(step * g, (step + 1) * g))
        return {
            **{k: rows[k] for k in ("tokens", "labels", "loss_mask", "features")},
            "keys": self.keys(step),
            "captions": [self.caption(i) for i in range(step * g, (step + 1) * g)],
        }

    def quiesce(self) -> None:
        """Let the submitted decodes finish and end the worker threads (a later prefetch starts new
        ones): run before this process forks (`os.register_at_fork`), so a forked rank never
        inherits a thread mid-decode holding a lock."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def close(self) -> None:
        """Stop the workers (pending decodes are dropped) and close this thread's file handles."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if isinstance(self.source, IndexSource):
            self.source.index.close()

    def state_dict(self) -> dict:
        n, c = self.source.samples_per_epoch, self.consumed
        return {
            "consumed": c,
            "epoch": c // n,
            "index_in_epoch": c % n,
            "samples_per_epoch": n,
            "seed": self.cfg.seed,
            "split": self.cfg.split,
            "shuffle": self.cfg.shuffle,
            "order": self.source.order,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict`: checks it is the same data (and, when saved, the
        same sample order); the index reader is then at the position at once, energon's replays to it.
        A position saved before `order` existed is read as this reader's order."""
        mine = self.state_dict()
        for k in ("samples_per_epoch", "seed", "split", "shuffle", "order"):
            if k == "order" and k not in state:
                continue
            if state.get(k) != mine[k]:
                raise ValueError(f"data position was saved for {k}={state.get(k)!r}, this run has {mine[k]!r}")
        c = int(state["consumed"])
        if c % self.global_batch:
            raise ValueError(
                f"data position: {c} consumed samples is not a whole number of global batches of {self.global_batch}"
            )
        for d in (self._features, self._texts, self._captions, self._loss):
            d.clear()
        self._step = -1
        self.consumed = c
        self.source.seek(c)


def heldout_batch(
    cfg: CaptionDataConfig,
    tok: CaptionTokenizer,
    *,
    encoder: str,
    seq_length: int,
    split: str = "val",
    limit: Optional[int] = None,
) -> dict:
    """Every sample of `split` in stored order (no shuffle), stacked as `CaptionBatches.step_batch`
    (for evaluation, e.g. `caption_eval.greedy_digit_accuracy`). Read by index where the dataset
    allows (`open_source`), else by energon's loader; the stored order is the same."""
    c = replace(cfg, split=split, shuffle=False)
    src = open_source(c)
    n = src.samples_per_epoch if limit is None else min(src.samples_per_epoch, limit)
    rows = [(src.key(i), src.image(i), src.caption(i)) for i in range(n)]
    texts = [
        text_sample(cap, tok, seq_length=seq_length, image_tokens=c.image_tokens, prompt=c.prompt) for *_, cap in rows
    ]
    return {
        "tokens": torch.stack([t["tokens"] for t in texts]),
        "labels": torch.stack([t["labels"] for t in texts]),
        "loss_mask": torch.stack([t["loss_mask"] for t in texts]),
        "features": {encoder: torch.stack([encoder_features(img, c) for _, img, _ in rows])},
        "keys": [k for k, *_ in rows],
        "captions": [cap for *_, cap in rows],
    }
