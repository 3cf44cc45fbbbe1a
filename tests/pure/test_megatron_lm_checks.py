"""What `pretrain_gpt.py` / `pretrain_vlm.py` refuse with a layout, before any process group or model
(pure: parsed Megatron arguments as a namespace; no Megatron-LM tree needed). The end-to-end runs are
in tests/e2e/test_megatron_lm.py."""

from __future__ import annotations

import argparse
import re

import pytest

from megatron_hetero.layout.yaml_io import layout_from_dict
from megatron_hetero.megatron_lm.driver import check_common, check_uneven_pipeline, pipeline_split
from megatron_hetero.megatron_lm.gpt import check_gpt, segment_layers
from megatron_hetero.megatron_lm.vlm import check_vlm
from megatron_hetero.config.optim import OptimConfig

SEGMENTS = {
    "language_a": {"tp": 2, "layers": "0-1", "ranks": "0-1"},
    "language_b": {"dp": 2, "layers": "2-3", "ranks": "2-3"},
}


def _args(**kw) -> argparse.Namespace:
    base = dict(
        num_layers=4,
        num_attention_heads=4,
        untie_embeddings_and_output_weights=True,
        save=None,
        load=None,
        clip_grad=0.0,
        context_parallel_size=1,
        pipeline_model_parallel_size=1,
        optimizer="adam",
        ckpt_format="torch",
        hetero_init="reference",
        eval_iters=1,
        full_validation=False,
        multiple_validation_sets=False,
        train_iters=3,
        rampup_batch_size=None,
        decoder_num_layers=None,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _layout(modules: dict, edges=("language_a -> language_b",), placement: str = "disjoint", world: int = 4):
    return layout_from_dict({"placement": placement, "modules": modules, "edges": list(edges)}, world)


def test_segments_are_accepted_and_count_their_layers():
    layout = _layout(SEGMENTS)
    check_gpt(_args(), layout)
    check_common(_args(), layout)
    assert [segment_layers(_args(), m) for m in layout.modules] == [2, 2]
    one = _layout({"language": {"tp": 2, "dp": 2}}, edges=(), placement="colocated")
    check_gpt(_args(untie_embeddings_and_output_weights=False), one)  # one stage: tied embeddings are local
    assert segment_layers(_args(), one.module("language")) == 4


@pytest.mark.parametrize(
    "args, modules, edges, world, message",
    [
        (
            _args(num_layers=6),
            SEGMENTS,
            ("language_a -> language_b",),
            4,
            "the segments cover layers 0-3 (4 layers); --num-layers is 6",
        ),
        (
            _args(untie_embeddings_and_output_weights=False),
            SEGMENTS,
            ("language_a -> language_b",),
            4,
            "pass --untie-embeddings-and-output-weights",
        ),
        (_args(), SEGMENTS, (), 4, "needs exactly the edges between consecutive segments ['language_a -> language_b']"),
        (
            _args(),
            {**SEGMENTS, "vision": {"ranks": "4-4"}},
            ("vision -> language_a", "language_a -> language_b"),
            5,
            "takes language modules only",
        ),
        (
            _args(),
            {
                "language_a": {"tp": 2, "pp": 2, "layers": "0-2", "ranks": "0-3"},
                "language_b": {"layers": "3-3", "ranks": "4-4"},
            },
            ("language_a -> language_b",),
            5,
            "module language_a: 3 layers do not split over pp(2)",
        ),
        (_args(sft=True), SEGMENTS, ("language_a -> language_b",), 4, "--sft is not supported"),
    ],
)
def test_gpt_refusals_name_the_reason(args, modules, edges, world, message):
    with pytest.raises(ValueError) as info:
        check_gpt(args, _layout(modules, edges, world=world))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(bf16=True, loss_scale=1024.0), "--loss-scale 1024.0 needs --fp16 (bf16 and fp32 train with the loss"),
        (
            dict(num_attention_heads=3),
            "module language_a: 3 attention heads (--num-attention-heads) are not divisible by tp(2)",
        ),
        (dict(mtp_num_layers=1), "--mtp-num-layers is not supported"),
        (dict(eval_iters=1, full_validation=True), "--full-validation is not supported"),
        (dict(train_iters=None), "--train-iters is required"),
        (
            dict(use_distributed_optimizer=True, overlap_param_gather=True),
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce",
        ),
        (
            dict(overlap_grad_reduce=True, overlap_param_gather=True),
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce",
        ),
        (dict(save="ckpt", ckpt_format="zarr"), "--ckpt-format zarr is not supported with a layout and --load/--save"),
        (dict(load="ckpt", ckpt_format="torch_dcp"), "--ckpt-format torch_dcp is not supported with a layout"),
        (dict(save="ckpt", hetero_init="module"), "--save with a layout needs --hetero-init reference"),
        (dict(use_distributed_optimizer=True, optimizer="sgd"), "--use-distributed-optimizer needs --optimizer adam"),
    ],
)
def test_common_refusals_name_the_flag(kw, message):
    with pytest.raises(ValueError) as info:
        check_common(_args(**kw), _layout(SEGMENTS))
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(optimizer="adagrad"), "--optimizer must be adam or sgd, got 'adagrad'"),
        (dict(bf16=True, fp16=True), "--bf16 and --fp16 exclude each other"),
        (dict(bf16=True, loss_scale=1024.0), "--loss-scale 1024.0 needs --fp16"),
        (dict(overlap_grad_reduce=True, overlap_param_gather=True), "--overlap-param-gather needs"),
        (dict(use_distributed_optimizer=True, optimizer="sgd"), "--use-distributed-optimizer needs --optimizer adam"),
    ],
)
def test_the_optimizer_rules_are_trains(kw, message):
    """One set of optimizer rules: a Megatron-LM script and `train` (`OptimConfig.validate`) refuse the
    same settings with the same line."""
    with pytest.raises(ValueError) as script:
        check_common(_args(**kw), _layout(SEGMENTS))
    with pytest.raises(ValueError) as train:
        OptimConfig(**kw).validate()
    assert str(script.value) == str(train.value) and message in str(train.value)


