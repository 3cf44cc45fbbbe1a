"""`CaptionBatches`: one rank's view of a training run's caption samples, addressed by GLOBAL sample
index (`data.caption_reader`), in the `data.samples` batch contract (`data.energon_data` shapes
each sample).

Determinism across layouts. The samples of a run are ONE global stream, the same on every rank and
for every layout: global sample i is sample i % N of epoch i // N (N samples in the split), and epoch
e reads the split's stored positions (its shards in `split.yaml` order, each shard in tar order) in
the order `epoch_order(N, seed, e, shuffle)`: `random.Random(seed * 1_000_003 + e).shuffle` of
0..N-1, each epoch exactly a permutation of the split. Step t covers global samples [t*G, (t+1)*G).

What each rank reads. The reader is random access (`IndexSource`: `data.caption_index` over
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

"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.data.caption_reader import IndexSource, open_source
from megatron_hetero.data.energon_data import caption_loss_tokens, encoder_features, text_sample
from megatron_hetero.data.tokenizer import CaptionTokenizer

#: every CaptionBatches of this process, quiesced before a fork (the fork launcher forks ranks)
_LIVE: "weakref.WeakSet[CaptionBatches]" = weakref.WeakSet()


def _quiesce_all() -> None:
    for b in list(_LIVE):
        b.quiesce()


os.register_at_fork(before=_quiesce_all)


class RowBatch(Mapping):
    """The rows `samples` of one step, as `data.samples.batch` gives them (tokens, labels, loss_mask
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
            self._got[key] = self._build(key)
        return self._got[key]

    def _build(self, key: str) -> Any:
        """The value of `key` (one of `_KEYS`) for the rows: what a subclass with more keys extends."""
        o = self._owner
        if key == "features":
            return {o.encoder: torch.stack([o.features(i) for i in self._samples])}
        return torch.stack([o.text(i)[key] for i in self._samples])

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
        source: Optional[IndexSource] = None,
    ) -> None:
        """`source`: the reader of global samples (default `open_source(cfg)`); `chat_batches` gives
        an `IndexSource` over its conversation index."""
        if not cfg.resolved():
            raise ValueError("CaptionBatches needs a resolved config (resolve_config)")
        workers = cfg.num_workers if num_workers is None else num_workers
        if workers < 0:
            raise ValueError(f"--num-workers {workers}: must be >= 0")
        self.cfg, self.tok, self.encoder = cfg, tok, encoder
        self.seq_length, self.global_batch = seq_length, global_batch
        self.source = open_source(cfg, window=2 * global_batch) if source is None else source
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
        """Global samples `samples` (within one step), stacked as `data.samples.batch` stacks them;
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
