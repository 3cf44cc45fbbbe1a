"""The stage runner for image-caption data: `LlavaStageRunner` with its samples from an energon
captioning dataset (`data.caption_batches.CaptionBatches`) instead of the synthetic `data.samples`.

Everything else (encoder and language stages, edge and stage tensors, the loss) is LlavaStageRunner's
own code; this class changes where a micro-batch's samples come from (`batch`) and the per-step
normaliser (`loss_tokens`: the caption tokens of that step's whole global batch).

What each rank reads (energon_data's docstring): `batch(samples)` is a lazy `RowBatch`, so an encoder's
first stage decodes the images of the rows its DP rank consumes (`features`), a language stage
tokenises the captions of its rows (`tokens`, `labels`, `loss_mask`), and a middle pipeline stage reads
nothing. `loss_tokens(step)` reads the caption text of the whole step (no image) on every rank; the
count is exact and needs no communication.

`caption_runner_factory(data, spec, global_batch)` is what a trainer plugs in:
    runner = factory(plan, states) if factory else None
    schedule = make_schedule(plan, job, topo, states, runner=runner)
and `caption_job_data(req, spec)` what `train --data-path DIR` does in the launching process: the
resolved `CaptionDataConfig` and the model spec fitted to the data and the tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megatron_hetero.config.data import DataRequest
from megatron_hetero.models.caption_eval import digit_hits
from megatron_hetero.data.dataset_trust import check_dataset, trusted_message
from megatron_hetero.data.caption_batches import CaptionBatches
from megatron_hetero.data.caption_reader import heldout_batch
from megatron_hetero.data.energon_data import CaptionDataConfig, caption_spec, resolve_config
from megatron_hetero.models.llava import LlavaSpec
from megatron_hetero.models.llava_runner import LlavaStageRunner
from megatron_hetero.data.tokenizer import load_tokenizer
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.models.cp_attention import cp_chunk_positions

#: the energon split evaluation reads (`megatron-hetero data digits` registers its held-out shard as `val`)
HELDOUT_SPLIT = "val"


class CaptionStageRunner(LlavaStageRunner):
    """`LlavaStageRunner` over caption data (see the module docstring).

    Evaluation (`set_eval(True)`): `batch` reads the held-out split (`HELDOUT_SPLIT`, in stored order;
    the step's global sample i is held-out sample i mod N), `loss_tokens` counts its caption tokens,
    and the loss stage counts greedy digit captions (`caption_eval.digit_hits`, teacher-forced: one
    forward of the training graph) on the ranks that count the loss (last stage, TP rank 0, CP rank
    0 after a gather of the CP ranks' positions). `take_eval_counts()` returns and resets this
    rank's (hits, samples); the trainer sums them over the world."""

    def __init__(
        self,
        spec: LlavaSpec,
        plan: RankPlan,
        states: dict[str, ModuleState],
        data: CaptionBatches,
        heldout: Optional[dict] = None,
    ) -> None:
        super().__init__(spec, plan, states)
        if data.global_batch != plan.global_batch:
            raise ValueError(f"caption data global batch {data.global_batch} != plan's {plan.global_batch}")
        self.data = data
        self._heldout: Optional[dict] = heldout  # read on first use unless given (see caption_runner_factory)
        self._counts = [0, 0]  # (hits, samples) of the evaluation so far on this rank
        self.keep_eval_logits = False  # tests: keep (full logits, labels, mask) of each counted micro-batch
        self.eval_record: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # -- held-out data ---------------------------------------------------------------------------
    def heldout(self) -> dict:
        if self._heldout is None:
            d = self.data
            self._heldout = read_heldout(d.cfg, d.tok, d.encoder, d.seq_length)
        return self._heldout

    def heldout_size(self) -> int:
        return len(self.heldout()["keys"])

    def _heldout_rows(self, samples: range) -> dict:
        h = self.heldout()
        idx = torch.tensor([i % len(h["keys"]) for i in samples], dtype=torch.long)
        return {
            "tokens": h["tokens"][idx],
            "labels": h["labels"][idx],
            "loss_mask": h["loss_mask"][idx],
            "features": {n: f[idx] for n, f in h["features"].items()},
        }

    def batch(self, samples: range) -> dict:
        if self.evaluating:
            return self._heldout_rows(samples)
        return self.data.batch(samples)

    def loss_tokens(self, step: int) -> int:
        if self.evaluating:
            g = self.plan.global_batch
            return int(self._heldout_rows(range(step * g, (step + 1) * g))["loss_mask"].sum().item())
        return self.data.loss_tokens(step)

    # -- caption accuracy ------------------------------------------------------------------------
    def eval_logits(self, module: str, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        got = gathered_eval_ids(self, module, logits, labels, mask)
        if got is None:
            return
        logits, ids, labels, mask = got
        self._counts[0] += digit_hits(ids, labels, mask, self.data.tok)
        self._counts[1] += ids.shape[0]
        if self.keep_eval_logits:
            self.eval_record.append((logits, labels, mask))

    def take_eval_counts(self) -> tuple[int, int]:
        out, self._counts = tuple(self._counts), [0, 0]
        return out


def gathered_eval_ids(
    runner: LlavaStageRunner, module: str, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """What an evaluation counts from a loss stage's `eval_logits` (see `CaptionStageRunner`):
    (logits with the whole vocabulary, greedy ids, labels, loss mask), the last three over the whole
    sequence, on CPU, on the rank that counts (TP rank 0, CP rank 0 of the module); None on the others.
    The vocabulary is gathered over TP and the positions over CP (collectives: every TP/CP rank of the
    module calls this)."""
    import torch.distributed as dist

    me, pgs = runner.plan.modules[module], runner.states[module].pgs
    tp = pgs.tp.size()
    if tp > 1:  # the vocabulary is split over TP: gather it (tiny: rows x seq x vocab)
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=pgs.tp)
        logits = torch.cat(parts, dim=-1)
    ids = logits.argmax(-1)
    if me.cp > 1:  # every CP rank holds some positions: put the sequence together
        seq = runner.spec.seq_length
        full = []
        for t in (ids, labels, mask):
            parts = [torch.empty_like(t) for _ in range(me.cp)]
            dist.all_gather(parts, t.contiguous(), group=pgs.cp)
            out = torch.zeros((t.shape[0], seq), dtype=t.dtype, device=t.device)
            for c, part in enumerate(parts):
                out[:, cp_chunk_positions(seq, c, me.cp).to(t.device)] = part
            full.append(out)
        ids, labels, mask = full
    if me.coord.tp != 0 or me.coord.cp != 0:
        return None
    return logits.cpu(), ids.cpu(), labels.cpu(), mask.cpu()


def read_heldout(cfg: CaptionDataConfig, tok, encoder: str, seq_length: int) -> dict:
    """The whole held-out split (`HELDOUT_SPLIT`), stacked (`caption_reader.heldout_batch`)."""
    out = heldout_batch(cfg, tok, encoder=encoder, seq_length=seq_length, split=HELDOUT_SPLIT)
    if not out["keys"]:
        raise ValueError(f"--data-path {cfg.path}: the held-out split '{HELDOUT_SPLIT}' is empty")
    return out


def caption_runner_factory(
    data: CaptionDataConfig, spec: LlavaSpec, global_batch: int, heldout: bool = False
) -> Callable[[RankPlan, dict[str, ModuleState]], CaptionStageRunner]:
    """A function (plan, states) -> CaptionStageRunner for one rank. `data` must be resolved
    (`energon_data.resolve_config`) and `spec` made by `energon_data.caption_spec`, both in the
    launching process, so every rank shapes samples the same way. The loader opens on the rank.
    `heldout`: read the held-out split first, before the training stream opens. (Read later, while
    the training loader is open, the held-out loader's release leaves the training loader's reads
    10-20x slower for the rest of the run: energon 7.4.1 on CPU, measured.)"""
    (encoder,) = spec.encoders

    def make(plan: RankPlan, states: dict[str, ModuleState]) -> CaptionStageRunner:
        if data.trust_code and plan.rank == 0:  # said once per run, by rank 0
            print(trusted_message(data.path, data.trusted), flush=True)
        tok = load_tokenizer(data.tokenizer_model)
        held = read_heldout(data, tok, encoder, spec.seq_length) if heldout else None
        batches = CaptionBatches(data, tok, encoder=encoder, seq_length=spec.seq_length, global_batch=global_batch)
        return CaptionStageRunner(spec, plan, states, batches, heldout=held)

    return make


def caption_job_data(req: DataRequest, spec: LlavaSpec) -> tuple[LlavaSpec, Optional[CaptionDataConfig]]:
    """`train`'s data flags -> (spec, data config), in the launching process (and on every rank under
    torchrun/srun: deterministic). Without --data-path: (spec, None), the synthetic data (--mock-data).
    With it: the dataset's image format resolved (`energon_data.resolve_config`), and `spec` with the
    encoder's tokens/feature_dim from the data and the vocabulary from the tokenizer
    (`energon_data.caption_spec`). `req`: train's data flags, --seed, and the model flags
    --vocab-size, --encoder-tokens, --encoder-feature-dim (None: not given), as its door read them. ValueError for conflicting or
    impossible values, and `dataset_trust.UntrustedDataset` (a ValueError) for a dataset that names
    code without --trust-dataset-code."""
    path, tokenizer_model = req.data_path, req.tokenizer_model
    if not path:
        if tokenizer_model:
            raise ValueError("--tokenizer-model applies to --data-path (the synthetic data has no text)")
        return spec, None
    if req.mock_data:
        raise ValueError(f"--mock-data and --data-path {path}: give one (synthetic or real data)")
    if req.max_image_tiles:
        raise ValueError(f"--max-image-tiles: applies to conversation data; --data-path {path} holds captions")
    # before energon opens it: a dataset that names code is refused unless --trust-dataset-code
    trust = req.trust_code
    trusted = tuple(f.line() for f in check_dataset(path, trust=trust))
    # a CLIP encoder fixes the image format: RGB, its image size (images are resized), its patch size
    clip = next((e for e in spec.encoders.values() if e.kind == "clip"), None)
    side = round(clip.tokens**0.5) * clip.patch_size if clip else None
    patch = req.patch_size or DataRequest.patch_size  # --patch-size 0: the default, as ever
    # a Qwen2.5-VL tower reads one pixel block a merged token (`models.qwen_encoder.blocks_to_patches`)
    qwen = next((e for e in spec.encoders.values() if e.kind == "qwen2.5-vl"), None)
    if qwen is not None:
        patch = qwen.merge_size * qwen.patch_size
        if req.image_processor:
            raise ValueError(
                "--image-processor: a Qwen2.5-VL tower on caption data reads each merged token's pixel block "
                "(scaled to [-1, 1]); its native-resolution processor is not wired into the data yet"
            )
    cfg = resolve_config(
        CaptionDataConfig(
            path=str(path),
            tokenizer_model=tokenizer_model,
            trust_code=trust,
            trusted=trusted,
            seed=int(req.seed),
            patch_size=clip.patch_size if clip else int(patch),
            image_size=(side, side) if clip else None,
            channels=3 if clip else None,
            prompt=req.prompt,
            image_processor=req.image_processor,
            num_workers=int(req.num_workers),
        )
    )
    for flag, given, derived in (
        ("--encoder-tokens", req.encoder_tokens, cfg.image_tokens),
        ("--encoder-feature-dim", req.encoder_feature_dim, cfg.feature_dim),
    ):
        if given is not None and given != derived:
            h, w = cfg.image_size
            raise ValueError(
                f"{flag} {given}: --data-path {path} gives {derived} ({h}x{w} images, {cfg.channels} "
                f"channel(s), --patch-size {cfg.patch_size}: tokens = (H/p)*(W/p), features = C*p*p); "
                f"leave it out or change --patch-size"
            )
    tok = load_tokenizer(cfg.tokenizer_model)
    out = caption_spec(spec, cfg, tok, vocab_size=req.vocab_size)
    if qwen is not None:  # the image's rows of merged tokens
        out = dataclasses.replace(
            out,
            encoders={
                n: dataclasses.replace(e, image_rows=cfg.image_size[0] // patch) for n, e in out.encoders.items()
            },
        )
    return out, cfg
