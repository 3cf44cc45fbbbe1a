"""megatron_hetero.compat: Megatron-core 0.19 on CPU/gloo, against homogeneous references; and the
compat table itself (every patched spot still exists upstream, the version gate refuses an untargeted
Megatron-core, compat is applied at the entry points only).

Every multi-rank case builds, in the same forked job, a reference model on a pure-DP grid (each rank
holds the whole TP1·CP1·PP1 model and sees the same data) and the model under test on a
``HyperCommGrid(shape, ["tp", "cp", "dp", "pp"])`` with an explicit ``ProcessGroupCollection``.

* TP/SP/CP cases rely on ``use_cpu_initialization=True`` + the same seed giving the same weights.
* PP cases copy the reference weights into the stages (Megatron's PP init consumes the RNG per stage,
  so PP2 and PP1 are not initialised alike, on GPU either).
* Training cases run ``get_forward_backward_func`` (1F1B for PP > 1) with Megatron DDP, the fp32
  Megatron optimizer (SGD, clip_grad small enough that clipping is active) and
  ``finalize_model_grads``, for two steps; then every parameter shard must equal the matching slice
  of the reference. That checks the gradients (TP/SP layer-norm all-reduce, tied embeddings over the
  embedding group, DP/CP averaging, clipping norm) far more sharply than the step-2 loss does.

Tolerances: the step-1 loss and the gradient norms only differ by reduction order (TP all-reduce of
partial matmuls, CP reduce-scatter of K/V gradients): 1e-6 relative. The step-2 loss and the
parameters after two SGD updates made from such gradients: 1e-5 relative (parameters: max abs
difference over max abs value, per tensor).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_hetero import compat
from megatron_hetero.compat import (
    apply_compat,
    clip_vit_norm_kwargs,
    default_backend,
    ensure_global_memory_buffer,
    get_device,
    set_local_device,
)
from megatron_hetero.models.cp_attention import cp_chunk_positions
from megatron_hetero.models.layer_specs import get_gpt_layer_local_spec_with_cp
from megatron_cp import megatron_cp_positions

from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.models.vision.clip_vit_model import CLIPViTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="CPU/gloo compat cases (CUDA present)")

SEQ, MBS, MICRO, VOCAB, HIDDEN, HEADS, LAYERS, SEED = 32, 2, 2, 128, 64, 4, 4, 1234
RTOL_EXACT, RTOL_STEP = 1e-6, 1e-5


# ----------------------------------------------------------------------------------------------
# Helpers (run inside forked ranks)
# ----------------------------------------------------------------------------------------------


def build_pg_collection(tp: int, cp: int, dp: int, pp: int) -> ProcessGroupCollection:
    """Groups of a tiny GPT on a ``[tp, cp, dp, pp]`` HyperCommGrid over the whole world.

    Every rank creates every group in the same order. No MoE: ``ep`` is a singleton group per rank,
    expert-TP = TP, expert-DP = DP·CP.
    """
    grid = HyperCommGrid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])
    pgc = ProcessGroupCollection()
    pgc.tp = grid.create_pg("tp")
    pgc.cp = grid.create_pg("cp")
    pgc.dp = grid.create_pg("dp")
    pgc.pp = grid.create_pg("pp")
    pgc.dp_cp = grid.create_pg(["cp", "dp"])
    pgc.tp_cp = grid.create_pg(["tp", "cp"])
    pgc.mp = grid.create_pg(["tp", "pp"])
    # Tied word embeddings: first and last stage of each pipeline.
    embd_ranks = [sorted({ranks[0], ranks[-1]}) for ranks in grid.get_rank_enum("pp")]
    pgc.embd, _ = dist.new_subgroups_by_enumeration(embd_ranks)
    pgc.pos_embd = None  # RoPE: no learned position embedding
    pgc.ep, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    pgc.expt_tp = pgc.tp
    pgc.expt_dp = pgc.dp_cp
    pgc.tp_ep_pp = pgc.mp
    return pgc


def tiny_gpt(
    pgc: ProcessGroupCollection, *, sp: bool = False, cp_attention: bool = False, query_groups=None
) -> GPTModel:
    tp, cp, pp = pgc.tp.size(), pgc.cp.size(), pgc.pp.size()
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED, tp_rank=pgc.tp.rank(), ep_rank=0, etp_rank=0)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=query_groups,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec_with_cp() if cp_attention else get_gpt_layer_local_spec()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pg_collection=pgc,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=True,
        pre_process=pgc.pp.rank() == 0,
        post_process=pgc.pp.rank() == pp - 1,
    )
    return model.to(get_device())


def _reference_slices(model: GPTModel, reference: GPTModel, pgc: ProcessGroupCollection):
    """Yield ``(name, param, the matching slice of the TP1·PP1 reference)``: layers offset by
    pipeline stage, TP-split params chunked along their partition dim, the last stage's tied output
    layer matched with the reference word embedding."""
    ref = dict(reference.named_parameters())
    offset = pgc.pp.rank() * (LAYERS // pgc.pp.size())
    for name, param in model.named_parameters():
        if name == "output_layer.weight":
            src = ref["embedding.word_embeddings.weight"]
        else:
            src = ref[
                re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
            ]
        if getattr(param, "tensor_model_parallel", False):
            src = src.chunk(pgc.tp.size(), dim=param.partition_dim)[pgc.tp.rank()]
        yield name, param, src


def load_reference_weights(model: GPTModel, reference: GPTModel, pgc: ProcessGroupCollection) -> None:
    with torch.no_grad():
        for _, param, src in _reference_slices(model, reference, pgc):
            param.copy_(src)


def max_param_difference(model: GPTModel, reference: GPTModel, pgc: ProcessGroupCollection) -> tuple:
    """Largest ``max|p - p_ref| / max|p_ref|`` over this rank's parameters, and that parameter."""
    worst = (0.0, "")
    for name, param, src in _reference_slices(model, reference, pgc):
        diff = ((param - src).abs().max() / src.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, (diff, name))
    return worst


