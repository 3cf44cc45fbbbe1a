"""The seam between the schedules and a model: the `StageRunner` base class.

The schedules (`colocated.py`, `disjoint.py`) know plans, process groups, boundaries and optimizers,
and no model. A model side (the tiny LLaVA model in `models/llava_runner.py`, a test's toy model)
subclasses it for the modules this rank serves.

Tensor conventions the schedules rely on:
  * a tensor crossing a module edge is `[batch rows, seq, hidden]` (what `edge_tensor` describes);
  * a tensor between two pipeline stages of one module has the shape `stage_tensor` returns
    (Megatron's `[seq, batch rows, hidden]` for transformer stages);
  * `forward` on a module's last stage returns the edge tensor (`[b, s, h]`), or a `LossSum` on the
    last stage of a module listed in `loss_modules`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Union

import torch

from megatron_hetero.layout.spec import Edge


@dataclass(frozen=True)
class EdgeTensor:
    """What crosses an edge per sample: `seq` tokens of `hidden` features; `dst_seq`/`dst_offset`
    when the tokens are inserted into a longer destination sequence at positions
    [dst_offset, dst_offset + seq) (image tokens at their placeholders). `seq` None: the length
    differs per boundary call (variable image tokens), `StageRunner.edge_seq` gives it."""

    seq: Optional[int]
    hidden: int
    dst_seq: Optional[int] = None
    dst_offset: int = 0
    dtype: torch.dtype = torch.float32


class LossSum(NamedTuple):
    """A loss stage's result for one micro-batch on this rank: the sum of its per-token losses over
    its loss tokens (a 0-d tensor that carries the graph), and the number of those tokens. A loss
    stage that also feeds modules after it (the language model before an output head) sets `output`:
    the edge tensor `[b, s, h]` it sends on its outgoing edges; its backward then takes the loss and
    the gradient of `output` together."""

    loss_sum: torch.Tensor
    tokens: torch.Tensor
    output: Optional[torch.Tensor] = None


class StageRunner:
    """The model side of a training step, for the modules this rank serves. Subclasses implement the
    six required methods (they raise NotImplementedError here); the evaluation and auxiliary-loss
    hooks have defaults that do nothing, so every method a caller uses is declared here."""

    #: True between `set_eval(True)` and `set_eval(False)`
    evaluating: bool = False
    #: what `take_eval_counts` counts, as the validation line names it: (accuracy, counted items)
    accuracy_name: tuple[str, str] = ("caption accuracy", "held-out samples")

    # -- required --------------------------------------------------------------------------------
    def loss_modules(self) -> tuple[str, ...]:
        """Modules whose last pipeline stage returns a `LossSum`."""
        raise NotImplementedError

    def loss_tokens(self, step: int) -> int:
        """Loss tokens of the whole global batch of `step` (the per-token loss normaliser)."""
        raise NotImplementedError

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        """Per-sample shape of the tensor crossing `edge`."""
        raise NotImplementedError

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the tensor between two pipeline stages of `module` for `rows` samples."""
        raise NotImplementedError

    def model(self, module: str) -> torch.nn.Module:
        """The (DDP-wrapped when it trains) model chunk of `module` on this rank, as Megatron's
        pipeline schedules take it."""
        raise NotImplementedError

    def forward(
        self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input: Optional[torch.Tensor]
    ) -> Union[torch.Tensor, LossSum]:
        """Run this rank's stage of `module` over the global samples `samples`.

        `inputs`: on a module's first stage, the tensors received over its incoming edges, by
        producer module (`[rows, seq, hidden]`, this rank's DP/CP share). `stage_input`: on a later
        stage, the tensor received from the previous stage (None when Megatron's schedule has set
        it with `set_input_tensor`)."""
        raise NotImplementedError

    # -- optional, with defaults -----------------------------------------------------------------
    def edge_seq(self, edge: Edge, samples: range) -> Optional[int]:
        """The sequence length of `edge`'s tensor for the boundary call over the global samples
        `samples` (the disjoint schedule: one micro-batch), the same on every rank (from the samples'
        metadata, never from a tensor); None: the edge's fixed `edge_tensor(edge).seq`. Default: None."""
        return None

    def aux_losses(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's share of auxiliary terms that entered the gradient but not the reported loss
        (the MoE load-balancing loss), summed over the world by the schedule and reported in
        `StepResult.aux_loss`; resets them. Default: none."""
        return {}

    def set_eval(self, on: bool) -> None:
        """Evaluation mode on or off: the runner reads held-out samples while it is on."""
        self.evaluating = bool(on)

    def heldout_size(self) -> Optional[int]:
        """Samples of the held-out split (one evaluation pass covers them once), or None when the
        runner has no finite held-out split (synthetic data)."""
        return None

    def take_eval_counts(self) -> Optional[tuple[int, int]]:
        """(hits, samples) this rank counted since the last call, reset; None when the runner counts
        no accuracy."""
        return None

    def take_eval_parts(self) -> dict[str, tuple[int, int]]:
        """{part: (hits, answers)} this rank counted since the last call, reset, for accuracies of
        parts of an answer (e.g. per modality); the same names on every rank; {} when none."""
        return {}
