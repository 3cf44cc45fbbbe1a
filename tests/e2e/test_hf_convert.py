"""Start from pretrained weights (`megatron-hetero convert`, `convert/hf_weights.py`, `models/hf_*.py`).

Tiny randomly initialised Hugging Face models (a CLIPVisionModel, a Llama with grouped-query
attention and untied embeddings, a Qwen2 with QKV bias and tied embeddings) are created here and
saved as safetensors; after `convert hf-to-checkpoint` our modules, loaded from the checkpoint under
a layout on 2 forked ranks, compute the Hugging Face forward: CLIP `last_hidden_state` (all 17
tokens, class token first: what the LLaVA projector reads, minus the class token) and
`pooler_output`, and the LM's logits, fp32, within 1e-5 relative (max |ours - hf| / max |hf|)
under TP2 / PP2 / CP2 (language) and TP2 (vision). `checkpoint-to-hf` returns bit-identical tensors.
A model the family cannot express is refused before any weight is read. `transformers` is a test
extra (skipped without it).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.cli import main  # noqa: E402
from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

TOL = 1e-5
B, S, IMG, PATCH = 2, 32, 16, 4
TABLE: list[tuple[str, str, str, float]] = []  # (model, layout, output, max relative difference)


def _tiny_models(root: Path) -> dict[str, Path]:
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    out = {"clip": root / "clip", "llama": root / "llama", "qwen2": root / "qwen2"}
    CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=IMG,
            patch_size=PATCH,
            hidden_act="quick_gelu",
        )
    ).save_pretrained(out["clip"])
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=64,
            rope_theta=500000.0,
        )
    ).save_pretrained(out["llama"])
    Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    ).save_pretrained(out["qwen2"])
    return out


def _convert(argv: list[str]) -> int:
    return main(argv)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """HF folders, their reference outputs, and two converted checkpoints (CLIP+Llama, CLIP+Qwen2)."""
    root = tmp_path_factory.mktemp("hf")
    hf = _tiny_models(root)
    ckpts = {}
    for lm in ("llama", "qwen2"):
        out = root / f"ckpt_{lm}"
        # a world of one in a forked child: the test process keeps no process group
        rc = run_ranks(
            1,
            _convert,
            [
                "convert",
                "hf-to-checkpoint",
                "--vision",
                str(hf["clip"]),
                "--language",
                str(hf[lm]),
                "--seq-length",
                str(S),
                "--out",
                str(out),
            ],
            init_distributed=False,
            timeout=300,
        )[0]
        assert rc == 0
        ckpts[lm] = out
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(B, 3, IMG, IMG, generator=g)
    tokens = torch.randint(0, 64, (B, S), generator=g)
    from transformers import AutoModelForCausalLM, CLIPVisionModel

    ref = {}
    with torch.no_grad():
        v = CLIPVisionModel.from_pretrained(hf["clip"]).eval()(pixel_values=pixels)
        ref["clip"] = (v.last_hidden_state, v.pooler_output)
        for lm in ("llama", "qwen2"):
            ref[lm] = AutoModelForCausalLM.from_pretrained(hf[lm], attn_implementation="eager").eval()(tokens).logits
    return SimpleNamespace(root=root, hf=hf, ckpts=ckpts, pixels=pixels, tokens=tokens, ref=ref)


def _patches(pixels: torch.Tensor) -> torch.Tensor:
    """[b, 3, H, W] -> the data's encoder features [b, (H/p)*(W/p), 3*p*p] (data.energon_data.patchify)."""
    b, c, g = pixels.shape[0], pixels.shape[1], IMG // PATCH
    return pixels.reshape(b, c, g, PATCH, g, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * PATCH * PATCH)