def batches(cp_group) -> list:
    """MICRO microbatches of (tokens, labels, position_ids), this CP rank's share of the sequence."""
    g = torch.Generator().manual_seed(0)
    idx = cp_chunk_positions(SEQ, cp_group.rank(), cp_group.size())
    out = []
    for _ in range(MICRO):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
        pos = torch.arange(SEQ).expand(MBS, -1)
        out.append(tuple(t[:, idx].to(get_device()) for t in (tokens, labels, pos)))
    return out


def causal_mask_with_padding() -> torch.Tensor:
    """[MBS, 1, SEQ, SEQ] bool mask (True = masked): causal, and sample 1 cannot see its first 3 keys."""
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).expand(MBS, 1, SEQ, SEQ).clone()
    mask[1, :, :, :3] = True
    return mask.to(get_device())


def forward_backward(model: GPTModel, pgc: ProcessGroupCollection, mask_kind: str = "none") -> tuple:
    """Mean token loss of one microbatch and the norm of the full input-embedding gradient."""
    tokens, labels, pos = batches(pgc.cp)[0]
    mask = None
    if mask_kind != "none":
        mask = causal_mask_with_padding()
        if mask_kind == "rows" and pgc.cp.size() > 1:  # what get_batch_on_this_cp_rank produces
            mask = mask[:, :, cp_chunk_positions(SEQ, pgc.cp.rank(), pgc.cp.size(), mask.device)]
    local_sum = model(tokens, pos, mask, labels=labels).sum()
    local_sum.backward()
    loss = local_sum.detach().clone()
    dist.all_reduce(loss, group=pgc.cp)
    grad = model.embedding.word_embeddings.weight.grad.clone()
    dist.all_reduce(grad, group=pgc.cp)  # each CP rank holds the gradient of its own tokens
    sq = grad.square().sum()
    dist.all_reduce(sq, group=pgc.tp)  # vocab-sharded over TP
    model.zero_grad()
    return (loss / (MBS * SEQ)).item(), sq.sqrt().item()


