"""Sequence parallelism in `megatron-hetero train` (`--sequence-parallel`, Megatron's
`sequence_parallel` in the language modules with tp > 1): the activations outside the TP regions are
sharded along the sequence over the module's TP group, the tensors between modules stay whole, and
the gradients of the sequence-parallel parameters (layer norms, row-parallel biases) are summed over
TP in `ModuleState.finalize_grads`. SP changes memory, never the results: fp32, dropout 0, SGD, the
losses, grad norms and parameters with SP equal those of the same layout without it and of the
world-1 run (<= 1e-5 relative). A run that skips the TP all-reduce of those gradients differs (so the
test can fail).

Layouts: colocated vision DP2 + language TP2 (2 ranks); disjoint vision @0 (TP1) -> language TP2·PP2
@1-4 (SP across the language model's pipeline stages, whose P2P tensors are [s/2, b, h]); disjoint
segments vision @0 -> layers 0-1 TP2 @1-2 -> layers 2-3 TP2 @3-4 -> generator head @5 (a segment's
sequence shards gathered before its edge, scattered after it; the head reads the gathered final
hidden states); and Megatron MoE with TP2·EP2 (which Megatron allows only with SP) against world 1.
With SP the reduction order of the layer-norm gradients changes (partial sums over each TP rank's
sequence shard, then the TP all-reduce), hence differences of ~1e-7, not bitwise equality."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.models.llava import LlavaSpec, OutputSpec
from megatron_hetero.runtime.launcher import run_ranks
from megatron_hetero.runtime.module_state import OptimConfig
from megatron_hetero.config.job import Job
from megatron_hetero.training.setup import JobConfig, validate_job, JobDraft

from parity import full_params, losses, max_loss_rel_diff, max_param_rel_diff, world1_doc

TOL = 1e-5
JOB = JobConfig(
    spec=LlavaSpec(num_layers=2),
    global_batch_size=4,
    micro_batch_size=1,
    train_iters=3,
    optim=OptimConfig(optimizer="sgd", lr=0.1),
    comm_timeout_s=60.0,
)
SP = dataclasses.replace(JOB, sequence_parallel=True)
COLOCATED = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language"],
}
DISJOINT = {
    "placement": "disjoint",
    "modules": {"vision": {"ranks": "0-0"}, "language": {"tp": 2, "pp": 2, "ranks": "1-4"}},
    "edges": ["vision -> language"],
}


def _train(job: Job, skip_tp_reduce: bool = False) -> dict:
    """One rank of the job; `skip_tp_reduce`: Megatron's all-reduce of the sequence-parallel gradients
    over TP made a no-op (what a forgotten reduction would give)."""
    import importlib

    from megatron_hetero.training.trainer import train_rank

    if skip_tp_reduce:  # the module (megatron.core.distributed's attribute of that name is the function)
        fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        fmg._allreduce_non_tensor_model_parallel_grads = lambda *a, **k: None
    return train_rank(job, collect_params=True)


def _run(doc: dict, world: int, job: JobConfig, skip_tp_reduce: bool = False) -> list[dict]:
    layout = layout_from_dict(doc, world_size=world)
    return run_ranks(world, _train, validate_job(JobDraft(layout, job)), skip_tp_reduce, timeout=180)


def _norms(per_rank: list[dict]) -> list[float]:
    return [r["grad_norm"] for r in per_rank[0]["records"]]


@pytest.fixture(scope="module")
def world1() -> list[dict]:
    return _run(world1_doc(JOB), 1, JOB)


def _compare(got: list[dict], ref: list[dict]) -> tuple[float, float, float]:
    """(loss, grad norm, parameter) largest relative differences of `got` against `ref`."""
    loss = max_loss_rel_diff(losses(got), losses(ref))
    norm = max_loss_rel_diff(_norms(got), _norms(ref))
    param, _ = max_param_rel_diff(full_params(got), full_params(ref))
    return loss, norm, param


@pytest.mark.timeout(240)
@pytest.mark.parametrize("doc,world", [(COLOCATED, 2), (DISJOINT, 5)], ids=["colocated-tp2", "disjoint-tp2pp2"])
def test_sequence_parallel_matches_without_and_world1(world1, doc, world):
    with_sp = _run(doc, world, SP)
    without = _run(doc, world, JOB)
    for ref, what in ((without, "without SP"), (world1, "world 1")):
        loss, norm, param = _compare(with_sp, ref)
        print(f"{doc['placement']} SP vs {what}: loss {loss:.1e}, grad norm {norm:.1e}, params {param:.1e}")
        assert loss <= TOL and norm <= TOL and param <= TOL, (what, loss, norm, param)
    print(f"losses {losses(with_sp)}, grad norms {_norms(with_sp)}")
    if doc is COLOCATED:  # the sequence-parallel gradients must really be summed over TP
        skipped = _run(doc, world, SP, skip_tp_reduce=True)
        loss = max_loss_rel_diff(losses(skipped), losses(without))
        norm = max_loss_rel_diff(_norms(skipped), _norms(without))
        ln = "gpt.decoder.final_layernorm.weight"
        tp0, tp1 = (r["params"]["language"][ln] for r in skipped[:2])  # ranks 0, 1: TP ranks 0, 1 of DP rank 0
        apart = ((tp0 - tp1).abs().max() / tp0.abs().max()).item()
        print(
            f"SP without the TP all-reduce vs without SP: loss {loss:.1e}, grad norm {norm:.1e}; {ln} on TP ranks 0 and 1 {apart:.1e} apart"
        )
        assert norm > 1e-3 and loss > 1e-5 and apart > 1e-3, (loss, norm, apart)


SEGMENTS = {
    "placement": "disjoint",
    "modules": {
        "vision": {"ranks": "0-0"},
        "language_a": {"tp": 2, "layers": "0-1", "ranks": "1-2"},
        "language_b": {"tp": 2, "layers": "2-3", "ranks": "3-4"},
        "generator": {"ranks": "5-5"},
    },
    "edges": ["vision -> language_a", "language_a -> language_b", "language_b -> generator"],
}
HEAD_SPEC = LlavaSpec(num_layers=4, outputs={"generator": OutputSpec(tokens=4, offset=24, hidden_size=32, out_dim=16)})


@pytest.mark.timeout(240)
def test_sequence_parallel_segments_and_output_head_match_world1():
    job = dataclasses.replace(JOB, spec=HEAD_SPEC)
    got = _run(SEGMENTS, 6, dataclasses.replace(job, sequence_parallel=True))
    w1 = {
        "placement": "colocated",
        "modules": {"vision": {}, "language": {}, "generator": {}},
        "edges": ["vision -> language", "language -> generator"],
    }
    ref = _run(w1, 1, job)
    loss = max_loss_rel_diff(losses(got), losses(ref))
    norm = max_loss_rel_diff(_norms(got), _norms(ref))
    head = max_loss_rel_diff(
        [r["loss_parts"]["generator"] for r in got[0]["records"]],
        [r["loss_parts"]["generator"] for r in ref[0]["records"]],
    )
    param, where = max_param_rel_diff(full_params(got, {"language_a": 0, "language_b": 2}), full_params(ref))
    print(
        f"segments + head with SP vs world 1: loss {loss:.1e}, head loss {head:.1e}, grad norm {norm:.1e}, params {param:.1e} ({where})"
    )
    assert max(loss, norm, head, param) <= TOL, (loss, norm, head, param, where)


@pytest.mark.timeout(240)
def test_sequence_parallel_lets_experts_use_tp_with_ep():
    """Megatron's MoE layers need SP for TP x EP (refused without it): TP2·DP2·EP2 with SP gives the
    world-1 losses, grad norms and load-balancing loss (which each TP rank now holds a part of)."""
    moe = LlavaSpec(num_layers=2, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2)
    job = dataclasses.replace(JOB, spec=moe)
    doc = {
        "placement": "colocated",
        "modules": {"vision": {"dp": 4}, "language": {"tp": 2, "dp": 2, "ep": 2}},
        "edges": ["vision -> language"],
    }
    with pytest.raises(ValueError, match=r"module language: ep\(2\) with tp\(2\) > 1 needs sequence parallelism"):
        validate_job(JobDraft(layout_from_dict(doc, world_size=4), job))
    got = _run(doc, 4, dataclasses.replace(job, sequence_parallel=True))
    ref = _run(world1_doc(job), 1, job)
    aux = [r["aux_loss"] for r in got[0]["records"]], [r["aux_loss"] for r in ref[0]["records"]]
    loss, norm = max_loss_rel_diff(losses(got), losses(ref)), max_loss_rel_diff(_norms(got), _norms(ref))
    da = max_loss_rel_diff(*aux)
    print(f"MoE TP2·DP2·EP2 with SP vs world 1: loss {loss:.1e}, grad norm {norm:.1e}, aux loss {da:.1e} ({aux[1]})")
    assert aux[1][0] > 0 and max(loss, norm, da) <= TOL, (loss, norm, aux)


def test_sequence_parallel_refusals():
    """Refused before any rank starts, naming the module: a sequence a CP x TP split does not divide."""
    bad_seq = dataclasses.replace(SP, spec=LlavaSpec(num_layers=2, seq_length=30))
    doc = {
        "placement": "colocated",
        "modules": {"vision": {"dp": 4}, "language": {"tp": 4}},
        "edges": ["vision -> language"],
    }
    with pytest.raises(ValueError, match=r"module language: --sequence-parallel .*not divisible by cp\*tp = 4"):
        validate_job(JobDraft(layout_from_dict(doc, world_size=4), bad_seq))
    validate_job(JobDraft(layout_from_dict(doc, world_size=4), dataclasses.replace(bad_seq, sequence_parallel=False)))
    # with CP: each CP rank's 20 // 2 positions over tp 4 (2*cp = 4 divides 20, cp*tp = 8 does not)
    doc["modules"] = {"vision": {"dp": 8}, "language": {"tp": 4, "cp": 2}}
    bad_cp = dataclasses.replace(SP, spec=LlavaSpec(num_layers=2, seq_length=20))
    with pytest.raises(ValueError, match=r"module language: --sequence-parallel .*not divisible by cp\*tp = 8"):
        validate_job(JobDraft(layout_from_dict(doc, world_size=8), bad_cp))


def test_train_flag_sets_sequence_parallel_and_bad_input_exits_2(capsys, monkeypatch):
    """`train --sequence-parallel` (Megatron's flag name) reaches the job; an invalid combination exits 2
    with the module named, before any rank starts."""
    from megatron_hetero import cli
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.runtime import launcher
    from megatron_hetero.cli.train_door import job_from_args

    argv = ["train", "--hetero-module", "vision:dp=4", "--hetero-module", "language:tp=4"]
    argv += ["--hetero-edge", "vision->language", "--train-iters", "1"]
    for extra, want in (([], False), (["--sequence-parallel"], True)):
        args = cli.build_parser().parse_args(argv + extra)
        assert job_from_args(args, layout_from_args(args, world_size=None)).config.sequence_parallel is want

    def no_ranks(*a, **k):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher, "run_ranks", no_ranks)
    rc = cli.main(argv + ["--sequence-parallel", "--seq-length", "30"])
    _, err = capsys.readouterr()
    assert rc == 2, err
    assert "module language: --sequence-parallel" in err and "cp*tp = 4" in err, err
