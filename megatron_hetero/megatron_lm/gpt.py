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
  * `--sequence-parallel`: Megatron's SP in every module with tp > 1 (`build.module_config`): between
    its pipeline stages each TP rank sends `[seq/tp, rows, h]`; a segment's end all-gathers its shards
    over its TP group, so the edge carries the whole sequence (backward: the replicated gradient,
    each TP rank keeps its chunk), and a receiving segment with SP keeps its own chunk (backward:
    all-gathered over its TP group). Megatron's own embedding scatters and output layer gathers.
  * MoE (`--num-experts`): each module's `ep` and `expt_tp` from the layout (`check_moe`); a module
    with tp > 1 needs `--sequence-parallel`, as Megatron's MoE layer does.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_hetero.compat.device import get_device
from megatron_hetero.layout.spec import Edge, HeteroLayout, ModuleLayout
from megatron_hetero.megatron_lm.driver import ScriptModel, pretrain_with_layout, uneven_pp_flags
from megatron_hetero.megatron_lm.precision import to_model_dtype
from megatron_hetero.megatron_lm.runner import MegatronDataRunner
from megatron_hetero.plan.roles import language_modules, roles
from megatron_hetero.runtime.stage_runner import EdgeTensor, LossSum
from megatron_hetero.runtime.step import loss_normaliser
from megatron_hetero.layout.validate import check_experts
from megatron_hetero.megatron_lm.build import module_config
from megatron_hetero.runtime.loss_scale import loss_scale_of

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
        if getattr(args, "sequence_parallel", False) and m.tp > 1 and args.seq_length % m.tp:
            raise ValueError(
                f"module {m.name}: --sequence-parallel shards --seq-length {args.seq_length} over tp({m.tp}), "
                f"which does not divide it"
            )
        if segment_layers(args, m) % m.pp and not uneven_pp_flags(args):  # else driver.check_uneven_pipeline
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
    if getattr(args, "num_experts", None):
        check_moe(args, layout)


def check_moe(args: Any, layout: HeteroLayout) -> None:
    """MoE (`--num-experts`) with a layout: each module's `ep` (and `expt_tp`) from the layout against
    the experts (`layout.validate.check_experts`); the reference layout's own expert parallelism 1
    (the weights start from it); a module with tp > 1 needs --sequence-parallel. ValueError naming the
    flag otherwise.

    A module's `expt_tp` is its Megatron `expert_tensor_parallel_size`, as in `megatron-hetero train`:
    1 unless the layout says otherwise (Megatron's own default, the module's tp, is not implied), so
    `language:tp=2,dp=2,ep=2` is Megatron's `--tensor-model-parallel-size 2
    --expert-model-parallel-size 2 --expert-tensor-parallel-size 1` (experts whole on each EP rank,
    expert-DP 2), and `expt_tp=2` gives Megatron's default at tp 2 (each expert's fc1/fc2 split over
    expert TP from the reference, `weights.copy_into`); Megatron's `--expert-tensor-parallel-size`
    itself names the reference layout's. Expert TP > 1 runs on gloo too: Megatron's all-gather of
    uneven token counts over expert TP goes through compat's `cpu.gloo_uneven_all_gather`."""

    check_experts(layout, {m.name: args.num_experts for m in language_modules(layout)})
    if args.expert_model_parallel_size != 1:
        raise ValueError(
            f"--expert-model-parallel-size {args.expert_model_parallel_size}: with a layout Megatron's "
            f"parallel flags give the reference layout the weights start from, which must have EP 1; each "
            f"module's own ep comes from the layout (e.g. --hetero-module language:dp=2,ep=2)"
        )
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp not in (None, 1):
        raise ValueError(
            f"--expert-tensor-parallel-size {etp}: with a layout Megatron's parallel flags give the reference "
            f"layout the weights start from (expert TP 1, as its TP 1); each module's own expert TP is the "
            f"layout's expt_tp (e.g. --hetero-module language:tp=2,dp=2,ep=2,expt_tp=2)"
        )
    for m in language_modules(layout):
        if m.tp > 1 and not getattr(args, "sequence_parallel", False):
            raise ValueError(
                f"module {m.name}: tp({m.tp}) > 1 with --num-experts needs --sequence-parallel (Megatron's MoE "
                f"layer refuses to train with tensor parallelism but without sequence parallelism); add "
                f"--sequence-parallel, or use tp 1 (with dp or ep) on MoE modules"
            )
    if args.moe_grouped_gemm:
        raise ValueError("--moe-grouped-gemm is not supported with a layout (the local spec's SequentialMLP experts)")


