"""The tiny LLaVA model's stage runner: what the schedules call to build a micro-batch's inputs and
run a stage (`runtime.stage_runner.StageRunner`).

Data comes from `data/samples.py` by global sample index, so every layout sees the same samples.
Tensors crossing edges are `[rows, tokens, hidden]`: encoder tokens (from the projector); between
language segments, the hidden states of this CP rank's positions; from the language model to its
output modules, its final hidden states over the span of text positions the output heads read
(`output_span`; each head takes its own positions from it); between pipeline stages Megatron's
`[seq, rows, hidden]`, under sequence parallelism (`--sequence-parallel`, a language module with
tp > 1) this TP rank's `[seq/tp, rows, hidden]` (Megatron's P2P shape); tensors crossing edges stay
full-sequence and TP-replicated (the language module gathers over TP before a tensor leaves it and
scatters after one enters: `LanguageModule.from_sequence_shards` / `to_sequence_shards`).

Losses: the language loss (per-token cross entropy) and each output head's loss (squared error
against a deterministic target, mean over `out_dim`, summed over tokens) are loss sums normalised
by the same global count of language loss tokens. With experts, Megatron's load-balancing loss
enters the gradient with the weight of the micro-batch's tokens over that count (the scale Megatron
uses with per-token loss: `MoEAuxLossAutoScaler` scale 1/loss_tokens), and `aux_losses` reports it.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Union

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge
from megatron_hetero.data import synthetic
from megatron_hetero.models import image_tokens
from megatron_hetero.models.cp_attention import cp_chunk_positions
from megatron_hetero.models.llava import LlavaSpec, OutputSpec, data_config, dtype_of
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum, StageRunner
from megatron_hetero.runtime.step import loss_normaliser
from megatron_hetero.models.qwen_positions import batch_mrope_ids, grid_mrope_ids
from megatron_hetero.runtime.loss_scale import loss_scale_of

#: evaluation on the synthetic data reads global samples EVAL_OFFSET + i, which no training step reaches
EVAL_OFFSET = 1 << 40


class LlavaStageRunner(StageRunner):
    """Stage runner of `models/llava.py` on one rank (see the module docstring)."""

    def __init__(self, spec: LlavaSpec, plan: RankPlan, states: dict[str, ModuleState]) -> None:
        self.spec, self.plan, self.states = spec, plan, states
        self.dcfg = data_config(spec)
        self.variable = {n for n, e in spec.encoders.items() if e.max_tiles}  # variable image tokens
        self._loss_tokens: dict[int, int] = {}  # first sample of a step -> its loss tokens
        self.device = get_device()
        self._aux = torch.zeros((), dtype=torch.float64)
        self._langs = set(plan.roles.language)
        # evaluation mode (`set_eval`, `train --eval-interval`): `batch` reads held-out samples (a
        # step's global sample i is held-out sample i) and the loss stage also hands its logits to
        # `eval_logits`
        self.evaluating = False

    def batch(self, samples: range) -> dict:
        """The global samples `samples` (`data.samples.batch`'s keys): the one place stages read data."""
        start = samples.start + (EVAL_OFFSET if self.evaluating else 0)
        return synthetic.batch(self.dcfg, start, len(samples))

    def eval_logits(self, module: str, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
        """Evaluation hook of the loss stage: this rank's logits [rows, s_local, vocab/tp] (vocab-parallel
        over the module's TP group) with the labels and loss mask [rows, s_local] at its CP positions."""

    def loss_modules(self) -> tuple[str, ...]:
        return self.plan.roles.loss_modules

    def output_span(self) -> tuple[int, int]:
        """Text positions [start, end) of the language model's hidden states its output modules read."""
        outs = [self.spec.outputs[n] for n in self.plan.roles.outputs]
        return min(o.offset for o in outs), max(o.offset + o.tokens for o in outs)

    def aux_losses(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's share of the load-balancing loss as it entered the gradient this step (counted on
        TP rank 0 of the language model's ranks: TP replicas route the same tokens); resets it."""
        out, self._aux = self._aux, torch.zeros((), dtype=torch.float64)
        if not self.spec.num_experts:
            return {}
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        return {"aux_loss": out}

    def loss_tokens(self, step: int) -> int:
        g = self.plan.global_batch
        start = step * g + (EVAL_OFFSET if self.evaluating else 0)
        if start not in self._loss_tokens:
            self._loss_tokens = {start: synthetic.loss_tokens(self.dcfg, start, g)}  # one step at a time
        return self._loss_tokens[start]

    def image_tiles(self, samples: range) -> dict[str, list[int]]:
        """Tiles per sample of the global samples `samples` for each variable encoder, from the data's
        metadata (no image read): what sizes a boundary call of variable image tokens."""
        start = samples.start + (EVAL_OFFSET if self.evaluating else 0)
        return synthetic.image_tiles(self.dcfg, start, len(samples))

    def image_grids(self, samples: range) -> Optional[dict[str, list[list[tuple[int, int]]]]]:
        """{encoder: per sample its images' (rows, cols) of merged tokens} where the data gives each
        image its own grid (a Qwen2.5-VL tower on conversation data: `models.chat_runner`), from the
        data's metadata (no image read; every rank derives it, nothing crosses the wire); None on the
        synthetic data (a sample's tiles are one image: `qwen_encoder.tile_grid_thw`)."""
        return None

    def call_samples(self, samples: range) -> range:
        """The global samples of the boundary call that carries `samples`: the step's global batch
        (colocated: one call per step) or their micro-batch (disjoint)."""
        n = self.plan.global_batch if self.plan.layout.placement == "colocated" else self.plan.micro_batching.samples
        first = samples.start // n * n
        return range(first, first + n)

    def edge_seq(self, edge: Edge, samples: range) -> Optional[int]:
        """A variable encoder's edge: its call's longest tile run (`image_tokens.edge_seq`), a
        multiple of 2*cp of the language model's CP (the boundary's chunking); else None (fixed)."""
        if edge.src not in self.variable:
            return None
        multiple = 1  # the boundary cuts the edge into 2*cp chunks on either side
        for cp in (self.plan.layout.module(edge.src).cp, self.plan.layout.module(edge.dst).cp):
            multiple = math.lcm(multiple, 2 * cp if cp > 1 else 1)
        tiles = self.image_tiles(samples)[edge.src]
        return image_tokens.edge_seq(tiles, self.spec.encoders[edge.src].tokens, multiple)

    def edge_seqs(self, edge: Edge) -> list[int]:
        """Every sequence length a boundary call of `edge` can carry on this job's data: the fixed
        one, or for a variable encoder `edge_seq` of every longest tile run 0..max_tiles (`dryrun`
        plans each)."""
        t = self.edge_tensor(edge)
        if t.seq is not None:
            return [t.seq]
        multiple = 1
        for cp in (self.plan.layout.module(edge.src).cp, self.plan.layout.module(edge.dst).cp):
            multiple = math.lcm(multiple, 2 * cp if cp > 1 else 1)
        enc = self.spec.encoders[edge.src]
        return sorted({image_tokens.edge_seq([k], enc.tokens, multiple) for k in range(enc.max_tiles + 1)})

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        spec = self.spec
        if edge.src in self.variable:  # its length per boundary call: edge_seq
            return EdgeTensor(seq=None, hidden=spec.hidden_size, dtype=dtype_of(spec))
        if edge.src in spec.encoders:
            enc = spec.encoders[edge.src]
            return EdgeTensor(
                seq=enc.tokens,
                hidden=spec.hidden_size,
                dst_seq=spec.seq_length,
                dst_offset=enc.offset,
                dtype=dtype_of(spec),
            )
        if edge.dst in spec.outputs:
            start, end = self.output_span()
            return EdgeTensor(seq=end - start, hidden=spec.hidden_size, dtype=dtype_of(spec))
        return EdgeTensor(seq=spec.seq_length, hidden=spec.hidden_size, dtype=dtype_of(spec))

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        spec = self.spec
        if module in spec.encoders:
            enc = spec.encoders[module]
            return (enc.stage_tokens, rows, enc.hidden_size), dtype_of(spec)
        me = self.plan.modules[module]
        seq = spec.seq_length // me.cp
        state = self.states.get(module)
        if state is not None and getattr(state.module, "sequence_parallel", False):
            seq //= self.plan.layout.module(module).tp  # this TP rank's sequence shard (Megatron's P2P shape)
        return (seq, rows, spec.hidden_size), dtype_of(spec)

    def model(self, module: str) -> torch.nn.Module:
        return self.states[module].model

    def forward(
        self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input: Optional[torch.Tensor]
    ) -> Union[torch.Tensor, LossSum]:
        if module in self.spec.encoders:
            return self._encoder(module, samples, stage_input)
        if module in self.spec.outputs:
            return self._output(module, samples, inputs)
        return self._language(module, samples, inputs, stage_input)

    def _output(self, module: str, samples: range, inputs: Mapping[str, torch.Tensor]) -> LossSum:
        (x,) = inputs.values()  # [rows, span, hidden] from the language model
        o: OutputSpec = self.spec.outputs[module]
        start, _ = self.output_span()
        x = x[:, o.offset - start : o.offset - start + o.tokens]
        y = self.states[module].model(x)
        target = output_target(self.spec.seed, module, o, samples).to(device=y.device, dtype=y.dtype)
        loss_sum = (y - target).pow(2).mean(-1).sum()
        return LossSum(loss_sum, torch.tensor(y.shape[0] * y.shape[1], dtype=torch.int))

    def _encoder(self, module: str, samples: range, stage_input: Optional[torch.Tensor]) -> torch.Tensor:
        x = stage_input
        if module in self.variable:  # [tiles, T, f] -> [tiles, T, h] -> the call's [rows, seq, h]
            b = self.batch(samples)
            x, tiles = b["features"][module].to(self.device, dtype_of(self.spec)), b["tiles"][module].tolist()
            seq = self.edge_seq(Edge(module, self.plan.roles.first_language), self.call_samples(samples))
            state, cp = self.states[module], self.plan.modules[module].cp
            if not tiles or sum(tiles) == 0:  # text only: a zero tile keeps the module in the graph, times 0
                y = state.model(x.new_zeros(1, *x.shape[1:]))
                keep = 0 * y.sum()
                y = y[:0]
            elif self.spec.encoders[module].kind == "qwen2.5-vl":  # a sample's tiles are one image, or its grids
                grids = self.image_grids(samples)
                y, keep = state.model(x, tiles=tiles, grids=None if grids is None else grids[module]), None
            else:
                y, keep = state.model(x), None
            if cp > 1:  # each CP rank holds its chunks of every tile: gather the tiles, keep its edge chunks
                y = image_tokens.gather_cp_chunks(y, state.pgs.cp, cp)
            out = image_tokens.pack_tiles(y, tiles, seq)
            if cp > 1:
                out = out.index_select(1, cp_chunk_positions(seq, state.pgs.cp.rank(), cp).to(out.device))
            return out if keep is None else out + keep
        if x is None:  # the first stage reads this rank's features
            x = self.batch(samples)["features"][module].to(self.device, dtype_of(self.spec))
        return self.states[module].model(x)

    def _language(
        self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input: Optional[torch.Tensor]
    ) -> Union[torch.Tensor, LossSum]:
        lang, model, me = self.states[module].module, self.states[module].model, self.plan.modules[module]
        b = self.batch(samples)
        hidden = None
        attention_mask, position_ids = self._document_masks(b["tokens"])
        native = [n for n in sorted(self.variable) if self.spec.encoders[n].kind == "qwen2.5-vl"]
        if native:  # M-RoPE ids per image size (one Qwen2.5-VL encoder: its image per row)
            (name,) = native
            grids = self.image_grids(samples)
            if grids is not None:  # each image its own grid (several a row, any sizes)
                lang.set_mrope_ids(grid_mrope_ids(b["image_mask"][name], grids[name]))
            else:
                tiles = self.image_tiles(samples)[name]
                lang.set_mrope_ids(batch_mrope_ids(self.spec.encoders[name], b["image_mask"][name], tiles))
        if lang.first_stage:
            masks = {n: b["image_mask"][n] for n in self.variable} if self.variable else None
            hidden = lang.embed(b["tokens"].to(self.device), dict(inputs), masks, position_ids)
        elif stage_input is not None:
            lang.set_input_tensor(stage_input)
        elif inputs:  # the previous language segment's hidden states, [rows, seq, hidden]
            (x,) = inputs.values()
            lang.set_input_tensor(lang.to_sequence_shards(x.transpose(0, 1).contiguous()))
        if not lang.last_stage:
            out = self._with_aux(lang, me, samples, lambda: model(hidden, None, attention_mask))
            if me.last_stage:  # a segment's end crosses an edge: the whole sequence, [rows, seq, hidden]
                return lang.from_sequence_shards(out).transpose(0, 1).contiguous()
            return out
        idx = lang.cp_positions()
        labels = b["labels"][:, idx].to(self.device)
        mask = b["loss_mask"][:, idx].to(self.device)
        if self.evaluating:  # the same loss, from the logits the evaluation also reads
            logits = self._with_aux(
                lang, me, samples, lambda: model(hidden, None, attention_mask)
            )  # [b, s_local, V/tp]
            # a copy first: Megatron's vocab-parallel cross entropy works in place on the logits
            self.eval_logits(module, logits.detach().clone(), labels, mask)
            per_token = lang.gpt.compute_language_model_loss(labels, logits.transpose(0, 1).contiguous())
        else:
            per_token = self._with_aux(lang, me, samples, lambda: model(hidden, labels, attention_mask))
        out = None
        if self.plan.roles.outputs and me.last_stage and module == self.plan.roles.last_language:
            start, end = self.output_span()  # cp == 1 here (validated): positions are global
            out = lang.last_hidden[start:end].transpose(0, 1).contiguous()
        return LossSum((per_token * mask).sum(), mask.sum().to(torch.int), out)

    def _document_masks(self, tokens: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Megatron's --reset-attention-mask / --reset-position-ids on `tokens` [b, S] (EOD: the
        vocabulary's last id), with Megatron-core's own `_get_ltor_masks_and_position_ids` per row:
        (attention mask [b, 1, S, S] True where masked, or None: causal; position ids [b, S], or None)."""
        spec = self.spec
        if not (spec.reset_attention_mask or spec.reset_position_ids):
            return None, None
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

        rows = [
            _get_ltor_masks_and_position_ids(
                t, spec.vocab_size - 1, spec.reset_position_ids, spec.reset_attention_mask, True, True
            )
            for t in tokens
        ]
        mask = torch.stack([r[0] for r in rows]).to(self.device) if spec.reset_attention_mask else None
        pos = torch.stack([r[2] for r in rows]).to(self.device) if spec.reset_position_ids else None
        return mask, pos

    def _with_aux(self, lang, me, samples: range, run):
        """Run a language stage's forward; with experts, set the scale of the load-balancing loss's
        gradient (1/loss tokens, the per-token convention) and account what it adds this micro-batch."""
        if not self.spec.num_experts:
            return run()
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_moe_layer_wise_logging_tracker

        # times the whole model's loss scale under --fp16, as the loss itself (runtime.loss_scale)
        tokens = loss_normaliser(self.loss_tokens(samples.start // self.plan.global_batch))
        scale = 1.0 / tokens * loss_scale_of(self.states)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([scale], device=self.device))

        def total() -> float:
            # re-read each time: 0.19's call returns a fresh dict view of the metrics tracker
            t = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
            return float(t["values"].sum()) if t is not None else 0.0

        before = total()
        result = run()
        # TP replicas route the same tokens, so TP rank 0 counts them; under sequence parallelism each TP
        # rank routes its own shard and holds its part of the loss (summed over the world below)
        if me.coord.tp == 0 or lang.sequence_parallel:
            local_tokens = len(samples) * self.spec.seq_length // me.cp
            self._aux += (total() - before) * self.spec.moe_aux_loss_coeff * local_tokens / tokens
        return result


def output_target(seed: int, module: str, o: OutputSpec, samples: range) -> torch.Tensor:
    """The target of output head `module` for the global samples `samples`: [rows, tokens, out_dim],
    deterministic per (seed, module, sample index), independent of any layout."""
    rows = []
    for i in samples:
        g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (sum(map(ord, module)) + 1) + i)
        rows.append(torch.randn(o.tokens, o.out_dim, generator=g))
    return torch.stack(rows)