def test_the_distributed_optimizer_is_accepted():
    check_common(_args(use_distributed_optimizer=True), _layout(SEGMENTS))


def test_overlap_param_gather_is_accepted_with_the_distributed_optimizer_and_overlap_grad_reduce():
    check_common(
        _args(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True), _layout(SEGMENTS)
    )
    # the overlap of gradient reduction (the e2e run: test_gpt_segments_with_overlap_grad_reduce_and_param_gather_match)
    check_common(_args(use_distributed_optimizer=True, overlap_grad_reduce=True), _layout(SEGMENTS))
    check_common(_args(overlap_grad_reduce=True, save="ckpt"), _layout(SEGMENTS))  # plain optimizer: saves
    # and with the distributed optimizer (test_gpt_segments_torch_dist_distributed_optimizer_both_ways)
    for kw in (dict(save="ckpt"), dict(load="ckpt")):
        check_common(_args(use_distributed_optimizer=True, overlap_grad_reduce=True, **kw), _layout(SEGMENTS))


def test_bf16_and_fp16_are_accepted():
    check_common(_args(bf16=True, use_distributed_optimizer=True), _layout(SEGMENTS))
    check_common(_args(fp16=True, loss_scale=1024.0), _layout(SEGMENTS))  # the e2e runs: test_megatron_lm_precision


@pytest.mark.parametrize("kw", [dict(bf16=True, save="ckpt", load="ckpt"), dict(fp16=True, load="ckpt")])
def test_bf16_and_fp16_are_accepted_with_save_and_load(kw):
    """The checkpoint carries the fp32 main weights and the loss scale (test_megatron_lm_checkpoints)."""
    check_common(_args(**kw), _layout(SEGMENTS))
    check_common(_args(**kw, use_distributed_optimizer=True), _layout(SEGMENTS))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_gpt_segments_save_and_load_are_accepted_with_the_distributed_optimizer(fmt):
    args = _args(save="ckpt", load="ckpt", ckpt_format=fmt, use_distributed_optimizer=True)
    check_gpt(args, _layout(SEGMENTS, ("language_a -> language_b",)))
    check_common(args, _layout(SEGMENTS))


def test_swiglu_is_accepted_and_a_modules_own_recompute_is_refused():
    check_common(_args(swiglu=True), _layout(SEGMENTS))  # the gated fc1 is resharded (weights.py)
    own = {**SEGMENTS, "language_b": {**SEGMENTS["language_b"], "recompute": {"granularity": "selective"}}}
    with pytest.raises(ValueError) as info:
        check_common(_args(), _layout(own))
    assert "module language_b: a layout's own recompute is for megatron-hetero train" in str(info.value)
    assert "--recompute-granularity" in str(info.value)