def build_gpt_segment(args: Any, layout: HeteroLayout, m: ModuleLayout, pgs, model_provider: Callable):
    """Module `m`'s stage of Megatron's GPT on this rank, built by the script's model provider."""

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
    if pgs.tp.rank() == 0 and pgs.dp.rank() == 0 and pp_rank == 0:
        if model.config.sequence_parallel:
            print(f"megatron-hetero megatron-lm: module {m.name}: sequence parallelism over tp({m.tp})", flush=True)
        if getattr(args, "num_experts", None):
            print(
                f"megatron-hetero megatron-lm: module {m.name}: experts over expt_tp({m.expt_tp}) x ep({m.ep}) x "
                f"expt_dp({m.stage_size // (m.expt_tp * m.ep)}), {args.num_experts // m.ep} per EP rank",
                flush=True,
            )
    return to_model_dtype(model, args).to(get_device())  # --bf16/--fp16: as Float16Module casts it


class MegatronGptRunner(MegatronDataRunner):
    """Stage runner of Megatron's GPT cut into the layout's segments (see the module docstring)."""

    int_keys = ("tokens", "labels", "position_ids")
    float_keys = ("loss_mask",)
    bool_keys = ("attention_mask",)

    def loss_modules(self) -> tuple[str, ...]:
        return (self.plan.roles.last_language,)

    def edge_tensor(self, edge: Edge) -> EdgeTensor:
        return EdgeTensor(seq=self.args.seq_length, hidden=self.hidden, dtype=self.dtype)

    def stage_tensor(self, module: str, rows: int) -> tuple[tuple[int, ...], torch.dtype]:
        seq = self.args.seq_length
        if self._sequence_parallel(module):
            seq //= self.states[module].pgs.tp.size()  # this TP rank's shard (Megatron's P2P shape)
        return (seq, rows, self.hidden), self.dtype

    def _sequence_parallel(self, module: str) -> bool:
        s = self.states.get(module)
        return s is not None and bool(s.module.config.sequence_parallel)

    def aux_losses(self, step: int) -> dict[str, torch.Tensor]:
        """Nothing reported (Megatron's log line shows the lm loss); with experts, Megatron's MoE loss
        tracker is emptied at the end of every step (it accumulates per layer otherwise)."""
        if getattr(self.args, "num_experts", None):
            from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

            clear_aux_losses_tracker()
        return {}

    def _moe_loss_scale(self, samples: range) -> None:
        """With experts: the gradient scale of the load-balancing loss, 1 / the global batch's loss
        tokens (times the --fp16 loss scale). Under Megatron's per-token convention (the modules'
        `calculate_per_token_loss`) the router multiplies the loss by its local token count, so its
        gradient is weighted 1 / (micro-batches x DP), as in the unpatched script's per-micro-batch
        mean (Megatron-core's `Router.attach_and_log_load_balancing_loss`). The colocated language
        phase runs Megatron's own `forward_backward_func`, which sets the same value after the forward
        (from `grad_scale_func`); the disjoint schedule's stages rely on this one (measured: 30 times
        this scale moves the segments case's losses by 3.7e-4 while the colocated case stays exact)."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        step = samples.start // self.plan.global_batch
        scale = loss_scale_of(self.states) / loss_normaliser(self.loss_tokens(step))
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([scale], device=self.device))

    def forward(
        self, module: str, samples: range, inputs: Mapping[str, torch.Tensor], stage_input: Optional[torch.Tensor]
    ) -> Union[torch.Tensor, LossSum]:
        b = self.batch(samples)
        gpt, model, me = self.states[module].module, self.states[module].model, self.plan.modules[module]
        if getattr(self.args, "num_experts", None):
            self._moe_loss_scale(samples)
        if not gpt.pre_process:
            if stage_input is not None:
                gpt.set_input_tensor(stage_input)
            elif inputs:  # the previous segment's hidden states, [rows, seq, h] (whole: see below)
                (x,) = inputs.values()
                x = x.transpose(0, 1).contiguous()
                if self._sequence_parallel(module):  # this TP rank's chunk; backward all-gathers over TP
                    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

                    x = scatter_to_sequence_parallel_region(x, group=self.states[module].pgs.tp)
                gpt.set_input_tensor(x)
        out = model(
            b["tokens"],
            b["position_ids"],
            b.get("attention_mask"),
            labels=b["labels"] if gpt.post_process else None,
            loss_mask=b["loss_mask"],
        )
        if gpt.post_process:
            return self.loss_sum(out, b["loss_mask"])
        if me.coord.pp != me.pp - 1:
            return out
        # a segment's end crosses an edge with the whole sequence: under SP all-gathered over TP first
        # (backward: each TP rank keeps its chunk of the replicated gradient)
        if self._sequence_parallel(module):
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            out = gather_from_sequence_parallel_region(
                out, tensor_parallel_output_grad=False, group=self.states[module].pgs.tp
            )
        return out.transpose(0, 1).contiguous()


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