def _forward_rank(doc: dict, root: str, features: torch.Tensor, tokens: torch.Tensor) -> dict:
    """One rank: build the layout's modules, load the checkpoint, run the vision tower and the LM
    (pipeline stages by point-to-point, TP/CP pieces gathered); the full outputs where they are whole."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.models.cp_attention import cp_chunk_positions
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.checkpoint.save_load import load_weights
    from megatron_hetero.training.setup import build_module

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    spec = LlavaSpec.from_record(read_train_state(root)[1]["model"])
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    states = {}
    for m in layout.modules:
        if topo.serves(m.name):
            pgs = topo.pg_collection(m.name)
            states[m.name] = SimpleNamespace(
                name=m.name, module=build_module(m.name, layout, spec, pgs).eval(), pgs=pgs, optimizer=None
            )
    load_weights(root, layout, spec, topo, states)
    out: dict = {}
    with torch.no_grad():
        if "vision" in states:
            mod = states["vision"].module
            feats = mod.features(features)
            out["clip_hidden"], out["clip_pooled"] = feats, mod.ln_post(feats[:, 0])
        st = states["language"]
        mod, pgs = st.module, st.pgs
        pp_rank, pp = pgs.pp.rank(), pgs.pp.size()
        if pp_rank == 0:
            pos = torch.arange(S).unsqueeze(0).expand(B, -1)
            emb = mod.gpt.embedding(input_ids=tokens, position_ids=pos)  # [s, b, h]: text only
            hidden = emb.index_select(0, mod.cp_positions())
        else:
            hidden = torch.empty(S // pgs.cp.size(), B, spec.hidden_size)
            dist.recv(hidden, src=dist.get_global_rank(pgs.pp, pp_rank - 1))
            mod.set_input_tensor(hidden)
            hidden = None
        res = mod(hidden)
        if pp_rank < pp - 1:
            dist.send(res.contiguous(), dst=dist.get_global_rank(pgs.pp, pp_rank + 1))
        else:
            logits = res  # [b, s_local, v_local]
            if pgs.tp.size() > 1:
                parts = [torch.empty_like(logits) for _ in range(pgs.tp.size())]
                dist.all_gather(parts, logits.contiguous(), group=pgs.tp)
                logits = torch.cat(parts, dim=-1)
            if pgs.cp.size() > 1:
                parts = [torch.empty_like(logits) for _ in range(pgs.cp.size())]
                dist.all_gather(parts, logits.contiguous(), group=pgs.cp)
                full = torch.empty(B, S, logits.shape[-1])
                for r, part in enumerate(parts):
                    full[:, cp_chunk_positions(S, r, pgs.cp.size())] = part
                logits = full
            out["logits"] = logits
    topo.destroy()
    return out


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def _layout(vision: dict, language: dict) -> dict:
    return {
        "placement": "colocated",
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


CASES = [  # (language model, layout name, vision layout, language layout)
    ("llama", "TP2", {"tp": 2}, {"tp": 2}),
    ("llama", "PP2", {"dp": 2}, {"pp": 2}),
    ("llama", "CP2", {"dp": 2}, {"cp": 2}),
    ("qwen2", "TP2", {"tp": 2}, {"tp": 2}),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("lm,name,vision,language", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_converted_modules_compute_the_hf_forward(converted, lm, name, vision, language):
    doc = _layout(vision, language)
    per_rank = run_ranks(
        2, _forward_rank, doc, str(converted.ckpts[lm]), _patches(converted.pixels), converted.tokens, timeout=240
    )
    logits = [r["logits"] for r in per_rank if "logits" in r]
    assert logits, "no rank produced the logits"
    for got in logits:
        rel = _rel(got, converted.ref[lm])
        assert rel < TOL, (lm, name, rel)
    TABLE.append((f"{lm} LM logits", f"language {name}", _rel(logits[0], converted.ref[lm])))
    hidden, pooled = converted.ref["clip"]
    for r in per_rank:
        assert _rel(r["clip_hidden"], hidden) < TOL and _rel(r["clip_pooled"], pooled) < TOL
    vname = "TP2" if vision.get("tp") == 2 else "DP2"
    TABLE.append(("CLIP last_hidden_state", f"vision {vname}", _rel(per_rank[0]["clip_hidden"], hidden)))
    TABLE.append(("CLIP pooler_output", f"vision {vname}", _rel(per_rank[0]["clip_pooled"], pooled)))
    print(f"\nequivalence {lm} {name}: " + "; ".join(f"{m} {lay} {d:.2e}" for m, lay, d in TABLE[-3:]))


@pytest.mark.timeout(300)
def test_round_trip_is_bit_identical(converted, tmp_path):
    from safetensors.torch import load_file

    for lm in ("llama", "qwen2"):
        out = tmp_path / lm
        assert (
            run_ranks(
                1,
                _convert,
                ["convert", "checkpoint-to-hf", str(converted.ckpts[lm]), "--out", str(out)],
                init_distributed=False,
                timeout=300,
            )[0]
            == 0
        )
        for src, dst in (("clip", "vision"), (lm, "language")):
            a, b = load_file(converted.hf[src] / "model.safetensors"), load_file(out / dst / "model.safetensors")
            assert sorted(a) == sorted(b), (src, set(a) ^ set(b))
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (src, k)
            assert json.loads((out / dst / "config.json").read_text()) == json.loads(
                (converted.hf[src] / "config.json").read_text()
            )
        assert sorted(load_file(out / "projector" / "model.safetensors")) == [
            f"multi_modal_projector.linear_{i}.{k}" for i in (1, 2) for k in ("bias", "weight")
        ]


def test_unsupported_model_is_refused_before_any_weight_is_read(converted, tmp_path, capsys):
    bad = tmp_path / "bad_llama"
    bad.mkdir()
    cfg = json.loads((converted.hf["llama"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    rc = main(
        [
            "convert",
            "hf-to-checkpoint",
            "--vision",
            str(converted.hf["clip"]),
            "--language",
            str(bad),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "hidden_act 'gelu' is not supported" in err and "SwiGLU" in err, err
    assert not (tmp_path / "out").exists()


def test_mis_shaped_missing_and_unexpected_tensors_are_named(converted, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text((converted.hf["llama"] / "config.json").read_text())
    t = load_file(converted.hf["llama"] / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(60, 32)
    del t["model.layers.1.self_attn.k_proj.weight"]
    t["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(t, str(bad / "model.safetensors"))
    rc = main(
        [
            "convert",
            "hf-to-checkpoint",
            "--vision",
            str(converted.hf["clip"]),
            "--language",
            str(bad),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "missing tensor model.layers.1.self_attn.k_proj.weight (expected shape [16, 32])" in err
    assert "unexpected tensor model.layers.0.extra.weight (shape [2])" in err
    assert "tensor model.layers.0.mlp.up_proj.weight has shape [60, 32], the model expects [64, 32]" in err


def test_train_load_builds_the_recorded_model_and_trains(converted, tmp_path):
    """`train --load DIR` without model flags: the job's model is the checkpoint's (CLIP + Llama),
    it loads under a TP2 layout, and two steps of LLaVA stage 1 (vision and language frozen) run
    with a finite, falling loss; the frozen LM's weights are still the converted ones."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.cli.train_door import job_from_args

    from parity import run_job

    root = str(converted.ckpts["llama"])
    layout_file = tmp_path / "layout.yaml"
    layout_file.write_text(
        "placement: colocated\nmodules:\n  vision: {tp: 2, frozen: true}\n"
        "  language: {tp: 2, frozen: true}\nedges: [vision -> language]\n"
    )
    args = build_parser().parse_args(
        [
            "train",
            "--hetero-layout",
            str(layout_file),
            "--load",
            root,
            "--train-iters",
            "2",
            "--global-batch-size",
            "4",
            "--lr",
            "1e-2",
        ]
    )
    layout = layout_from_args(args)
    job = job_from_args(args, layout).config
    spec = job.spec
    assert spec.encoders["vision"].kind == "clip" and spec.normalization == "RMSNorm" and spec.num_query_groups == 2
    assert spec.rotary_base == 500000.0 and spec.seq_length == S
    doc = {
        "placement": "colocated",
        "modules": {"vision": {"tp": 2, "frozen": True}, "language": {"tp": 2, "frozen": True}},
        "edges": ["vision -> language"],
    }
    import dataclasses

    from safetensors.torch import load_file

    saved = tmp_path / "stage1"
    per_rank = run_job(doc, 2, dataclasses.replace(job, save=str(saved)))
    loss = [r["loss"] for r in per_rank[0]["records"]]
    assert len(loss) == 2 and all(x == x and x < 10 for x in loss), loss
    # after training: back to Hugging Face; the frozen tower and LM are the converted weights, bit for
    # bit, and the projector trained
    back = tmp_path / "back"
    assert (
        run_ranks(
            1,
            _convert,
            ["convert", "checkpoint-to-hf", str(saved), "--out", str(back)],
            init_distributed=False,
            timeout=300,
        )[0]
        == 0
    )
    for src, dst in (("clip", "vision"), ("llama", "language")):
        a, b = load_file(converted.hf[src] / "model.safetensors"), load_file(back / dst / "model.safetensors")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), src
    start = tmp_path / "start"
    assert (
        run_ranks(
            1, _convert, ["convert", "checkpoint-to-hf", root, "--out", str(start)], init_distributed=False, timeout=300
        )[0]
        == 0
    )
    p0, p1 = load_file(start / "projector" / "model.safetensors"), load_file(back / "projector" / "model.safetensors")
    assert not torch.equal(p0["multi_modal_projector.linear_2.weight"], p1["multi_modal_projector.linear_2.weight"])