MOE = dict(num_experts=4, expert_model_parallel_size=1, moe_grouped_gemm=False, distributed_backend="gloo")


def test_gpt_moe_is_accepted_with_expert_parallel_modules():
    layout = _layout({"language": {"dp": 2, "ep": 2}}, edges=(), placement="colocated", world=2)
    check_gpt(_args(**MOE), layout)
    check_common(_args(**MOE), layout)
    check_gpt(_args(**MOE, save="ckpt", load="ckpt"), layout)  # experts gathered by their EP holder
    # a module with tp > 1 and --sequence-parallel (the e2e run: TP2·DP2·EP2 in test_megatron_lm_moe)
    tp2 = _layout({"language": {"tp": 2, "dp": 2, "ep": 2}}, edges=(), placement="colocated", world=4)
    check_gpt(_args(**MOE, sequence_parallel=True, expert_tensor_parallel_size=1, seq_length=32), tp2)
    # expert TP on gloo too (compat cpu.gloo_uneven_all_gather; `train` still asks for NCCL)
    etp2 = _layout({"language": {"tp": 2, "dp": 2, "ep": 2, "expt_tp": 2}}, edges=(), placement="colocated", world=4)
    check_gpt(_args(**MOE, sequence_parallel=True, seq_length=32), etp2)


@pytest.mark.parametrize(
    "kw, modules, message",
    [
        ({"num_experts": 3}, {"language": {"dp": 2, "ep": 2}}, r"ep\(2\) does not divide --num-experts 3"),
        ({}, {"language": {"tp": 2}}, r"tp\(2\) > 1 with --num-experts needs --sequence-parallel"),
        (
            {"expert_tensor_parallel_size": 2, "sequence_parallel": True, "seq_length": 32},
            {"language": {"tp": 2}},
            r"--expert-tensor-parallel-size 2: with a layout .* the layout's expt_tp",
        ),
        ({"expert_model_parallel_size": 2}, {"language": {"dp": 2}}, "--expert-model-parallel-size 2: with a layout"),
        ({"moe_grouped_gemm": True}, {"language": {"dp": 2}}, "--moe-grouped-gemm is not supported"),
    ],
)
def test_gpt_moe_refusals_name_the_reason(kw, modules, message):
    layout = _layout(modules, edges=(), placement="colocated", world=2)
    with pytest.raises(ValueError, match=message):
        check_gpt(_args(**{**MOE, **kw}), layout)


def test_expert_parallelism_without_experts_and_vlm_moe_are_refused():
    layout = _layout({"language": {"dp": 2, "ep": 2}}, edges=(), placement="colocated", world=2)
    with pytest.raises(ValueError, match=r"expert parallelism needs a model with experts \(--num-experts"):
        check_common(_args(), layout)
    vlm = _layout(
        {"vision": {"dp": 2}, "language": {"dp": 2}}, edges=("vision -> language",), placement="colocated", world=2
    )
    with pytest.raises(ValueError, match="--num-experts is not supported with pretrain_vlm.py"):
        check_vlm(_args(num_experts=4), vlm)


def test_vlm_refuses_segments_and_uneven_pipeline_splits():
    with pytest.raises(ValueError, match="exactly the modules 'vision' and 'language'"):
        check_vlm(_args(), _layout(SEGMENTS))
    vlm = _layout(
        {"vision": {"dp": 3}, "language": {"pp": 3}}, edges=("vision -> language",), placement="colocated", world=3
    )
    with pytest.raises(ValueError, match=r"module language: 2 decoder layers do not split over pp\(3\)"):
        check_vlm(_args(decoder_num_layers=2), vlm)
    pipelined_encoder = _layout(
        {"vision": {"pp": 2}, "language": {"dp": 2}}, edges=("vision -> language",), placement="colocated", world=2
    )
    with pytest.raises(ValueError, match=r"module vision: pp=2"):
        check_vlm(_args(), pipelined_encoder)