def train_steps(model: GPTModel, pgc: ProcessGroupCollection, steps: int = 2) -> list:
    """``steps`` optimizer steps of MICRO microbatches through get_forward_backward_func with
    Megatron DDP + fp32 Megatron SGD. Returns the per-step mean token loss (None off the last stage)."""
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=pgc)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=0.3), [ddp], pg_collection=pgc, use_gloo_process_groups=False
    )
    pp = pgc.pp.size()
    forward_backward_func = get_forward_backward_func(pp_size=pp, vp_size=None)
    schedule_kwargs = {"pg_collection": pgc}
    if pp > 1:
        schedule_kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pgc.pp, config=config)

    def forward_step(data_iterator, module):
        tokens, labels, pos = next(data_iterator)
        output = module(tokens, pos, None, labels=labels)

        def loss_func(per_token_loss):
            total = per_token_loss.sum()
            count = torch.tensor(per_token_loss.numel(), dtype=torch.int)
            return total, count, {"sum_count": torch.stack([total.detach(), count.float()])}

        return output, loss_func

    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reported = forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=iter(batches(pgc.cp)),
            model=[ddp],
            num_microbatches=MICRO,
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
            **schedule_kwargs,
        )
        success, _, _ = optimizer.step()
        assert success
        if pgc.pp.rank() == pp - 1:
            total = torch.stack([r["sum_count"] for r in reported]).sum(0)
            dist.all_reduce(total, group=pgc.cp)
            losses.append((total[0] / total[1]).item())
        else:
            losses.append(None)
    return losses


def _reference_pgc() -> ProcessGroupCollection:
    return build_pg_collection(1, 1, dist.get_world_size(), 1)


# ----------------------------------------------------------------------------------------------
# Rank bodies (module level so the launcher can run them)
# ----------------------------------------------------------------------------------------------