def test_megatron_architecture_flags_build_the_same_family():
    """Megatron-LM's flags give the architecture a config.json gives; contradictions and layouts the
    family cannot run are ValueErrors (tied embeddings need the LM on one pipeline stage)."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args
    from megatron_hetero.training.setup import validate_job

    doc = _layout({"dp": 2}, {"pp": 2})
    argv = [
        "train",
        "--hetero-module",
        "vision:dp=2",
        "--hetero-module",
        "language:pp=2",
        "--hetero-edge",
        "vision->language",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        "1e6",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--add-qkv-bias",
        "--disable-bias-linear",
        "--vision-model-type",
        "clip",
        "--patch-dim",
        "4",
        "--encoder-tokens",
        "16",
    ]
    args = build_parser().parse_args(argv)
    layout = layout_from_dict(doc, world_size=2)
    spec = job_from_args(args, layout).config.spec
    assert (
        spec.normalization,
        spec.swiglu,
        spec.position_embedding_type,
        spec.rotary_base,
        spec.num_query_groups,
        spec.add_qkv_bias,
        spec.add_bias_linear,
    ) == ("RMSNorm", True, "rope", 1e6, 2, True, False)
    enc = spec.encoders["vision"]
    assert (enc.kind, enc.patch_size, enc.feature_dim, enc.tokens) == ("clip", 4, 48, 16)
    tied = job_from_args(build_parser().parse_args(argv + ["--share-embeddings-and-output-weights"]), layout)
    with pytest.raises(ValueError, match=r"tied input and output embeddings need the whole language model on one"):
        validate_job(tied)
    with pytest.raises(ValueError, match="needs --patch-dim"):
        job_from_args(build_parser().parse_args(argv[:-4]), layout)


@pytest.mark.timeout(300)
def test_vision_feature_layer_keeps_the_tower_up_to_it(converted, tmp_path):
    """--vision-feature-layer -2 (LLaVA-1.5): the encoder is the first L-1 layers and computes Hugging
    Face's hidden_states[-2]; the later layers are left out (and not written back)."""
    from safetensors.torch import load_file
    from transformers import CLIPVisionModel

    out = tmp_path / "ckpt"
    argv = [
        "convert",
        "hf-to-checkpoint",
        "--vision",
        str(converted.hf["clip"]),
        "--language",
        str(converted.hf["llama"]),
        "--seq-length",
        str(S),
        "--vision-feature-layer",
        "-2",
        "--out",
        str(out),
    ]
    assert run_ranks(1, _convert, argv, init_distributed=False, timeout=300)[0] == 0
    per_rank = run_ranks(
        1, _forward_rank, _layout({}, {}), str(out), _patches(converted.pixels), converted.tokens, timeout=240
    )
    with torch.no_grad():
        ref = (
            CLIPVisionModel.from_pretrained(converted.hf["clip"])
            .eval()(pixel_values=converted.pixels, output_hidden_states=True)
            .hidden_states[-2]
        )
    rel = _rel(per_rank[0]["clip_hidden"], ref)
    assert rel < TOL, rel
    TABLE.append(("CLIP hidden_states[-2]", "vision TP1 (feature layer -2)", rel))
    print(f"\nequivalence CLIP hidden_states[-2] vision TP1: {rel:.2e}")
    back = tmp_path / "back"
    assert (
        run_ranks(
            1,
            _convert,
            ["convert", "checkpoint-to-hf", str(out), "--out", str(back)],
            init_distributed=False,
            timeout=300,
        )[0]
        == 0
    )
    names = load_file(back / "vision" / "model.safetensors")
    assert not any(".layers.1." in k for k in names) and any(".layers.0." in k for k in names)
    assert json.loads((back / "vision" / "config.json").read_text())["num_hidden_layers"] == 1


