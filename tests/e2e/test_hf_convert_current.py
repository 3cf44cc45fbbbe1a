"""Weights of current VLMs (`megatron-hetero convert`): SigLIP towers, Llama 3.1+ rope scaling, Qwen2.5.

Tiny randomly initialised Hugging Face models are built here and saved as safetensors:

* a `SiglipVisionModel` (gelu tanh, attention-pooling head; 18 x 18 images in 4 x 4 patches, whose
  convolution never reads the last 2 rows and columns, as so400m-patch14-384's never reads 6) with a Llama 3.1-style LM (GQA, untied,
  rope base 5e5, `rope_scaling` llama3 factor 8, low 1, high 4, original context 8192: with head
  dim 8 two of the four rotary frequencies change; initialised with std 0.2 so that attention,
  and with it the positions, matter: without the mapping the logits would differ by 1.5e-2);
* a full `SiglipModel` (its text tower skipped) cut at LLaVA's feature layer -2, with a Qwen2.5-style
  LM (QKV bias, untied, rope base 1e6, use_sliding_window false, max_window_layers 28).

After `convert hf-to-checkpoint` our modules, loaded under a layout on 2 forked ranks, compute the
Hugging Face forward in fp32 within 1e-5 relative (max |ours - hf| / max |hf|): SigLIP
`last_hidden_state` and `pooler_output` under vision TP2 and TP1 (DP2), `hidden_states[-2]` of the cut
tower, the LM logits under language TP2 and CP2. `checkpoint-to-hf` returns bit-identical tensors
and the original config.json. Megatron-core's llama3 rope frequencies equal transformers' bit for
bit. What the family cannot express is refused before any weight is read, with the option named.
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
B, S, PATCH, V = 2, 32, 4, 64
# SigLIP's image_size need not be a multiple of the patch (so400m-patch14-384: 27 x 27 patches over
# 378 of 384 pixels): the towers here take 18 x 18 images, of which the 4 x 4 patches read 16 x 16
SIGLIP_IMG = 18
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TABLE: list[tuple[str, str, float]] = []  # (model output, layout, max relative difference)


def _vision_kwargs() -> dict:
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=SIGLIP_IMG,
        patch_size=PATCH,
    )


def _tiny_models(root: Path) -> dict[str, Path]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        SiglipConfig,
        SiglipModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    torch.manual_seed(0)
    out = {k: root / k for k in ("siglip", "siglip_full", "llama31", "qwen25")}
    SiglipVisionModel(SiglipVisionConfig(**_vision_kwargs())).save_pretrained(out["siglip"])
    SiglipModel(
        SiglipConfig(
            text_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                vocab_size=V,
                max_position_embeddings=16,
            ),
            vision_config=_vision_kwargs(),
        )
    ).save_pretrained(out["siglip_full"])
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA3),
            tie_word_embeddings=False,
            initializer_range=0.2,  # attention sharp enough for positions to matter (default 0.02: 3e-5)
        )
    ).save_pretrained(out["llama31"])
    Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=131072,
            max_window_layers=28,
        )
    ).save_pretrained(out["qwen25"])
    return out


def _convert(vision: Path, language: Path, out: Path, *extra: str) -> None:
    argv = ["convert", "hf-to-checkpoint", "--vision", str(vision), "--language", str(language)]
    argv += ["--seq-length", str(S), *extra, "--out", str(out)]
    # a world of one in a forked child: the test process keeps no process group
    assert run_ranks(1, main, argv, init_distributed=False, timeout=300)[0] == 0


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    """HF folders, their reference outputs, and two converted checkpoints."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM, SiglipVisionModel

    root = tmp_path_factory.mktemp("hf_current")
    hf = _tiny_models(root)
    ckpts = {"a": root / "ckpt_siglip_llama31", "b": root / "ckpt_siglip_full_qwen25"}
    _convert(hf["siglip"], hf["llama31"], ckpts["a"])
    _convert(hf["siglip_full"], hf["qwen25"], ckpts["b"], "--vision-feature-layer", "-2")
    g = torch.Generator().manual_seed(1)
    pixels = torch.rand(B, 3, SIGLIP_IMG, SIGLIP_IMG, generator=g) * 2 - 1  # SigLIP's normalisation: [-1, 1]
    tokens = torch.randint(0, V, (B, S), generator=g)
    ref = {}
    with torch.no_grad():
        v = SiglipVisionModel.from_pretrained(hf["siglip"]).eval()(pixel_values=pixels)
        ref["siglip_hidden"], ref["siglip_pooled"] = v.last_hidden_state, v.pooler_output
        full = SiglipVisionModel.from_pretrained(hf["siglip_full"]).eval()  # the SiglipModel's vision tower
        ref["siglip_full_hidden"] = full(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        for lm in ("llama31", "qwen25"):
            ref[lm] = AutoModelForCausalLM.from_pretrained(hf[lm], attn_implementation="eager").eval()(tokens).logits
        cfg = json.loads((hf["llama31"] / "config.json").read_text())
        plain = LlamaForCausalLM.from_pretrained(
            hf["llama31"],
            config=transformers.LlamaConfig(**{**cfg, "rope_scaling": None}),
            attn_implementation="eager",
        ).eval()
        ref["llama31_unscaled"] = plain(tokens).logits
    return SimpleNamespace(root=root, hf=hf, ckpts=ckpts, pixels=pixels, tokens=tokens, ref=ref)


def _patches(pixels: torch.Tensor) -> torch.Tensor:
    """[b, 3, H, W] -> the data's encoder features [b, g*g, 3*p*p] of its top-left g*p square, g = H // p
    (data.energon_data.patchify)."""
    b, c, g = pixels.shape[0], pixels.shape[1], pixels.shape[2] // PATCH
    pixels = pixels[:, :, : g * PATCH, : g * PATCH]
    return pixels.reshape(b, c, g, PATCH, g, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * PATCH * PATCH)


def _forward_rank(doc: dict, root: str, features: torch.Tensor, tokens: torch.Tensor) -> dict:
    """One rank: build the layout's modules, load the checkpoint, run the SigLIP tower (features, and
    the pooled output where the tower has its head) and the LM (TP/CP pieces gathered)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.checkpoint.save_load import load_weights
    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.cp_attention import cp_chunk_positions
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.runtime.topology import Topology
    from megatron_hetero.training.setup import build_module

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    spec = LlavaSpec.from_record(read_train_state(root)[1]["model"])
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    states = {}
    for m in layout.modules:
        pgs = topo.pg_collection(m.name)
        states[m.name] = SimpleNamespace(
            name=m.name, module=build_module(m.name, layout, spec, pgs).eval(), pgs=pgs, optimizer=None
        )
    load_weights(root, layout, spec, topo, states)
    out: dict = {}
    with torch.no_grad():
        vis = states["vision"].module
        out["hidden"] = vis.features(features)
        if hasattr(vis, "head"):
            out["pooled"] = vis.pooled(features)
        mod, pgs = states["language"].module, states["language"].pgs
        pos = torch.arange(S).unsqueeze(0).expand(B, -1)
        hidden = mod.gpt.embedding(input_ids=tokens, position_ids=pos).index_select(0, mod.cp_positions())
        logits = mod(hidden)  # [b, s_local, v_local]
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


CASES = [  # (checkpoint, vision layout, language layout, vision reference, language reference)
    ("a", {"tp": 2}, {"tp": 2}, "siglip_hidden", "llama31"),
    ("a", {"dp": 2}, {"cp": 2}, "siglip_hidden", "llama31"),
    ("b", {"dp": 2}, {"tp": 2}, "siglip_full_hidden", "qwen25"),
]


def _name(layout: dict) -> str:
    return " ".join(f"{k.upper()}{v}" for k, v in layout.items()).replace("DP2", "TP1 (DP2)")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ckpt,vision,language,vref,lref", CASES, ids=["a-tp2", "a-tp1-cp2", "b-tp1-tp2"])
def test_converted_modules_compute_the_hf_forward(current, ckpt, vision, language, vref, lref):
    per_rank = run_ranks(
        2, _forward_rank, _layout(vision, language), str(current.ckpts[ckpt]), _patches(current.pixels), current.tokens
    )
    for r in per_rank:
        assert _rel(r["hidden"], current.ref[vref]) < TOL, (vref, _rel(r["hidden"], current.ref[vref]))
        assert _rel(r["logits"], current.ref[lref]) < TOL, (lref, _rel(r["logits"], current.ref[lref]))
        if vref == "siglip_hidden":
            assert _rel(r["pooled"], current.ref["siglip_pooled"]) < TOL
        else:
            assert "pooled" in r  # the full SiglipModel's tower keeps its head too
    r = per_rank[0]
    rows = [(vref, f"vision {_name(vision)}", _rel(r["hidden"], current.ref[vref]))]
    if vref == "siglip_hidden":
        rows.append(("siglip_pooled", f"vision {_name(vision)}", _rel(r["pooled"], current.ref["siglip_pooled"])))
    rows.append((f"{lref} logits", f"language {_name(language)}", _rel(r["logits"], current.ref[lref])))
    TABLE.extend(rows)
    print("\nequivalence: " + "; ".join(f"{m} {lay} {d:.2e}" for m, lay, d in rows))


def test_rope_scaling_changes_the_logits_at_this_length(current):
    """The llama3 scaling matters here: without it Hugging Face's logits differ far beyond TOL."""
    rel = _rel(current.ref["llama31_unscaled"], current.ref["llama31"])
    print(f"\nllama31 logits with vs without rope scaling: {rel:.2e}")
    assert rel > 100 * TOL, rel


@pytest.mark.parametrize("factor,head_dim,theta", [(8.0, 8, 5e5), (8.0, 128, 5e5), (32.0, 64, 5e5)])
def test_megatron_llama3_frequencies_equal_transformers(factor, head_dim, theta):
    """Megatron-core's RotaryEmbedding(rope_scaling=True) inverse frequencies are transformers'
    llama3 ones, bit for bit (Llama 3.1 8B: head 128, factor 8; Llama 3.2 1B: head 64, factor 32)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        rope_theta=theta,
        rope_scaling={**LLAMA3, "factor": factor},
        max_position_embeddings=131072,
    )
    hf, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = RotaryEmbedding(
        kv_channels=head_dim,
        rotary_percent=1.0,
        rotary_base=theta,
        rope_scaling=True,
        rope_scaling_factor=factor,
        use_cpu_initialization=True,
    ).inv_freq
    assert attention_factor == 1.0 and ours.dtype == hf.dtype and torch.equal(ours, hf)
    plain = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_base=theta, use_cpu_initialization=True)
    assert not torch.equal(plain.inv_freq, hf)  # the scaling changes some frequencies


@pytest.mark.timeout(300)
def test_round_trip_is_bit_identical(current, tmp_path):
    from safetensors.torch import load_file

    for ckpt, pairs in (("a", (("siglip", "vision"), ("llama31", "language"))), ("b", (("qwen25", "language"),))):
        out = tmp_path / ckpt
        argv = ["convert", "checkpoint-to-hf", str(current.ckpts[ckpt]), "--out", str(out)]
        assert run_ranks(1, main, argv, init_distributed=False, timeout=300)[0] == 0
        for src, dst in pairs:
            a, b = load_file(current.hf[src] / "model.safetensors"), load_file(out / dst / "model.safetensors")
            assert sorted(a) == sorted(b), (src, set(a) ^ set(b))
            for k in a:
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (src, k)
            assert json.loads((out / dst / "config.json").read_text()) == json.loads(
                (current.hf[src] / "config.json").read_text()
            )
    # the cut SiglipModel tower comes back as the shorter tower it is: layer 0, the embeddings, the
    # post LayerNorm and the head, bit-identical; its config says 1 layer
    a, b = load_file(current.hf["siglip_full"] / "model.safetensors"), load_file(out / "vision" / "model.safetensors")
    kept = sorted(k for k in a if k.startswith("vision_model.") and ".layers.1." not in k)
    assert sorted(b) == kept and all(torch.equal(a[k], b[k]) for k in kept)
    assert any(k.startswith("vision_model.head.") for k in kept)
    cfg = json.loads((out / "vision" / "config.json").read_text())
    assert cfg["model_type"] == "siglip" and cfg["vision_config"]["num_hidden_layers"] == 1


def test_converted_spec_records_the_architecture(current):
    """The recorded model: SigLIP kind, post norm on the whole tower and off on the cut one, the
    head kept; llama3 rope scaling with its factor; Qwen2.5's rope base, untied embeddings, QKV bias."""
    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.models.llava import LlavaSpec

    a = LlavaSpec.from_record(read_train_state(current.ckpts["a"])[1]["model"])
    b = LlavaSpec.from_record(read_train_state(current.ckpts["b"])[1]["model"])
    ea, eb = a.encoders["vision"], b.encoders["vision"]
    assert (ea.kind, ea.post_norm, ea.pooling_head, ea.num_layers, ea.tokens, ea.activation) == (
        "siglip",
        True,
        True,
        2,
        16,
        "gelu_pytorch_tanh",
    )
    assert (eb.kind, eb.post_norm, eb.pooling_head, eb.num_layers) == ("siglip", False, True, 1)
    assert (a.rope_scaling, a.rope_scaling_factor, a.rotary_base, a.untie_embeddings_and_output_weights) == (
        True,
        8.0,
        5e5,
        True,
    )
    assert (b.rope_scaling, b.rotary_base, b.untie_embeddings_and_output_weights, b.add_qkv_bias) == (
        False,
        1e6,
        True,
        True,
    )


REFUSALS = [  # (side, config change, words the message must hold)
    ("language", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, ["rope_type 'linear' is not supported"]),
    ("language", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["rope_type 'dynamic' is not supported"]),
    (
        "language",
        {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 4096}},
        ["original_max_position_embeddings 4096 is not supported", "only the factor"],
    ),
    ("language", {"rope_scaling": {**LLAMA3, "low_freq_factor": 2.0}}, ["low_freq_factor 2.0 is not supported"]),
    ("qwen", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, ["rope_type 'yarn' is not supported"]),
    ("qwen", {"use_sliding_window": True}, ["use_sliding_window is not supported"]),
    ("qwen", {"layer_types": ["full_attention", "sliding_attention"]}, ["['sliding_attention'] are not supported"]),
    ("vision", {"hidden_act": "quick_gelu"}, ["hidden_act 'quick_gelu' is not supported", "gelu_pytorch_tanh"]),
    ("vision", {"model_type": "siglip2_vision_model"}, ["'siglip2_vision_model' is not a vision tower", "SigLIP 2"]),
    ("vision", {"num_channels": 1}, ["num_channels 1"]),
]