def test_script_data_that_runs_code_is_refused_unless_trusted(tmp_path, capsys):
    """The data flags' index cache (`PREFIX/cache/...npy`, `--data-cache-path`) and energon datasets
    are read as data before any rank starts (`megatron_lm.data_check`)."""
    import pickle

    import numpy as np

    from megatron_hetero.megatron_lm.data_check import check_script_data, data_findings
    from megatron_hetero.data.dataset_trust import UntrustedDataset

    prefix = tmp_path / "corpus_text_document"
    (prefix / "cache" / "GPTDataset_indices").mkdir(parents=True)
    np.save(prefix / "cache" / "GPTDataset_indices" / "x-document_index.npy", np.arange(3))
    ns = dict(
        data_path=["0.5", str(prefix), "0.5", str(tmp_path / "other")],
        train_data_path=None,
        valid_data_path=None,
        test_data_path=None,
        data_cache_path=None,
        trust_dataset_code=False,
    )
    assert data_findings(argparse.Namespace(**ns)) == []
    (prefix / "cache" / "GPTDataset_indices" / "x-sample_index.npy").write_bytes(pickle.dumps([1, 2]))
    extra = tmp_path / "own-cache"
    extra.mkdir()
    np.save(extra / "blend.npy", np.array([object()], dtype=object), allow_pickle=True)
    ns["data_cache_path"] = str(extra)
    found = data_findings(argparse.Namespace(**ns))
    assert sorted(f.value for f in found) == ["blend.npy", "x-sample_index.npy"]
    with pytest.raises(UntrustedDataset, match="--trust-dataset-code") as info:
        check_script_data(argparse.Namespace(**ns), rank=0)
    assert "x-sample_index.npy" in str(info.value) and "--data-path 0.5" in str(info.value)
    ns["trust_dataset_code"] = True
    check_script_data(argparse.Namespace(**ns), rank=1)
    assert capsys.readouterr().out == ""  # only rank 0 says it
    check_script_data(argparse.Namespace(**ns), rank=0)
    assert "--trust-dataset-code: running the code" in capsys.readouterr().out


def _fake_tree(root, vlm: bytes, gpt: bytes):
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "training" / "training.py").write_text("")
    (root / "pretrain_vlm.py").write_bytes(vlm)
    (root / "pretrain_gpt.py").write_bytes(gpt)
    return root


def test_check_names_a_tag_an_earlier_release_supported(tmp_path, monkeypatch, capsys):
    """A tree at a retired tag (core_v0.16.1: megatron-core 0.16.1, which this version refuses) is
    named with the release it needs, and `check` exits 2; an unknown tree says which tags work."""
    import hashlib

    from megatron_hetero.cli import main
    from megatron_hetero.megatron_lm import tree

    assert list(tree.SUPPORTED) == ["core_v0.19.0"] and "core_v0.16.1" in tree.RETIRED
    assert all(tree.patch_files(tag) for tag in tree.SUPPORTED)
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    _, needs = tree.RETIRED["core_v0.16.1"]
    fake = {"pretrain_vlm.py": (sha(b"vlm 0.16.1"), "-"), "pretrain_gpt.py": ("-", sha(b"gpt 0.16.1 patched"))}
    monkeypatch.setitem(tree.RETIRED, "core_v0.16.1", (fake, needs))
    old = _fake_tree(tmp_path / "old", b"vlm 0.16.1", b"gpt 0.16.1 patched")
    st = tree.check_tree(old)
    assert not st.supported and "core_v0.16.1" in st.reason and "megatron-hetero 0.1.0" in st.reason
    assert "megatron-core 0.16.1" in st.reason and "core_v0.19.0" in st.reason
    assert main(["megatron-lm", "check", str(old)]) == 2
    assert main(["megatron-lm", "check", str(old), "--apply"]) == 2
    assert "core_v0.16.1" in capsys.readouterr().err
    other = _fake_tree(tmp_path / "other", b"something", b"else")
    assert "match no supported tag (core_v0.19.0)" in tree.check_tree(other).reason


def test_vlm_saves_with_a_pipelined_language_model_but_only_in_torch_format():
    vlm = _layout(
        {"vision": {"dp": 2}, "language": {"pp": 2}}, edges=("vision -> language",), placement="colocated", world=2
    )
    check_vlm(_args(decoder_num_layers=2, save="ckpt"), vlm)  # every stage's parameters reach the reference
    with pytest.raises(ValueError, match=r"pretrain_vlm.py takes only --ckpt-format torch .*got torch_dist"):
        check_vlm(_args(decoder_num_layers=2, save="ckpt", ckpt_format="torch_dist"), vlm)