def _rank_tp_forward_backward(tp: int) -> dict:
    ensure_global_memory_buffer()
    ref_pgc = _reference_pgc()
    pgc = build_pg_collection(tp, 1, dist.get_world_size() // tp, 1)
    out = {"ref": forward_backward(tiny_gpt(ref_pgc), ref_pgc)}
    out["tp"] = forward_backward(tiny_gpt(pgc), pgc)
    out["tp_sp"] = forward_backward(tiny_gpt(pgc, sp=True), pgc)
    return out


def _rank_cp_forward_backward(cp: int) -> dict:
    ensure_global_memory_buffer()
    ref_pgc = _reference_pgc()
    pgc = build_pg_collection(1, cp, dist.get_world_size() // cp, 1)
    ref_model = tiny_gpt(ref_pgc)
    cp1_model = tiny_gpt(ref_pgc, cp_attention=True)  # CP attention at CP=1 is DotProductAttention
    cp_model = tiny_gpt(pgc, cp_attention=True)
    out = {}
    for kind in ("none", "full", "rows"):
        out[kind] = {
            "ref": forward_backward(ref_model, ref_pgc, kind),
            "cp1": forward_backward(cp1_model, ref_pgc, kind),
            "cp": forward_backward(cp_model, pgc, kind),
        }
    # Grouped-query attention: K/V are gathered before they are repeated over the query heads.
    out["gqa"] = {
        "ref": forward_backward(tiny_gpt(ref_pgc, query_groups=2), ref_pgc),
        "cp1": forward_backward(tiny_gpt(ref_pgc, cp_attention=True, query_groups=2), ref_pgc),
        "cp": forward_backward(tiny_gpt(pgc, cp_attention=True, query_groups=2), pgc),
    }
    return out


def _rank_train(tp: int, cp: int, pp: int, sp: bool) -> dict:
    ensure_global_memory_buffer()
    world = dist.get_world_size()
    ref_pgc = _reference_pgc()
    pgc = build_pg_collection(tp, cp, world // (tp * cp * pp), pp)
    reference = tiny_gpt(ref_pgc)
    model = tiny_gpt(pgc, sp=sp, cp_attention=cp > 1)
    load_reference_weights(model, reference, pgc)
    out = {"ref": train_steps(reference, ref_pgc), "test": train_steps(model, pgc)}
    out["param_diff"] = max_param_difference(model, reference, pgc)
    return out


def _rank_clip_vit(tp: int) -> dict:
    ensure_global_memory_buffer()
    out = {}
    layouts = (("ref", _reference_pgc()), ("tp", build_pg_collection(tp, 1, dist.get_world_size() // tp, 1)))
    for name, pgc in layouts:
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED, tp_rank=pgc.tp.rank(), ep_rank=0, etp_rank=0)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            tensor_model_parallel_size=pgc.tp.size(),
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        spec = copy.deepcopy(get_gpt_layer_local_spec())
        spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
        model = CLIPViTModel(config, spec, patch_dim=8, img_h=32, img_w=32, pg_collection=pgc, **clip_vit_norm_kwargs())
        images = torch.randn(MBS, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        features = model(images)
        features.square().mean().backward()
        grad_norm = model.conv1.weight.grad.norm().item()
        out[name] = (tuple(features.shape), features.double().sum().item(), grad_norm)
    return out


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _patched_objects() -> dict:
    """Every object apply_cpu_compat/apply_fixes may replace, by identity."""
    import importlib
    import logging

    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    embeddings = "megatron.core.models.common.embeddings"
    names = {
        "megatron.core.tensor_parallel.random": ["torch", "_get_cuda_rng_state", "_set_cuda_rng_state"],
        f"{embeddings}.rope_utils": ["torch", "get_pos_emb_on_this_cp_rank"],
        f"{embeddings}.rotary_pos_embedding": ["torch", "get_pos_emb_on_this_cp_rank"],
        "megatron.core.optimizer.optimizer": ["torch", "clip_grad_by_total_norm_fp32"],
        "megatron.core.optimizer.clip_grads": ["torch", "clip_grad_by_total_norm_fp32"],
    }
    objs = {f"{m}.{a}": getattr(importlib.import_module(m), a) for m, attrs in names.items() for a in attrs}
    for module in (
        "megatron.core.utils",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.pipeline_parallel.p2p_communication",
    ):
        objs[f"{module}.torch"] = importlib.import_module(module).torch
    objs["LanguageModule.setup"] = vars(LanguageModule)["setup_embeddings_and_output_layer"]
    objs["LanguageModule.loss"] = vars(LanguageModule)["compute_language_model_loss"]
    objs["CLIPViTModel.__init__"] = vars(CLIPViTModel)["__init__"]
    objs["WrappedTorchNorm.__new__"] = vars(WrappedTorchNorm)["__new__"]
    objs["rng_log_filters"] = tuple(logging.getLogger("megatron.core.tensor_parallel.random").filters)
    return objs


@cpu_only
def test_apply_cpu_compat_is_idempotent_and_leaves_torch_alone(monkeypatch):
    from megatron_hetero.compat import cpu
    from megatron_hetero.compat._patching import MARK

    assert cpu.cpu_compat_applied()
    before = _patched_objects()
    # Applied: Megatron's module-level `torch` is the redirect, functions are wrapped once.
    assert hasattr(before["megatron.core.pipeline_parallel.schedules.torch"], MARK)
    for key, obj in before.items():
        original = getattr(obj.__func__ if isinstance(obj, staticmethod) else obj, MARK, None)
        if original is not None and key.split(".")[-1] != "torch":
            assert not hasattr(original, MARK), f"{key} is wrapped twice"
    compat.apply_cpu_compat()
    apply_compat()
    assert _patched_objects() == before
    # Even with the "applied" flag cleared, re-applying wraps nothing twice.
    monkeypatch.setattr(cpu, "_APPLIED", False)
    compat.apply_cpu_compat()
    assert _patched_objects() == before
    # torch itself is untouched outside the wrapped calls.
    assert "cuda" not in vars(torch.Tensor) and "type" not in vars(torch.Tensor)
    assert torch.zeros(2).type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_apply_cpu_compat_is_a_noop_when_cuda_is_available(monkeypatch):
    import dataclasses

    from megatron_hetero.compat import cpu

    calls = []
    monkeypatch.setattr(cpu, "_APPLIED", False)
    monkeypatch.setattr(cpu, "PATCHES", [dataclasses.replace(cpu.PATCHES[0], apply=lambda: calls.append(1))])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu.apply_cpu_compat()
    assert calls == [] and not cpu.cpu_compat_applied()


@cpu_only
def test_rng_tracker_keeps_cpu_generator_states():
    """model_parallel_cuda_manual_seed on CPU: the default stream is seeded with ``seed``, the
    model-parallel stream with ``seed + 2718 + tp_rank``; fork() resumes that stream and restores the
    default one afterwards (Megatron's semantics, with the CPU generator as the "CUDA" generator)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    saved = torch.get_rng_state()
    try:
        model_parallel_cuda_manual_seed(100, tp_rank=1, ep_rank=0, etp_rank=0)
        tracker = get_cuda_rng_tracker()
        default_1 = torch.rand(3)
        with tracker.fork():
            tracked_1 = torch.rand(3)
        default_2 = torch.rand(3)
        with tracker.fork():
            tracked_2 = torch.rand(3)
    finally:
        torch.set_rng_state(saved)
    default = torch.Generator().manual_seed(100)
    tracked = torch.Generator().manual_seed(100 + 2718 + 1)
    assert torch.equal(default_1, torch.rand(3, generator=default))
    assert torch.equal(default_2, torch.rand(3, generator=default))
    assert torch.equal(tracked_1, torch.rand(3, generator=tracked))
    assert torch.equal(tracked_2, torch.rand(3, generator=tracked))


@cpu_only
def test_device_helpers_on_cpu():
    assert get_device() == torch.device("cpu")
    assert default_backend() == "gloo"
    assert set_local_device(3) == torch.device("cpu")
    compat.synchronize()  # no-op, must not touch CUDA


def test_cp_chunk_positions_is_megatron_layout():
    for cp in (1, 2, 3):
        for rank in range(cp):
            assert cp_chunk_positions(24, rank, cp).tolist() == megatron_cp_positions(24, cp, rank)
    with pytest.raises(ValueError, match="2\\*cp"):
        cp_chunk_positions(30, 0, 4)


@cpu_only
def test_tp2_matches_tp1_loss_and_embedding_grad():
    results = run_ranks(2, _rank_tp_forward_backward, 2)
    for out in results:
        ref_loss, ref_norm = out["ref"]
        for case in ("tp", "tp_sp"):
            loss, norm = out[case]
            assert _rel(loss, ref_loss) <= RTOL_EXACT, (case, loss, ref_loss)
            assert _rel(norm, ref_norm) <= RTOL_EXACT, (case, norm, ref_norm)


@cpu_only
def test_cp2_attention_matches_cp1():
    results = run_ranks(2, _rank_cp_forward_backward, 2)
    for out in results:
        assert out["none"]["ref"] != out["full"]["ref"]  # the padding mask matters
        for kind, cases in out.items():
            ref_loss, ref_norm = cases["ref"]
            assert cases["cp1"] == cases["ref"], kind  # bitwise: same module at CP=1
            loss, norm = cases["cp"]
            assert _rel(loss, ref_loss) <= RTOL_EXACT, (kind, loss, ref_loss)
            assert _rel(norm, ref_norm) <= RTOL_EXACT, (kind, norm, ref_norm)


@cpu_only
@pytest.mark.parametrize(
    "tp,cp,pp,sp",
    [
        pytest.param(1, 1, 2, False, id="pp2"),
        pytest.param(2, 1, 1, True, id="tp2-sp"),
        pytest.param(1, 2, 1, False, id="cp2"),
        pytest.param(2, 1, 2, True, id="tp2-pp2-sp"),
        pytest.param(2, 2, 1, True, id="tp2-cp2-sp"),
    ],
)
def test_train_steps_match_reference(tp, cp, pp, sp):
    world = tp * cp * pp
    results = run_ranks(world, _rank_train, tp, cp, pp, sp)
    checked = 0
    for out in results:
        diff, name = out["param_diff"]
        assert diff <= RTOL_STEP, f"after 2 steps {name} differs from the reference by {diff:.2e}"
        if out["test"][0] is None:  # not a last pipeline stage
            continue
        (ref1, ref2), (got1, got2) = out["ref"], out["test"]
        assert _rel(got1, ref1) <= RTOL_EXACT, (got1, ref1)
        assert _rel(got2, ref2) <= RTOL_STEP, (got2, ref2)
        assert abs(ref2 - ref1) > 1e-3  # the step changed the model
        checked += 1
    assert checked == world // pp


@cpu_only
def test_clip_vit_tp2_matches_tp1():
    for out in run_ranks(2, _rank_clip_vit, 2):
        shape, total, grad_norm = out["tp"]
        ref_shape, ref_total, ref_grad_norm = out["ref"]
        assert shape == ref_shape == (MBS, 17, HIDDEN)
        assert _rel(total, ref_total) <= RTOL_EXACT
        assert _rel(grad_norm, ref_grad_norm) <= RTOL_EXACT


def test_no_torch_cuda_outside_compat():
    """Rule: only megatron_hetero/compat asks torch about CUDA (is_available/device_count excepted)."""
    root = Path(__file__).resolve().parents[2] / "megatron_hetero"
    pattern = re.compile(r"torch\.cuda\.(?!is_available\b|device_count\b)\w+|\.cuda\(")
    offenders = []
    for path in root.rglob("*.py"):
        if "compat" in path.relative_to(root).parts[:1]:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                offenders.append(f"{path.relative_to(root.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _rank_cp_attention_gpu(cp: int) -> dict:
    set_local_device(int(os.environ["LOCAL_RANK"]))
    return _rank_cp_forward_backward(cp)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cp2_attention_matches_cp1_on_gpu():
    for out in run_ranks(2, _rank_cp_attention_gpu, 2, backend="nccl"):
        for kind, cases in out.items():
            ref_loss, ref_norm = cases["ref"]
            loss, norm = cases["cp"]
            assert _rel(loss, ref_loss) <= 1e-5, (kind, loss, ref_loss)
            assert _rel(norm, ref_norm) <= 1e-5, (kind, norm, ref_norm)


# ----------------------------------------------------------------------------------------------
# The compat table: spots, targets, the version gate, the entry points
# ----------------------------------------------------------------------------------------------

MEGATRON_LM_TREE = os.environ.get("MEGATRON_LM")


def test_table_entries_are_complete_and_split_by_reason():
    from megatron_hetero.compat import cpu, fixes, megatron_lm, table
    from megatron_hetero.compat.catalog import every_patch

    entries = every_patch()
    names = [p.name for p in entries]
    assert len(names) == len(set(names)), "patch names must be unique"
    assert {p.reason for p in cpu.PATCHES} == {table.CPU} and {p.reason for p in megatron_lm.MEGATRON_LM_PATCHES} == {
        table.CPU
    }
    assert {p.reason for p in [*fixes.FIXES, *fixes.NO_TE_PATCHES]} == {table.FIX}
    for p in entries:
        assert p.removal.startswith("remove "), p.name
        assert p.targets and p.spots and p.spot and p.action, p.name
        assert table.targets_version(p, table.megatron_core_version()), (
            f"{p.name} does not target the installed version"
        )
        assert (p.apply is None) == p.use.startswith(("scoped:", "helper:")), p.name
    # CP attention and layer specs are model code, not compat
    assert not any("cp_attention" in n or "layer_spec" in n for n in names)


def test_every_patched_spot_exists():
    """Each spot a patch wraps, replaces or relies on is still in the installed Megatron-core/torch with
    the expected kind and parameters, and still holds the upstream text that makes the patch needed
    (after an upgrade this names the patches that lost their target). The Megatron-LM set: below."""
    from megatron_hetero.compat import table
    from megatron_hetero.compat.catalog import every_patch

    problems = [p for e in every_patch() if not e.name.startswith("megatron_lm.") for p in table.patch_problems(e)]
    assert not problems, "\n".join(problems)


def _megatron_lm_spot_problems(tree: str) -> list:
    from megatron_hetero.megatron_lm.run import use_tree

    use_tree(tree)  # as the Megatron-LM launcher does (this is a forked rank: nothing leaks back)
    from megatron_hetero.compat import megatron_lm, table

    from megatron_hetero.compat.fix_megatron_lm_data import DATASETS_ON_EVERY_RANK

    megatron_lm._triton_stub()
    entries = [*megatron_lm.MEGATRON_LM_PATCHES, *megatron_lm.NO_TE_PATCHES, DATASETS_ON_EVERY_RANK]
    return [p for e in entries for p in table.patch_problems(e)]


@pytest.mark.skipif(
    not MEGATRON_LM_TREE, reason="set MEGATRON_LM to a Megatron-LM tree at core_v0.19.0 to check the Megatron-LM spots"
)
def test_every_megatron_lm_patched_spot_exists():
    (problems,) = run_ranks(1, _megatron_lm_spot_problems, MEGATRON_LM_TREE, init_distributed=False)
    assert not problems, "\n".join(problems)


def test_spot_check_names_what_is_lost():
    from megatron_hetero.compat.table import Spot, spot_problems

    assert (
        spot_problems(
            Spot(
                "megatron.core.utils:GlobalMemoryBuffer.get_tensor",
                "method",
                params=("self", "tensor_shape"),
                uses=("torch.cuda.current_device()",),
            )
        )
        == []
    )
    assert "does not exist" in spot_problems(Spot("megatron.core.utils:no_such_function"))[0]
    assert (
        "is not defined on GlobalMemoryBuffer"
        in spot_problems(Spot("megatron.core.utils:GlobalMemoryBuffer.gone", "method"))[0]
    )
    assert (
        "the patch relies on (self, shape"
        in spot_problems(Spot("megatron.core.utils:GlobalMemoryBuffer.get_tensor", "method", params=("self", "shape")))[
            0
        ]
    )
    assert (
        "no longer holds"
        in spot_problems(
            Spot("megatron.core.utils:GlobalMemoryBuffer.get_tensor", "method", uses=("device=torch.device('cpu')",))
        )[0]
    )
    assert (
        "not a staticmethod"
        in spot_problems(Spot("megatron.core.utils:GlobalMemoryBuffer.get_tensor", "staticmethod"))[0]
    )
    assert "not the torch module" in spot_problems(Spot("megatron.core.utils:GlobalMemoryBuffer", "torch"))[0]
    assert "does not exist" in spot_problems(Spot("megatron.core.no_such_module", "source", uses=("x",)))[0]


def _all_unapplied(monkeypatch) -> list:
    """Mark every compat set unapplied (undone by monkeypatch) and make every `apply` record its call."""
    import dataclasses

    from megatron_hetero.compat import cpu, fixes, megatron_lm

    calls: list = []
    for module, flags in (
        (compat, ("_APPLIED",)),
        (cpu, ("_APPLIED",)),
        (megatron_lm, ("_APPLIED",)),
        (fixes, ("_APPLIED", "_NO_TE_APPLIED")),
    ):
        for flag in flags:
            monkeypatch.setattr(module, flag, False)
    for module, name in (
        (cpu, "PATCHES"),
        (fixes, "FIXES"),
        (fixes, "NO_TE_PATCHES"),
        (megatron_lm, "MEGATRON_LM_PATCHES"),
    ):
        recorded = [
            dataclasses.replace(p, apply=(lambda n=p.name: calls.append(n)) if p.apply else None)
            for p in getattr(module, name)
        ]
        monkeypatch.setattr(module, name, recorded)
    return calls


def test_the_version_gate_refuses_an_untargeted_megatron_core(monkeypatch):
    from megatron.core import package_info

    from megatron_hetero.compat import cpu, fixes, megatron_lm, table

    calls = _all_unapplied(monkeypatch)
    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(compat.UnsupportedMegatronVersion) as info:
        compat.apply_compat()
    text = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "megatron-core 0.99.0 is installed" in text and "supports megatron-core 0.19.*" in text
    assert "'fix.optimizer_param_groups_gather'" in text and "Nothing was patched" in text
    for refused in (
        megatron_lm.apply_megatron_lm_cpu_compat,
        compat.apply_cpu_compat,
        fixes.apply_fixes,
        fixes.apply_megatron_lm_no_te_fixes,
        compat.ensure_global_memory_buffer,
        compat.clip_vit_norm_kwargs,
    ):
        if refused is compat.apply_cpu_compat and torch.cuda.is_available():
            continue  # a no-op with CUDA
        with pytest.raises(table.UnsupportedMegatronVersion, match="0.99.0"):
            refused()
    for scoped in (
        fixes.checkpoint_reads_swapped(lambda d: None, lambda d: {}),
        fixes.param_groups_gathered_over(None),
        fixes.datasets_built_on_every_rank(),
    ):
        with pytest.raises(table.UnsupportedMegatronVersion, match="0.99.0"):
            with scoped:
                pass
    assert calls == [] and not compat.compat_applied()
    # the same with the version supported: everything is applied, once
    monkeypatch.setattr(package_info, "__version__", "0.19.2")
    compat.apply_compat()
    compat.apply_compat()
    assert compat.compat_applied()
    applied = [p.name for p in fixes.FIXES if p.apply] + (
        [] if torch.cuda.is_available() else [p.name for p in cpu.PATCHES]
    )
    assert sorted(calls) == sorted(applied)


def test_datasets_built_on_every_rank_is_scoped_and_undone_on_error(monkeypatch):
    from megatron.core import mpu, parallel_state

    from megatron_hetero.compat import fixes

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 3)
    orig = parallel_state.get_tensor_model_parallel_rank
    with fixes.datasets_built_on_every_rank():
        assert parallel_state.get_tensor_model_parallel_rank() == 0
        assert mpu.get_tensor_model_parallel_rank() == 0  # pretrain_gpt's name for the same module
    assert parallel_state.get_tensor_model_parallel_rank is orig
    with pytest.raises(KeyError):
        with fixes.datasets_built_on_every_rank():
            raise KeyError("the provider failed")
    assert parallel_state.get_tensor_model_parallel_rank() == 3


def test_a_target_may_be_a_version_glob():
    import dataclasses

    from megatron_hetero.compat import fixes, table

    entry = dataclasses.replace(fixes.PARAM_GROUPS_GATHER, targets=("0.16.1", "0.19.*"))
    assert table.check_targets([entry], "0.19.2") == "0.19.2" and table.check_targets([entry], "0.16.1") == "0.16.1"
    with pytest.raises(
        table.UnsupportedMegatronVersion, match="0.17.0 is installed.*fix.optimizer_param_groups_gather"
    ):
        table.check_targets([entry], "0.17.0")
    assert table.megatron_core_version() == __import__("importlib.metadata").metadata.version("megatron-core")


def test_the_version_ignores_megatron_cores_git_label(monkeypatch):
    """Megatron-core appends ``+<git hash>`` to its version inside a git work tree; the gate reads the release."""
    from megatron.core import package_info

    from megatron_hetero.compat import table

    monkeypatch.setattr(package_info, "__version__", "0.19.2+3987f83")
    assert table.megatron_core_version() == "0.19.2"
    monkeypatch.setattr(package_info, "__version__", "0.16.1+abc")
    with pytest.raises(table.UnsupportedMegatronVersion, match="megatron-core 0.16.1 is installed"):
        table.check_targets(compat.FIXES)


def test_library_code_assumes_compat_was_applied(monkeypatch):
    from megatron_hetero.training.setup import JobConfig
    from megatron_hetero.training.trainer import prepare_rank

    compat.require_compat("anything")  # the session applied it
    monkeypatch.setattr(compat, "_APPLIED", False)
    with pytest.raises(
        RuntimeError, match=r"training.trainer.prepare_rank needs megatron_hetero.compat.apply_compat\(\)"
    ):
        prepare_rank(JobConfig())


def test_the_cli_applies_compat_and_reports_a_refusal(monkeypatch, capsys):
    from megatron.core import package_info

    from megatron_hetero import cli
    from megatron_hetero.runtime import launcher

    def no_ranks(*a, **k):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher, "run_ranks", no_ranks)
    _all_unapplied(monkeypatch)
    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    layout = str(Path(__file__).resolve().parents[2] / "examples" / "layouts" / "colocated_equal_dp_cp.yaml")
    assert cli.main(["train", "--hetero-layout", layout, "--train-iters", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("megatron-hetero train: megatron-core 0.99.0 is installed") and "Traceback" not in err


def test_apply_compat_is_called_at_the_entry_points_only():
    """The CLI, the Megatron-LM launcher, the benchmark scripts' main, tests/conftest.py, and the two
    test programs that start processes of their own (the fork runner for Megatron-LM's scripts, the
    fresh-process import check); library code asserts (require_compat) instead."""
    repo = Path(__file__).resolve().parents[2]
    calls = sorted(
        f"{p.relative_to(repo)}:{line.strip()}"
        for p in [*(repo / "megatron_hetero").rglob("*.py"), *(repo / "tests").rglob("*.py")]
        if "compat" not in p.relative_to(repo).parts[1:2] and p.name != "test_compat.py"
        for line in p.read_text().splitlines()
        if re.match(r"\s*apply_(megatron_lm_cpu_)?compat\(\)", line)
    )
    assert [c.split(":")[0] for c in calls] == [
        "megatron_hetero/bench/cost_check.py",
        "megatron_hetero/bench/gpu_calibrate.py",
        "megatron_hetero/bench/trace_overhead.py",
        "megatron_hetero/cli/__init__.py",
        "megatron_hetero/megatron_lm/run.py",
        "megatron_hetero/profiling/gpu_preset.py",
        "tests/conftest.py",
        "tests/e2e/test_fresh_process_imports.py",
        "tests/megatron_fork.py",
    ], "\n".join(calls)