@pytest.mark.parametrize("side,change,words", REFUSALS, ids=[f"{r[0]}-{'-'.join(r[1])}" for r in REFUSALS])
def test_inexpressible_model_is_refused_before_any_weight_is_read(current, tmp_path, capsys, side, change, words):
    src = {"language": "llama31", "qwen": "qwen25", "vision": "siglip"}[side]
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((current.hf[src] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, **change}))
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")  # reading it would fail differently
    vision, language = (bad, current.hf["llama31"]) if side == "vision" else (current.hf["siglip"], bad)
    rc = main(
        [
            "convert",
            "hf-to-checkpoint",
            "--vision",
            str(vision),
            "--language",
            str(language),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and all(w in err for w in words), err
    assert not (tmp_path / "o").exists()


@pytest.mark.timeout(300)
def test_train_load_trains_the_siglip_tower_but_not_its_head(current, tmp_path):
    """`train --load` of the SigLIP + Llama 3.1 checkpoint, without model flags, under vision DP2
    (trunk training: its post LayerNorm is part of the features) + language TP2 (frozen): two steps
    with a finite, falling loss; the pooling head is outside the features and comes out bit-identical."""
    from safetensors.torch import load_file

    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout.args import layout_from_args
    from megatron_hetero.cli.train_door import job_from_args

    from parity import run_job

    layout_file = tmp_path / "layout.yaml"
    layout_file.write_text(
        "placement: colocated\nmodules:\n  vision: {dp: 2}\n  language: {tp: 2, frozen: true}\nedges: [vision -> language]\n"
    )
    argv = ["train", "--hetero-layout", str(layout_file), "--load", str(current.ckpts["a"])]
    args = build_parser().parse_args(argv + ["--train-iters", "2", "--global-batch-size", "4", "--lr", "1e-3"])
    job = job_from_args(args, layout_from_args(args)).config
    assert job.spec.encoders["vision"].kind == "siglip" and job.spec.rope_scaling
    doc = _layout({"dp": 2}, {"tp": 2, "frozen": True})
    per_rank = run_job(doc, 2, job)
    loss = [r["loss"] for r in per_rank[0]["records"]]
    assert len(loss) == 2 and loss[1] < loss[0] < 10, loss
    params = per_rank[0]["params"]["vision"]
    hf = load_file(current.hf["siglip"] / "model.safetensors")
    head = [k for k in params if k.startswith("head.")]
    assert len(head) == 11 and all(torch.equal(params[k], hf[f"vision_model.{k}"]) for k in head)
    assert not torch.equal(params["ln_post.weight"], hf["vision_model.post_layernorm.weight"])