@pytest.mark.parametrize(
    "layers, pp, first, last, want",
    [
        (4, 2, 1, None, [1, 3]),
        (4, 2, None, 1, [3, 1]),
        (4, 2, 1, 3, [1, 3]),
        (4, 3, 2, None, [2, 1, 1]),
        (6, 4, 1, 1, [1, 2, 2, 1]),
        (4, 2, None, None, [2, 2]),
    ],
)
def test_uneven_pipeline_split_follows_megatron(layers, pp, first, last, want):
    """Megatron's rule (`get_num_layers_to_build`): the first/last stage gets its flag's layers, the
    middle stages the rest evenly."""
    assert pipeline_split(layers, pp, first, last, "module language") == want


@pytest.mark.parametrize(
    "kw, modules, world, message",
    [
        (
            dict(decoder_first_pipeline_num_layers=1),
            {"language": {"dp": 2}},
            2,
            "--decoder-first-pipeline-num-layers 1: module language has pp(1); the flags split its own pipeline",
        ),
        (
            dict(decoder_first_pipeline_num_layers=1),
            {"language": {"pp": 3}},
            3,
            "the remaining 3 layers do not split evenly over its 2 middle stage(s) (3 % 2 = 1)",
        ),
        (
            dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1),
            {"language": {"pp": 2}},
            2,
            "2 layers are left for its 0 other stage(s), which must be 0",
        ),
        (
            dict(decoder_last_pipeline_num_layers=4),
            {"language": {"pp": 2}},
            2,
            "0 layers are left for its 1 other stage(s), which must get at least 1 each",
        ),
        (dict(decoder_first_pipeline_num_layers=0), {"language": {"pp": 2}}, 2, "needs at least 1 layer"),
        (
            dict(decoder_last_pipeline_num_layers=1),
            SEGMENTS,
            4,
            "--decoder-last-pipeline-num-layers 1 is not supported with GPT segments: each segment's `layers:`",
        ),
    ],
)
def test_uneven_pipeline_refusals_name_the_flag(kw, modules, world, message):
    placement = "disjoint" if modules is SEGMENTS else "colocated"
    edges = ("language_a -> language_b",) if modules is SEGMENTS else ()
    layout = _layout(modules, edges, placement=placement, world=world)
    with pytest.raises(ValueError) as info:
        check_gpt(_args(**kw), layout)
        check_common(_args(**kw), layout)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_layers_per_virtual_pipeline_stage=1), "--num-layers-per-virtual-pipeline-stage is not supported"),
        (dict(num_virtual_stages_per_pipeline_rank=2), "1F1B without interleaving"),
        (dict(pipeline_model_parallel_layout="Et|tL"), "--pipeline-model-parallel-layout is not supported"),
        (dict(account_for_embedding_in_pipeline_split=True), "use --decoder-first-pipeline-num-layers"),
        (dict(account_for_loss_in_pipeline_split=True), "use --decoder-last-pipeline-num-layers"),
    ],
)
def test_other_pipeline_layout_flags_are_refused_with_the_reason(kw, message):
    """Checked on the parsed flags: `--num-layers-per-virtual-pipeline-stage` sets its own attribute
    (Megatron derives virtual_pipeline_model_parallel_size from it only in validate_args)."""
    layout = _layout({"language": {"pp": 2}}, edges=(), placement="colocated", world=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_common(_args(**kw), layout)


def test_uneven_pipeline_is_accepted_on_the_language_module():
    gpt = _layout({"language": {"pp": 2}}, edges=(), placement="colocated", world=2)
    args = _args(decoder_first_pipeline_num_layers=1)
    check_gpt(args, gpt)  # 4 layers over pp 2 need not divide evenly
    check_common(args, gpt)
    assert check_uneven_pipeline(args, gpt) == ("language", [1, 3])
    assert check_uneven_pipeline(_args(), gpt) is None
    vlm = _layout(
        {"vision": {"dp": 3}, "language": {"pp": 3}}, edges=("vision -> language",), placement="colocated", world=3
    )
    args = _args(decoder_num_layers=5, decoder_last_pipeline_num_layers=1)
    check_vlm(args, vlm)
    assert check_uneven_pipeline(args, vlm) == ("language", [2, 2, 1])


def test_zero_bubble_schedule_is_for_disjoint_layouts():
    colocated = _layout({"vision": {"dp": 2}, "language": {"dp": 2}}, ("vision -> language",), "colocated", 2)
    with pytest.raises(ValueError, match="--hetero-schedule zb applies to the disjoint schedule only"):
        check_common(_args(hetero_schedule="zb"), colocated)
    check_common(_args(hetero_schedule="zb"), _layout(SEGMENTS))
