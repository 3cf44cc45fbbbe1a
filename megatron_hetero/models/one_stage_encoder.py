"""What the one-stage pretrained towers (CLIP, SigLIP, Whisper) share: the layout they run on (pp 1,
cp 1, TP on the module's own group), their Megatron `TransformerConfig`, deterministic initialisation,
and LLaVA's forward (the trunk's features, cut from autograd when the module is frozen, through the
projector).

Nothing of this goes over the wire itself: the boundaries send the projector's output [b, tokens,
llm_hidden] forward and its gradient backward; TP inside the trunk and projector uses the module's TP
group as Megatron's layers do.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.layout.spec import ModuleLayout
from megatron_hetero.models.init import deterministic_init


class OneStageEncoder(torch.nn.Module):
    """Base of a pretrained tower that runs as one pipeline stage. A subclass calls `_one_stage` first,
    builds its trunk with `_config`, sets `self.projector`, calls `_init`, and defines `features(x)`
    ([b, tokens, in] -> [b, tokens, h], what the projector reads)."""

    projector: torch.nn.Module

    def _one_stage(self, name: str, m: ModuleLayout, kind: str) -> None:
        """Refuse pp or cp other than 1 (ValueError naming the module and `kind`, e.g. "a CLIP
        encoder"), and set the module's name, frozen flag and first/last stage flags."""
        if m.cp != 1 or m.pp != 1:
            raise ValueError(f"module {name}: {kind} runs with pp 1 and cp 1, got {m.arithmetic()}")
        self.name, self.frozen = name, m.frozen
        self.first = self.last = True

    @staticmethod
    def _config(enc: Any, m: ModuleLayout, activation: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """The trunk's Megatron `TransformerConfig`: `enc`'s layers, heads, FFN and norm epsilon, linear
        biases, full recompute, the activation given."""
        from megatron_hetero.models.llava import transformer_config

        return transformer_config(
            num_layers=enc.num_layers,
            hidden=enc.hidden_size,
            heads=enc.num_attention_heads,
            ffn=enc.ffn_hidden_size,
            m=m,
            recompute=True,
            layernorm_epsilon=enc.norm_epsilon,
            activation_func=activation,
            bias_activation_fusion=False,
            add_bias_linear=True,
        )

    def _init(self, seed: int, pgs: ProcessGroupCollection) -> None:
        """Deterministic initialisation of every parameter (by name, module and TP shard)."""
        deterministic_init(
            self.named_parameters(), seed=seed, module=self.name, tp_rank=pgs.tp.rank(), tp_size=pgs.tp.size()
        )

    def trainable(self) -> bool:
        return any(p.requires_grad for p in self.parameters())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def projected(self, x: torch.Tensor) -> torch.Tensor:
        """What LLaVA's projector reads of `x` (default: `features`; CLIP drops its class token)."""
        return self.features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[b, tokens, in] -> [b, tokens, llm_hidden]; the trunk's features are cut from autograd when frozen."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            h = self.projected(x)
        if self.frozen:
            h = h.detach()
        return self.projector(h.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
