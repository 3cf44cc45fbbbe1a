"""Mixture-of-experts language model: validation (pure), and fp32 parity of EP layouts against the
world-1 run of the same model (same experts, same data, same seed).

Every layout starts from the same weights: expert k of layer l is initialised from its global
index, whatever EP rank holds it. Experts reduce their gradients over the expert-DP group, dense
parameters over the module's DP x CP group (Megatron DDP with the module's ProcessGroupCollection).
The load-balancing loss enters the gradient (weight: the micro-batch's tokens over the step's loss
tokens) and is reported as `aux_loss`. Micro-batches hold one sample everywhere (micro-batch size 1,
as in the world-1 run), so the auxiliary loss, a function of each micro-batch's routing, is the same
sum in every layout. Tolerance: 1e-5 relative (per-step loss, aux loss, grad norm, every parameter).

Expert TP (`expt_tp` 2, TP2·DP2·EP2 with SP and swiglu, clipped): each expert's fc1/fc2 is split over
the expert-TP group and joined back for the comparison as Megatron's sharded_state_dict lays it out
(`join_expert_tp`); on gloo the dispatcher's uneven expert-TP all-gather runs through compat's
`cpu.gloo_uneven_all_gather`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.layout.validate import check_experts

if TYPE_CHECKING:  # this module imports no torch when collected
    import torch

MOE_KW = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_ffn_hidden_size=64)
CLIP = 0.9  # --clip-grad of the expert-TP case: its world-1 grad norms are 1.26-2.95, so every step clips


# -- validation (pure) --------------------------------------------------------------------------------
def _layout(lang: dict, placement: str = "colocated", world: int | None = None):
    return layout_from_dict(
        {"placement": placement, "modules": {"vision": {"dp": 4}, "language": lang}, "edges": ["vision -> language"]},
        world_size=world,
    )


def test_ep_must_divide_experts():
    with pytest.raises(ValueError, match=r"module language: ep\(4\) does not divide --num-experts 6 \(6 % 4 = 2\)"):
        check_experts(_layout({"dp": 4, "ep": 4}), {"language": 6})


def test_ep_on_dense_module_is_an_error():
    with pytest.raises(ValueError, match=r"module language: ep\(2\) expt_tp\(1\) > 1 but the module has no experts"):
        check_experts(_layout({"dp": 4, "ep": 2}), {"language": None})
    with pytest.raises(ValueError, match=r"module vision: ep\(2\)"):
        layout = layout_from_dict(
            {
                "placement": "colocated",
                "modules": {"vision": {"dp": 4, "ep": 2}, "language": {"dp": 4}},
                "edges": ["vision -> language"],
            }
        )
        check_experts(layout, {"language": 4})


def test_expert_folding_must_divide_the_stage():
    with pytest.raises(
        ValueError,
        match=r"module language: expert-tp\(1\)\*ep\(4\)=4 does not divide "
        r"tp\(2\)\*cp\(1\)\*dp\(1\)=2",
    ):
        _layout({"tp": 2, "pp": 2, "ep": 4})


def test_valid_expert_layouts_pass():
    check_experts(_layout({"dp": 4, "ep": 4}), {"language": 4})
    check_experts(_layout({"pp": 2, "dp": 2, "ep": 2}, world=4), {"language": 8})
    # expert TP on any backend (gloo: compat's cpu.gloo_uneven_all_gather)
    check_experts(_layout({"dp": 4, "ep": 2, "expt_tp": 2}), {"language": 4})


# -- multi-rank parity ----------------------------------------------------------------------------------
_EXPERT = re.compile(r"(^|\.)experts\.local_experts\.(\d+)\.")


def join_expert_tp(name: str, parts: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """One expert tensor whole from its expert-TP shards `parts` (in expert-TP rank order), as
    Megatron's expert `sharded_state_dict` lays it out: fc1 (column-parallel) along dim 0, and when
    `gated` (swiglu) each shard is [gate_r; up_r], so the gate halves are joined and then the up
    halves ([gate_0..gate_n-1; up_0..up_n-1]); fc2's weight (row-parallel) along its input dim 1;
    fc2's bias is replicated over expert TP (replicas checked equal)."""
    import torch

    from parity import _split_dim

    dim = _split_dim(name)
    if len(parts) == 1 or dim is None:
        for q in parts[1:]:
            assert (q - parts[0]).abs().max() <= 1e-6 * parts[0].abs().max(), f"expert-TP replicas of {name} differ"
        return parts[0]
    if gated and ".linear_fc1." in name:
        halves = [q.chunk(2, dim=dim) for q in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def moe_full_params(
    per_rank: list[dict], num_experts: int, ep: int, gated: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Full parameters by (module, global name): dense ones as `parity.full_params`; expert ones by
    global expert index (local index + ep rank * experts per rank) and global layer index, from
    every rank that holds them (EP groups span DP ranks), expert-DP replicas checked equal, and the
    expert-TP shards joined (`join_expert_tp`; `gated`: the model's --swiglu)."""
    from parity import _LAYER, _layers_per_stage, full_params

    dense_only = [
        dict(
            r,
            params={m: {n: t for n, t in ps.items() if not _EXPERT.search(n)} for m, ps in r.get("params", {}).items()},
        )
        for r in per_rank
    ]
    out = full_params(dense_only)
    local = num_experts // ep
    per_stage = _layers_per_stage(per_rank, "language")
    shards: dict[str, dict[int, torch.Tensor]] = {}  # global name -> expert-TP rank -> the shard
    for r in per_rank:
        if "language" not in r.get("params", {}):
            continue
        ps, c = r["params"]["language"], r["coords"]["language"]
        for n, t in ps.items():
            mt = _EXPERT.search(n)
            if not mt:
                continue
            g = _EXPERT.sub(
                lambda m: f"{m.group(1)}experts.local_experts.{int(m.group(2)) + c['ep'] * local}.", n, count=1
            )
            g = _LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + c['pp'] * per_stage}.", g, count=1)
            have = shards.setdefault(g, {}).get(c["expt_tp"])
            if have is None:
                shards[g][c["expt_tp"]] = t
            else:
                assert (have - t).abs().max() <= 1e-6 * have.abs().max(), f"expert-DP replicas of {g} differ"
    for g, by_etp in shards.items():
        out["language"][g] = join_expert_tp(g, [by_etp[k] for k in sorted(by_etp)], gated)
    return out


def _moe_job(steps: int = 5, sequence_parallel: bool = False, clip_grad: float = 0.0, **over):
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.module_state import OptimConfig
    from megatron_hetero.training.setup import JobConfig

    spec = LlavaSpec(**{**MOE_KW, **over})
    return JobConfig(
        spec=spec,
        global_batch_size=8,
        micro_batch_size=1,
        train_iters=steps,
        optim=OptimConfig(optimizer="sgd", lr=0.5, clip_grad=clip_grad),
        sequence_parallel=sequence_parallel,
    )


_REF: dict = {}


def _reference(job):
    from parity import losses, run_job, world1_doc

    key = repr(job)
    if key not in _REF:
        per_rank = run_job(world1_doc(job), 1, job)
        _REF[key] = (
            losses(per_rank),
            [r["aux_loss"] for r in per_rank[0]["records"]],
            [r["grad_norm"] for r in per_rank[0]["records"]],
            moe_full_params(per_rank, job.spec.num_experts, 1, gated=job.spec.swiglu),
        )
    return _REF[key]


def _doc(placement: str, vision: dict, language: dict) -> dict:
    return {
        "placement": placement,
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


CASES = [
    ("colocated enc TP2·DP2, LLM DP4·EP2", _doc("colocated", {"tp": 2, "dp": 2}, {"dp": 4, "ep": 2}), 4),
    ("colocated enc DP4, LLM PP2·DP2·EP2", _doc("colocated", {"dp": 4}, {"pp": 2, "dp": 2, "ep": 2}), 4),
    ("colocated enc TP2·DP4, LLM DP8·EP4", _doc("colocated", {"tp": 2, "dp": 4}, {"dp": 8, "ep": 4}), 8),
    ("disjoint enc DP2 @0-1, LLM DP4·EP4 @2-5", _doc("disjoint", {"dp": 2}, {"dp": 4, "ep": 4}), 6),
    ("disjoint enc TP2 @0-1, LLM PP2·DP2·EP2 @2-5", _doc("disjoint", {"tp": 2}, {"pp": 2, "dp": 2, "ep": 2}), 6),
    # expert TP: each expert's fc1/fc2 split over expt_tp (gated fc1: [gate_r; up_r] per shard), the
    # dispatcher's uneven expert-TP all-gather through compat's cpu.gloo_uneven_all_gather on gloo;
    # Megatron's MoE with TP needs SP; swiglu, and a clip the grad norms engage
    (
        "colocated enc DP4, LLM TP2·DP2·EP2·ETP2 SP swiglu",
        _doc("colocated", {"dp": 4}, {"tp": 2, "dp": 2, "ep": 2, "expt_tp": 2}),
        4,
        dict(sequence_parallel=True, swiglu=True, clip_grad=CLIP),
    ),
]

FIGURES: dict = {}


def _id(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9@-]+", "_", label.replace("·", "."))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("megatron_compat")  # this module imports no torch when collected
@pytest.mark.parametrize("case", CASES, ids=[_id(c[0]) for c in CASES])
def test_moe_parity_with_world1(case):
    from parity import losses, max_loss_rel_diff, max_param_rel_diff, run_job

    label, doc, world, *over = case
    job = _moe_job(**(over[0] if over else {}))
    ref_losses, ref_aux, ref_norms, ref_params = _reference(job)
    per_rank = run_job(doc, world, job, timeout=300)
    ep = doc["modules"]["language"]["ep"]
    got = moe_full_params(per_rank, job.spec.num_experts, ep, gated=job.spec.swiglu)
    dl = max_loss_rel_diff(losses(per_rank), ref_losses)
    da = max_loss_rel_diff([r["aux_loss"] for r in per_rank[0]["records"]], ref_aux)
    dn = max_loss_rel_diff([r["grad_norm"] for r in per_rank[0]["records"]], ref_norms)
    dp, where = max_param_rel_diff(got, ref_params)
    FIGURES[label] = (world, dl, da, dn, dp)
    print(
        f"\n{label} (world {world}): loss {dl:.1e}, aux {da:.1e}, grad norm {dn:.1e}, params {dp:.1e} ({where}); "
        f"grad norms {ref_norms}"
    )
    assert ref_aux[0] > 0
    if job.optim.clip_grad:  # the clip is engaged: the grad norm shapes the update
        assert max(ref_norms) > job.optim.clip_grad, ref_norms
    assert dn <= 1e-5, f"{label}: grad norm differs by {dn:.2e}"
    assert dl <= 1e-5, f"{label}: loss differs by {dl:.2e}: {losses(per_rank)} vs {ref_losses}"
    assert da <= 1e-5, f"{label}: aux loss differs by {da:.2e}"
    assert dp <= 1e-5, f"{label}: parameter {where} differs by {dp:.2e}"
    n_experts = sum(1 for n in got["language"] if _EXPERT.search(n))
    assert n_experts == 2 * 2 * job.spec.num_experts  # 2 layers x (fc1, fc2) x experts, all gathered


def _gradient_groups(layout, job):
    """On this rank: (dense buffer group ranks, expert buffer group ranks, expert parameter count)
    of the language model's DDP, after one step's gradient sync."""
    import torch.distributed as dist

    from megatron_hetero.plan.rank_plan import rank_plan
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import build_states
    from megatron_hetero.training.trainer import prepare_rank

    prepare_rank(job)
    topo = Topology.build(layout)
    try:
        plan = rank_plan(layout, topo.rank, job.global_batch_size, job.micro_batch_size)
        states = build_states(plan, job, topo)
        ddp = states["language"].ddp
        dense = {tuple(dist.get_process_group_ranks(b.data_parallel_group)) for b in ddp.buffers}
        expert = {tuple(dist.get_process_group_ranks(b.data_parallel_group)) for b in ddp.expert_parallel_buffers}
        n_expert = sum(1 for p in ddp.module.parameters() if not getattr(p, "allreduce", True))
        return sorted(dense), sorted(expert), n_expert
    finally:
        topo.destroy()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("megatron_compat")
def test_expert_gradients_reduce_over_expert_dp():
    """LLM DP8·EP4 on 8 ranks: dense buffers reduce over the 8 DP ranks, expert buffers over the
    expert-DP pairs {r, r+4} (ranks holding the same experts); `finalize_grads` (DDP's
    finish_grad_sync) covers both kinds of bucket groups."""
    from megatron_hetero.runtime.launcher import run_ranks

    job = _moe_job(steps=1)
    layout = layout_from_dict(_doc("colocated", {"dp": 8}, {"dp": 8, "ep": 4}), world_size=8)
    out = run_ranks(8, _gradient_groups, layout, job, timeout=120)
    for rank, (dense, expert, n_expert) in enumerate(out):
        assert dense == [tuple(range(8))], (rank, dense)
        assert expert == [(rank % 4, rank % 4 + 4)], (rank, expert)
        assert n_expert == 2 * 2 * 1  # 2 layers x (fc1, fc2) x 4/4 local experts


# -- train rejects invalid expert layouts before any rank starts ------------------------------------------
@pytest.mark.parametrize(
    "layout_flags,moe_flags,message",
    [
        (["language:dp=4,ep=4"], ["--num-experts", "6"], "module language: ep(4) does not divide --num-experts 6"),
        (["language:dp=4,ep=2"], [], "module language: ep(2) expt_tp(1) > 1 but the module has no experts"),
        (
            ["language:dp=2,ep=4"],
            ["--num-experts", "4"],
            "module language: expert-tp(1)*ep(4)=4 does not divide tp(1)*cp(1)*dp(2)=2",
        ),
        (["language:tp=2,dp=2,ep=2"], ["--num-experts", "4"], "module language: ep(2) with tp(2) > 1 needs sequence"),
    ],
)
def test_train_rejects_invalid_expert_layouts_with_exit_2(capsys, monkeypatch, layout_flags, moe_flags, message):
    from megatron_hetero import cli
    from megatron_hetero.runtime import launcher

    def no_ranks(*a, **k):  # pragma: no cover - reaching it is the failure
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launcher, "run_ranks", no_ranks)
    vision = "vision:dp=2" if layout_flags[0].startswith("language:dp=2") else "vision:dp=4"
    if "tp=2,dp=2" in layout_flags[0]:
        vision = "vision:dp=4"
    argv = [
        "train",
        "--hetero-module",
        vision,
        "--hetero-module",
        *layout_flags,
        "--hetero-edge",
        "vision->language",
        "--train-iters",
        "1",
        *moe_flags,
    ]
    rc = cli.main(argv)
    _, err = capsys.readouterr()
    assert rc == 2, err
    assert message in err, err


def test_train_starts_expert_tp_on_gloo(capsys, monkeypatch):
    """`language:tp=2,dp=2,ep=2,expt_tp=2` with --sequence-parallel on gloo passes validation and
    reaches the ranks (it was refused as needing NCCL before compat's cpu.gloo_uneven_all_gather)."""
    from megatron_hetero import cli
    import megatron_hetero.compat as compat
    from megatron_hetero.runtime import launcher

    started: list[int] = []

    def no_ranks(world, *a, **k):
        started.append(world)
        raise KeyboardInterrupt  # stop here: the CLI maps it to its own exit code

    monkeypatch.setattr(compat, "default_backend", lambda: "gloo")
    monkeypatch.setattr(launcher, "run_ranks", no_ranks)
    argv = ["train", "--hetero-module", "vision:dp=4", "--hetero-module", "language:tp=2,dp=2,ep=2,expt_tp=2"]
    argv += ["--hetero-edge", "vision->language", "--train-iters", "1", "--num-experts", "4", "--sequence-parallel"]
    cli.main(argv)
    _, err = capsys.readouterr()
    assert started == [4], err
    assert "NCCL" not in err, err


# -- cost model and search (pure) ----------------------------------------------------------------------
def _cost_setup():
    from pathlib import Path

    from megatron_hetero.planner import hardware as HW
    from megatron_hetero.planner import workload as W

    hw = HW.HardwareSpec.load(
        Path(__file__).resolve().parents[2] / "megatron_hetero" / "planner" / "hardware_presets" / "h100_80gb.json"
    )
    prof = HW.Profile.from_hardware(hw)
    enc = W.ModelSpec("vision", 6, 1024, 4096, 16, 256, kind="encoder")
    moe = W.ModelSpec(
        "language", 8, 2048, 5632, 16, 2048, vocab=32000, gated=True, num_experts=16, moe_topk=2, moe_ffn_hidden=2816
    )
    return W, prof, enc, moe


def test_cost_prices_expert_memory_and_dispatch():
    from megatron_hetero.planner.cost import evaluate

    W, prof, enc, moe = _cost_setup()
    wl = W.Workload(encoder=enc, llm=moe, global_batch=64)
    cost = {}
    for ep in (1, 2, 4, 8):
        c = W.Candidate(
            "colocated", W.Segment.of(1, 1, 1, 8, enc.num_layers), (W.Segment.of(1, 1, 1, 8, moe.num_layers, ep=ep),)
        )
        cost[ep] = evaluate(c, wl, prof)
    # expert state shrinks with ep; the dispatch all-to-all appears with ep > 1
    assert (
        cost[1].memory_per_rank_peak
        > cost[2].memory_per_rank_peak
        > cost[4].memory_per_rank_peak
        > cost[8].memory_per_rank_peak
    )
    assert cost[2].tp_comm > cost[1].tp_comm == 0.0
    # compute sees top-k experts, not all of them: the same as a dense MLP of topk * expert width
    dense_eq = W.ModelSpec("language", 8, 2048, 2 * 2816, 16, 2048, vocab=32000, gated=True)
    d = evaluate(
        W.Candidate("colocated", W.Segment.of(1, 1, 1, 8, enc.num_layers), (W.Segment.of(1, 1, 1, 8, 8),)),
        W.Workload(encoder=enc, llm=dense_eq, global_batch=64),
        prof,
    )
    assert abs(d.compute - cost[1].compute) <= 1e-12 * d.compute
    # the candidate's layout carries ep
    layout = W.Candidate(
        "colocated", W.Segment.of(1, 1, 1, 8, enc.num_layers), (W.Segment.of(1, 1, 1, 8, moe.num_layers, ep=4),)
    ).to_layout()
    assert layout.module("language").ep == 4
    with pytest.raises(ValueError, match=r"ep\(3\) must divide the LLM's 16 experts"):
        evaluate(
            W.Candidate(
                "colocated", W.Segment.of(1, 1, 1, 6, enc.num_layers), (W.Segment.of(1, 1, 1, 6, moe.num_layers, ep=3),)
            ),
            W.Workload(encoder=enc, llm=moe, global_batch=12),
            prof,
        )


def test_search_picks_ep_when_experts_do_not_fit():
    from megatron_hetero.planner import search as S
    from megatron_hetero.planner import search_space as SP
    from megatron_hetero.planner.cost import evaluate

    W, prof, enc, moe = _cost_setup()
    big = W.ModelSpec(
        "language", 8, 2048, 5632, 16, 2048, vocab=32000, gated=True, num_experts=64, moe_topk=2, moe_ffn_hidden=5632
    )
    wl = W.Workload(encoder=enc, llm=big, global_batch=64)
    space = SP.SearchSpace(placements=("colocated",), tp=(1, 2), cp=(1,), pp=(1, 2), encoder_tp=(1,), encoder_pp=(1,))
    ep1 = evaluate(
        W.Candidate("colocated", W.Segment.of(1, 1, 1, 8, enc.num_layers), (W.Segment.of(1, 1, 1, 8, big.num_layers),)),
        wl,
        prof,
    )
    limit = 0.5 * ep1.memory_per_rank_peak  # the experts of every layer do not fit on one rank
    res = S.search(wl, prof, 8, memory_limit=limit, space=space, top=3)
    best = res.best.candidate
    assert best.llm[0].ep > 1, best.describe()
    assert res.best.breakdown.memory_per_rank_peak <= limit
    # without experts the search never proposes ep
    dense = W.Workload(
        encoder=enc, llm=W.ModelSpec("language", 8, 2048, 5632, 16, 2048, vocab=32000, gated=True), global_batch=64
    )
    assert all(r.candidate.llm[0].ep == 1 for r in S.search(dense, prof, 8, space=space, top=5).ranked)
