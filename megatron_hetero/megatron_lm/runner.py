"""The `StageRunner`s of Megatron-LM's scripts for the project's schedules: what they share
(`MegatronDataRunner`) and the VLM's (`pretrain_vlm.py`); the GPT's is in `gpt.py`.

Data: Megatron's own train (validation, test) dataset, from the script's `train_valid_test_datasets_provider` with the
sample counts Megatron computes (`get_train_valid_test_num_samples`); global sample k of the run is
`dataset[k]` (Megatron's sequential `MegatronPretrainingSampler` reads the dataset in order), batched
with torch's default collate as Megatron's data loader does, and typed as the script's `get_batch` does.

Tensors: the vision module returns its image embeddings as the edge tensor `[rows, img_seq, h]`;
the language module's first stage takes them back as `[img_seq, rows, h]` (LLaVA's
`encoder_hidden_state`); between language stages Megatron's `[decoder_seq, rows, h]`. The loss is
`pretrain_gpt.loss_func`'s sum of per-token losses under LLaVA's combined loss mask.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.compat.fixes import datasets_built_on_every_rank
from megatron_hetero.layout.spec import Edge
from megatron_hetero.megatron_lm.precision import model_dtype
from megatron_hetero.plan.rank_plan import RankPlan
from megatron_hetero.runtime.module_state import ModuleState
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum, StageRunner
from megatron_hetero.megatron_lm.build import num_image_embeddings


SPLITS = ("train", "valid", "test")


def build_datasets(datasets_provider: Callable) -> dict[str, Any]:
    """The script's train, validation and test datasets by split (None where the provider builds
    none), with the sample counts Megatron computes, built on every rank (the provider builds them
    only where Megatron's global TP rank is 0; here every rank reads its own samples: the compat
    entry `megatron_lm.datasets_on_every_rank`)."""
    from megatron.training.training import get_train_valid_test_num_samples

    with datasets_built_on_every_rank():
        built = datasets_provider(get_train_valid_test_num_samples())
    out = dict(zip(SPLITS, built))
    if isinstance(out["valid"], list):  # --multiple-validation-sets is refused: one set
        out["valid"] = out["valid"][0] if out["valid"] else None
    if out["train"] is None:
        raise ValueError("the dataset provider built no train dataset")
    return out


class MegatronDataRunner(StageRunner):
    """What the stage runners of Megatron-LM's scripts share: the script's datasets (global sample k
    of step s is `dataset[s * global_batch + k]` of the current split), batches typed as the script's
    `get_batch` types them, the per-token loss normaliser, and `pretrain_gpt.loss_func`'s loss sum."""

    int_keys: tuple[str, ...] = ()
    float_keys: tuple[str, ...] = ()
    bool_keys: tuple[str, ...] = ()

    def __init__(self, args: Any, plan: RankPlan, states: dict[str, ModuleState], datasets_provider: Callable) -> None:
        self.args, self.plan, self.states = args, plan, states
        self.device = get_device()
        self.datasets = build_datasets(datasets_provider)
        self.split = "train"
        self.hidden = args.hidden_size
        #: the model's dtype (--bf16, --fp16): what crosses edges and pipeline stages, the image input
        self.dtype = model_dtype(args)
        self._tokens: dict[tuple[str, int], int] = {}

    @property
    def dataset(self) -> Any:
        return self.datasets[self.split]

    def has_split(self, split: str) -> bool:
        return self.datasets.get(split) is not None

    def set_split(self, split: str) -> None:
        """Which dataset `batch` and `loss_tokens` read (evaluation switches to valid/test and back)."""
        if not self.has_split(split):
            raise ValueError(f"the dataset provider built no {split} dataset")
        self.split = split

    def batch(self, samples: range) -> dict[str, torch.Tensor]:
        from torch.utils.data import default_collate

        items = [self.dataset[i] for i in samples]
        keys = [k for k in self.int_keys + self.float_keys + self.bool_keys if items[0].get(k) is not None]
        b = default_collate([{k: it[k] for k in keys} for it in items])
        out = {k: b[k].long().to(self.device) for k in self.int_keys if k in b}
        out.update({k: b[k].float().to(self.device) for k in self.float_keys if k in b})
        out.update({k: b[k].bool().to(self.device) for k in self.bool_keys if k in b})
        return out

    def loss_tokens(self, step: int) -> int:
        key = (self.split, step)
        if key not in self._tokens:
            g = self.plan.global_batch
            self._tokens[key] = int(
                sum(float(self.dataset[k]["loss_mask"].sum()) for k in range(step * g, (step + 1) * g))
            )
        return self._tokens[key]

    def model(self, module: str) -> torch.nn.Module:
        return self.states[module].model

    @staticmethod
    def loss_sum(per_token: torch.Tensor, loss_mask: torch.Tensor) -> LossSum:
        """`pretrain_gpt.loss_func`'s sum of per-token losses under the loss mask, and the token count."""
        losses = per_token.float().reshape(-1)
        mask = loss_mask.reshape(-1).float()
        return LossSum(torch.sum(losses * mask), mask.sum().to(torch.int))


class MegatronVlmRunner(MegatronDataRunner):
    """Stage runner of Megatron's LLaVA split into `vision` and `language` (see module docstring)."""

    int_keys = ("tokens", "position_ids", "labels")
    float_keys = ("image", "loss_mask")

    def __init__(self, args: Any, plan: RankPlan, states: dict[str, ModuleState], datasets_provider: Callable) -> None:
        super().__init__(args, plan, states, datasets_provider)
        self.img_seq = num_image_embeddings(args)

    # -- StageRunner --------------------------------------------------------------------------------
    def loss_modules(self) -> tuple[str, ...]:
        return ("language",)

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        return EdgeTensor(seq=self.img_seq, hidden=self.hidden, dtype=self.dtype)

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        if module == "vision":
            raise AssertionError("the vision module runs on one pipeline stage")
        return (self.args.decoder_seq_length, rows, self.hidden), self.dtype

    def forward(
        self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input: Optional[torch.Tensor]
    ) -> Union[torch.Tensor, LossSum]:
        b = self.batch(samples)
        model = self.states[module].model
        if module == "vision":
            # the first stage's float input in the model's dtype, as Float16Module converts it (the
            # loss masks' 0/1 are the same in any dtype)
            emb, _ = model(b["image"].to(self.dtype), b["tokens"], b["position_ids"], None, b["labels"], b["loss_mask"])
            return emb.transpose(0, 1).contiguous()  # [rows, img_seq, h]
        llava = self.states[module].module
        if llava.pre_process:
            (img,) = inputs.values()
            llava.set_input_tensor(img.transpose(0, 1).contiguous())
        elif stage_input is not None:
            llava.set_input_tensor(stage_input)
        tiles = torch.ones(len(samples), dtype=torch.int, device=self.device)
        out, mask = model(
            None, b["tokens"], b["position_ids"], None, b["labels"], b["loss_mask"], num_image_tiles=tiles
        )
        if not llava.post_process:
            return out
        return self.loss_sum(out, mask)
