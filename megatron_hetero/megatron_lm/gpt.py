"""`pretrain_gpt.py --hetero-*`: Megatron-LM's GPT script with one language model cut into segments.

A layout for `pretrain_gpt.py` holds language modules only: either one module (any name; e.g.
`language:tp=2,dp=2`: the homogeneous model written as flags, or a module with its own PP), or
pipeline **segments** that declare their layers (`language_a: {tp: 2, layers: 0-1, ranks: 0-1}`,
`language_b: {dp: 2, layers: 2-3, ranks: 2-3}`, edge `language_a -> language_b`; disjoint, see
`plan/roles.py`), each with its own TP/PP/DP. The patched script hands its dataset provider and model
provider to :func:`pretrain_gpt`; the shared driver (`driver.py`) does the rest with:

  * build: the script's own model provider (`model_provider(gpt_builder, ...)`, Megatron's GPT
    builder) called with `pre_process` on the first stage of the first segment, `post_process` on
    the last stage of the last segment, a `TransformerConfig` from Megatron's arguments with the
    module's TP/PP and the segment's layer count, and the module's `ProcessGroupCollection`;
    the reference weights map by name with the segment's first layer added (`weights.py`);
  * runner `MegatronGptRunner`: Megatron's GPT dataset from the script's provider (`--mock-data`,
    `--data-path`, ...), typed as `get_batch_on_this_tp_rank` types it; between segments the hidden
    states `[rows, seq, h]` cross the edge (the next segment's first stage takes them back as
    Megatron's `[seq, rows, h]` through `set_input_tensor`); the loss is `pretrain_gpt.loss_func`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout
from megatron_hetero.megatron_lm.driver import ScriptModel, pretrain_with_layout
from megatron_hetero.megatron_lm.runner import MegatronDataRunner
from megatron_hetero.plan.roles import language_modules, roles
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum

#: Megatron GPT flags a layout refuses beyond `driver.REFUSED` (attribute -> flag)
REFUSED_GPT = {
    "sft": "--sft",
    "heterogeneous_layers_config_path": "--heterogeneous-layers-config-path",
    "experimental_attention_variant": "--experimental-attention-variant",
    "yaml_cfg": "--yaml-cfg",
    "hybrid_context_parallel": "--hybrid-context-parallel",
}


def segment_layers(args: Any, m: ModuleLayout) -> int:
    """How many of the model's `--num-layers` layers module `m` holds."""
    return m.layers.size if m.layers is not None else args.num_layers


def check_gpt(args: Any, layout: HeteroLayout) -> None:
    """What `pretrain_gpt.py` needs beyond `driver.check_common`; ValueError naming the module or flag."""
    r = roles(layout)
    if r.encoders or r.outputs:
        raise ValueError(
            f"pretrain_gpt.py with a layout takes language modules only (one module, or segments "
            f"that declare `layers: A-B`); the layout also has {list(r.encoders + r.outputs)}"
        )
    segs = language_modules(layout)
    if any(m.layers is not None for m in segs):
        end = segs[-1].layers.end + 1
        if end != args.num_layers:
            raise ValueError(f"the segments cover layers 0-{end - 1} ({end} layers); --num-layers is {args.num_layers}")
    want = [(a.name, b.name) for a, b in zip(segs, segs[1:])]
    if sorted((e.src, e.dst) for e in layout.edges) != sorted(want):
        raise ValueError(
            f"pretrain_gpt.py needs exactly the edges between consecutive segments "
            f"{[f'{a} -> {b}' for a, b in want]}; the layout has {[str(e) for e in layout.edges]}"
        )
    for m in segs:
        if segment_layers(args, m) % m.pp:
            raise ValueError(f"module {m.name}: {segment_layers(args, m)} layers do not split over pp({m.pp})")
    stages = sum(m.pp for m in segs)
    if stages > 1 and not args.untie_embeddings_and_output_weights:
        raise ValueError(
            f"the layout runs the model in {stages} pipeline stages; tied input and output "
            f"embeddings across stages are not supported with a layout: pass "
            f"--untie-embeddings-and-output-weights"
        )
    for attr, flag in REFUSED_GPT.items():
        if getattr(args, attr, None):
            raise ValueError(f"{flag} is not supported with pretrain_gpt.py and a layout (yet)")


def build_gpt_segment(args: Any, layout: HeteroLayout, m: ModuleLayout, pgs, model_provider: Callable):
    """Module `m`'s stage of Megatron's GPT on this rank, built by the script's model provider."""
    from megatron_hetero.megatron_lm.build import module_config

    if args.padded_vocab_size % m.tp:
        raise ValueError(
            f"module {m.name}: padded vocabulary {args.padded_vocab_size} is not divisible by "
            f"tp({m.tp}); raise --make-vocab-size-divisible-by"
        )
    segs = [s.name for s in language_modules(layout)]
    pp_rank = pgs.pp.rank()
    model = model_provider(
        pre_process=m.name == segs[0] and pp_rank == 0,
        post_process=m.name == segs[-1] and pp_rank == m.pp - 1,
        config=module_config(args, m, segment_layers(args, m)),
        pg_collection=pgs,
    )
    if m.frozen:
        for p in model.parameters():
            p.requires_grad_(False)
    return model.to(get_device())


class MegatronGptRunner(MegatronDataRunner):
    """Stage runner of Megatron's GPT cut into the layout's segments (see the module docstring)."""

    int_keys = ("tokens", "labels", "position_ids")
    float_keys = ("loss_mask",)
    bool_keys = ("attention_mask",)

    def loss_modules(self) -> tuple[str, ...]:
        return (self.plan.roles.last_language,)

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        return EdgeTensor(seq=self.args.seq_length, hidden=self.hidden)

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        return (self.args.seq_length, rows, self.hidden), torch.float32

    def forward(
        self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input: Optional[torch.Tensor]
    ) -> Union[torch.Tensor, LossSum]:
        b = self.batch(samples)
        gpt, model, me = self.states[module].module, self.states[module].model, self.plan.modules[module]
        if not gpt.pre_process:
            if stage_input is not None:
                gpt.set_input_tensor(stage_input)
            elif inputs:  # the previous segment's hidden states, [rows, seq, h]
                (x,) = inputs.values()
                gpt.set_input_tensor(x.transpose(0, 1).contiguous())
        out = model(
            b["tokens"],
            b["position_ids"],
            b.get("attention_mask"),
            labels=b["labels"] if gpt.post_process else None,
            loss_mask=b["loss_mask"],
        )
        if gpt.post_process:
            return self.loss_sum(out, b["loss_mask"])
        return out.transpose(0, 1).contiguous() if me.coord.pp == me.pp - 1 else out  # a segment's end crosses an edge


GPT = ScriptModel(
    script="pretrain_gpt.py",
    check=check_gpt,
    build=build_gpt_segment,
    runner=MegatronGptRunner,
    first_layer=lambda layout, m: m.layers.start if m.layers is not None else 0,
)


def pretrain_gpt(
    train_valid_test_datasets_provider: Callable,
    model_provider: Callable,
    extra_args_provider: Optional[Callable] = None,
    args_defaults: Optional[dict] = None,
    get_embedding_ranks: Optional[Callable] = None,
) -> int:
    """Train Megatron-LM's GPT with the layout of the `--hetero-*` flags; returns the exit code
    (2: invalid input, printed as one paragraph before any process group or model exists)."""
    return pretrain_with_layout(
        GPT, train_valid_test_datasets_provider, model_provider, extra_args_provider, args_defaults, get_embedding_ranks
    )