# the converted CLIP + Llama by Megatron-LM's flags, as a Megatron user passes them beside --load
LLAMA_FLAGS = (
    f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --vocab-size 64 --seq-length {S} "
    "--normalization RMSNorm --swiglu --position-embedding-type rope --rotary-base 500000 "
    "--group-query-attention --num-query-groups 2 --disable-bias-linear --untie-embeddings-and-output-weights"
).split()


def test_load_with_agreeing_model_flags_builds_the_recorded_model(converted):
    """Model flags next to --load of converted weights that agree with the recorded model are taken,
    every field not given is filled from the record (the job's model is the one no flags build); a
    given flag that differs is refused naming its field, its flag and both values."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args
    from megatron_hetero.training.setup import validate_job

    layout = layout_from_dict(_layout({"dp": 2}, {"tp": 2}), world_size=2)
    root = str(converted.ckpts["llama"])

    def job(*flags: str):
        return job_from_args(build_parser().parse_args(["train", "--load", root, *flags]), layout)

    recorded = job().config.spec
    assert recorded.normalization == "RMSNorm" and recorded.swiglu and recorded.num_query_groups == 2
    for flags in (LLAMA_FLAGS, ["--swiglu", "--normalization", "RMSNorm"], ["--hidden-size", "32"]):
        agreed = job(*flags)
        assert agreed.config.spec == recorded, flags
        validate_job(agreed)
    with pytest.raises(
        ValueError, match=r"normalization \(--normalization\): 'RMSNorm' in the checkpoint, 'LayerNorm' given"
    ) as err:
        job(*LLAMA_FLAGS, "--normalization", "LayerNorm")
    assert "swiglu" not in str(err.value) and "hidden_size" not in str(err.value), err.value
    with pytest.raises(ValueError, match=r"hidden_size \(--hidden-size\): 32 in the checkpoint, 48 given"):
        job("--swiglu", "--hidden-size", "48")
    with pytest.raises(ValueError, match=r"encoders.vision.hidden_size \(--encoder-hidden-size\): 32 .*, 16 given"):
        job("--encoder-hidden-size", "16")
    # a rope model has no position table: converted weights train at another --seq-length
    assert job("--seq-length", str(2 * S)).config.spec.seq_length == 2 * S


@pytest.mark.timeout(300)
def test_bf16_run_loads_the_converted_fp32_weights(converted, tmp_path):
    """`train --bf16 --load CONVERTED` (fp32 weights recorded) trains LLaVA stage 1 (vision and language
    frozen, the projector trains) one step on two layouts: the frozen weights are the converted fp32 ones cast
    to bf16, bit for bit, and the first loss is the fp32 run's from the same weights within bf16's
    precision (and the two layouts' within it too)."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args

    from parity import full_params, run_job

    root = str(converted.ckpts["llama"])
    runs = {}
    for name, doc, world, precision in (
        ("fp32 world 1", _layout({"frozen": True}, {"frozen": True}), 1, []),
        ("bf16 world 1", _layout({"frozen": True}, {"frozen": True}), 1, ["--bf16"]),
        ("bf16 vision DP2, language TP2", _layout({"dp": 2, "frozen": True}, {"tp": 2, "frozen": True}), 2, ["--bf16"]),
    ):
        argv = ["train", "--load", root, "--train-iters", "1", "--global-batch-size", "4", "--lr", "1e-3", *precision]
        layout = layout_from_dict(doc, world_size=world)
        job = job_from_args(build_parser().parse_args(argv), layout).config
        assert job.spec.bf16 == bool(precision) and job.spec.normalization == "RMSNorm"
        per_rank = run_job(doc, world, job)
        runs[name] = ([r["loss"] for r in per_rank[0]["records"]], full_params(per_rank))
    ref_loss, ref_params = runs["fp32 world 1"]
    for name in ("bf16 world 1", "bf16 vision DP2, language TP2"):
        loss, params = runs[name]
        rel = abs(loss[0] - ref_loss[0]) / abs(ref_loss[0])
        print(f"{name}: first loss {loss[0]:.6f}, fp32 {ref_loss[0]:.6f}, relative difference {rel:.2e}")
        assert all(x == x for x in loss) and rel <= 2e-2, (name, loss, ref_loss)
        for k, ref in ref_params["language"].items():
            if "linear_fc1" in k and "TP2" in name:
                continue  # swiglu's fc1 shards hold [gate; up] of their own rows: not one cut of the full tensor
            got = params["language"][k]
            assert got.dtype == torch.bfloat16 and torch.equal(got, ref.to(torch.bfloat16)), (name, k)
    a, b = runs["bf16 world 1"][0][0], runs["bf16 vision DP2, language TP2"][0][0]
    assert abs(a - b) <= 1e-2 * abs(a), (a, b)


@pytest.mark.timeout(300)
def test_projector_weights_convert_and_come_back(converted, tmp_path):
    """--projector: LLaVA's multi_modal_projector.linear_1/2 (here saved without the prefix) become the
    encoder module's projector and come back bit-identical under LLaVA's names."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(3)
    proj = {
        "linear_1.weight": torch.randn(32, 32, generator=g),
        "linear_1.bias": torch.randn(32, generator=g),
        "linear_2.weight": torch.randn(32, 32, generator=g),
        "linear_2.bias": torch.randn(32, generator=g),
    }
    save_file(proj, str(tmp_path / "mm_projector.safetensors"))
    out, back = tmp_path / "ckpt", tmp_path / "back"
    argv = [
        "convert",
        "hf-to-checkpoint",
        "--vision",
        str(converted.hf["clip"]),
        "--language",
        str(converted.hf["qwen2"]),
        "--projector",
        str(tmp_path / "mm_projector.safetensors"),
        "--seq-length",
        str(S),
        "--out",
        str(out),
    ]
    assert run_ranks(1, _convert, argv, init_distributed=False, timeout=300)[0] == 0
    assert (
        run_ranks(
            1,
            _convert,
            ["convert", "checkpoint-to-hf", str(out), "--out", str(back)],
            init_distributed=False,
            timeout=300,
        )[0]
        == 0
    )
    got = load_file(back / "projector" / "model.safetensors")
    assert sorted(got) == sorted(f"multi_modal_projector.{k}" for k in proj)
    assert all(torch.equal(got[f"multi_modal_projector.{k}"], v) for k, v in proj.items())
