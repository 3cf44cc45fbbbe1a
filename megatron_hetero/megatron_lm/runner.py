"""The `StageRunner` of Megatron-LM's VLM (`pretrain_vlm.py`) for the project's schedules.

Data: Megatron's own train dataset, from the script's `train_valid_test_datasets_provider` with the
sample counts Megatron computes (`get_train_valid_test_num_samples`); global sample k of the run is
`dataset[k]` (Megatron's sequential `MegatronPretrainingSampler` reads the dataset in order), batched
with torch's default collate as Megatron's data loader does, and typed as `pretrain_vlm.get_batch` does.

Tensors: the vision module returns its image embeddings as the edge tensor `[rows, img_seq, h]`;
the language module's first stage takes them back as `[img_seq, rows, h]` (LLaVA's
`encoder_hidden_state`); between language stages Megatron's `[decoder_seq, rows, h]`. The loss is
`pretrain_gpt.loss_func`'s sum of per-token losses under LLaVA's combined loss mask.
"""
from __future__ import annotations

import unittest.mock
from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum

_INT_KEYS = ("tokens", "position_ids", "labels")
_FLOAT_KEYS = ("image", "loss_mask")


def build_train_dataset(datasets_provider: Callable) -> Any:
    """The script's train dataset, built on every rank (the provider builds it only where Megatron's
    global TP rank is 0; here every rank reads its own samples)."""
    from megatron.core import parallel_state
    from megatron.training.training import get_train_valid_test_num_samples

    with unittest.mock.patch.object(parallel_state, "get_tensor_model_parallel_rank", lambda: 0):
        train_ds, _, _ = datasets_provider(get_train_valid_test_num_samples())
    if train_ds is None:
        raise ValueError("the dataset provider built no train dataset")
    return train_ds


class MegatronVlmRunner:
    """Stage runner of Megatron's LLaVA split into `vision` and `language` (see module docstring)."""

    def __init__(self, args: Any, plan: RankPlan, states: dict[str, ModuleState], datasets_provider: Callable) -> None:
        from megatron_hetero.megatron_lm.build import num_image_embeddings

        self.args, self.plan, self.states = args, plan, states
        self.device = get_device()
        self.dataset = build_train_dataset(datasets_provider)
        self.img_seq = num_image_embeddings(args)
        self.hidden = args.hidden_size
        self._tokens: dict[int, int] = {}

    # -- data ---------------------------------------------------------------------------------------
    def batch(self, samples: range) -> dict[str, torch.Tensor]:
        from torch.utils.data import default_collate

        items = [self.dataset[k] for k in samples]
        b = default_collate([{k: it[k] for k in _INT_KEYS + _FLOAT_KEYS} for it in items])
        out = {k: b[k].long().to(self.device) for k in _INT_KEYS}
        out.update({k: b[k].float().to(self.device) for k in _FLOAT_KEYS})
        return out

    # -- StageRunner --------------------------------------------------------------------------------
    def loss_modules(self) -> tuple[str, ...]:
        return ("language",)

    def loss_tokens(self, step: int) -> int:
        if step not in self._tokens:
            g = self.plan.global_batch
            self._tokens[step] = int(sum(float(self.dataset[k]["loss_mask"].sum())
                                         for k in range(step * g, (step + 1) * g)))
        return self._tokens[step]

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        return EdgeTensor(seq=self.img_seq, hidden=self.hidden)

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        if module == "vision":
            raise AssertionError("the vision module runs on one pipeline stage")
        return (self.args.decoder_seq_length, rows, self.hidden), torch.float32

    def model(self, module: str) -> torch.nn.Module:
        return self.states[module].model

    def forward(self, module: str, samples: range, inputs: Mapping[str, torch.Tensor],
                stage_input: Optional[torch.Tensor]) -> Union[torch.Tensor, LossSum]:
        b = self.batch(samples)
        model = self.states[module].model
        if module == "vision":
            emb, _ = model(b["image"], b["tokens"], b["position_ids"], None, b["labels"], b["loss_mask"])
            return emb.transpose(0, 1).contiguous()  # [rows, img_seq, h]
        llava = self.states[module].module
        if llava.pre_process:
            (img,) = inputs.values()
            llava.set_input_tensor(img.transpose(0, 1).contiguous())
        elif stage_input is not None:
            llava.set_input_tensor(stage_input)
        tiles = torch.ones(len(samples), dtype=torch.int, device=self.device)
        out, mask = model(None, b["tokens"], b["position_ids"], None, b["labels"], b["loss_mask"],
                          num_image_tiles=tiles)
        if not llava.post_process:
            return out
        losses = out.float().reshape(-1)
        mask = mask.reshape(-1).float()
        return LossSum(torch.sum(losses * mask), mask.sum().to(torch.int))
