"""Whole `LlavaForConditionalGeneration` folders in and out (`convert hf-to-checkpoint --model`,
`checkpoint-to-hf --model`), and our LLaVA against transformers' LLaVA: the reference no one here wrote.

Two tiny random LLaVA models are built offline and saved with `save_pretrained`:
* CLIP (quick_gelu, 2 layers) + Llama (GQA, untied), vision_feature_layer -2 (LLaVA-1.5's),
  strategy "default" (the class token dropped);
* SigLIP (gelu tanh, pooling head) + Qwen2 (QKV bias, untied: the disjoint layout cuts the LM
  into two pipeline stages, which tied embeddings do not allow here), vision_feature_layer -1
  (transformers 4.57 gives last_hidden_state, after the post LayerNorm, as hidden_states[-1]),
  strategy "full".
Image token id 0 (`data.samples.PLACEHOLDER_ID`), so the synthetic data's own samples are LLaVA inputs:
the image's 16 placeholders at positions 1..16, the text after them.

After `convert hf-to-checkpoint --model`, on the first global batch of the job's data:
* the loss of the training runtime (`train_rank`, one step, the loss recorded before the update)
  equals transformers' `LlavaForConditionalGeneration(..., labels=...).loss` (labels -100 at the
  image tokens; transformers shifts them, our data's labels are already shifted: its input ids are
  the sample's S tokens plus the last label) within 1e-5 relative;
* our per-position logits (the modules loaded under the layout, vision -> projector -> image tokens
  at their placeholders -> language model, pipeline stages by point-to-point, TP pieces gathered)
  equal transformers' within 1e-4 (max |ours - hf| / max |hf|);
under world 1, a colocated layout (vision DP2, language TP2) and a disjoint one (vision on rank 0,
language PP2 on ranks 1-2). `checkpoint-to-hf --model` writes a folder transformers loads, with
bit-identical tensors and the image token id and processor files carried over, also after `train`.
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

LOSS_TOL, LOGITS_TOL = 1e-5, 1e-4
B, S, IMG, PATCH, V = 2, 32, 16, 4, 64
TABLE: list[tuple[str, str, float, float]] = []  # (family, layout, loss rel. diff, logits rel. diff)

LAYOUTS = {  # name -> (layout doc, world)
    "world 1": (
        {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]},
        1,
    ),
    "colocated: vision DP2, language TP2": (
        {
            "placement": "colocated",
            "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
            "edges": ["vision -> language"],
        },
        2,
    ),
    "disjoint: vision 1 rank, language PP2": (
        {
            "placement": "disjoint",
            "modules": {"vision": {}, "language": {"pp": 2}},
            "edges": ["vision -> language"],
        },
        3,
    ),
}


def _tiny_llava(root: Path, family: str) -> Path:
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        Qwen2Config,
        SiglipVisionConfig,
    )

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
    )
    torch.manual_seed(0 if family == "clip-llama" else 1)
    if family == "clip-llama":
        cfg = LlavaConfig(
            vision_config=CLIPVisionConfig(**vision, image_size=IMG, patch_size=PATCH, hidden_act="quick_gelu"),
            text_config=LlamaConfig(**text, rope_theta=500000.0),
            image_token_index=0,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            image_seq_length=(IMG // PATCH) ** 2,
        )
    else:
        cfg = LlavaConfig(
            vision_config=SiglipVisionConfig(**vision, image_size=IMG, patch_size=PATCH),
            text_config=Qwen2Config(**text, tie_word_embeddings=False),
            image_token_index=0,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
            image_seq_length=(IMG // PATCH) ** 2,
        )
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # std 0.2 (HF initialises with 0.02): attention and positions matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    out = root / family
    model.save_pretrained(out)
    (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return out


def _convert(argv: list[str]) -> int:
    return main(argv)


def _cli(argv: list[str]) -> None:
    assert run_ranks(1, _convert, argv, init_distributed=False, timeout=300)[0] == 0, argv


def _hf_reference(folder: Path, batch: dict) -> tuple[float, torch.Tensor]:
    """transformers' loss and logits [B, S, V] on our batch (module docstring)."""
    from transformers import LlavaForConditionalGeneration

    from megatron_hetero.models.clip_encoder import patches_to_image

    model = LlavaForConditionalGeneration.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1)  # [B, S + 1]
    labels = ids.clone()
    labels[ids == model.config.image_token_index] = -100
    pixels = patches_to_image(batch["features"]["vision"], IMG // PATCH, PATCH)
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels, labels=labels)
    return float(out.loss), out.logits[:, :S]


def _batch(root: Path) -> dict:
    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.data import samples as data
    from megatron_hetero.models.llava import LlavaSpec, data_config

    spec = LlavaSpec.from_record(read_train_state(root)[1]["model"])
    return data.batch(data_config(spec), 0, B)


@pytest.fixture(scope="module", params=["clip-llama", "siglip-qwen2"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = _tiny_llava(root, request.param)
    ckpt = root / "ckpt"
    _cli(["convert", "hf-to-checkpoint", "--model", str(hf), "--seq-length", str(S), "--out", str(ckpt)])
    batch = _batch(ckpt)
    loss, logits = _hf_reference(hf, batch)
    return SimpleNamespace(name=request.param, hf=hf, ckpt=ckpt, batch=batch, loss=loss, logits=logits, root=root)


def _forward_rank(doc: dict, root: str, batch: dict) -> dict:
    """One rank: the layout's modules loaded from the checkpoint; vision -> projector on the vision
    ranks (broadcast from rank 0, a vision rank in both placements), the language model's stages by
    point-to-point; the last stage's logits [B, S, V] (TP pieces gathered)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.checkpoint.files import read_train_state
    from megatron_hetero.checkpoint.save_load import load_weights
    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.layout import layout_from_dict
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
        if topo.serves(m.name):
            pgs = topo.pg_collection(m.name)
            states[m.name] = SimpleNamespace(
                name=m.name, module=build_module(m.name, layout, spec, pgs).eval(), pgs=pgs, optimizer=None
            )
    load_weights(root, layout, spec, topo, states)
    out: dict = {}
    enc = spec.encoders["vision"]
    with torch.no_grad():
        image = torch.empty(B, enc.tokens, spec.hidden_size)
        if "vision" in states:
            image = states["vision"].module(batch["features"]["vision"]).contiguous()
        dist.broadcast(image, src=0)
        if "language" in states:
            st = states["language"]
            mod, pgs = st.module, st.pgs
            pp_rank, pp = pgs.pp.rank(), pgs.pp.size()
            if pp_rank == 0:
                hidden = mod.embed(batch["tokens"], {"vision": image})
            else:
                hidden = torch.empty(S, B, spec.hidden_size)
                dist.recv(hidden, src=dist.get_global_rank(pgs.pp, pp_rank - 1))
                mod.set_input_tensor(hidden)
                hidden = None
            res = mod(hidden)
            if pp_rank < pp - 1:
                dist.send(res.contiguous(), dst=dist.get_global_rank(pgs.pp, pp_rank + 1))
            else:
                logits = res
                if pgs.tp.size() > 1:
                    parts = [torch.empty_like(logits) for _ in range(pgs.tp.size())]
                    dist.all_gather(parts, logits.contiguous(), group=pgs.tp)
                    logits = torch.cat(parts, dim=-1)
                out["logits"] = logits
    topo.destroy()
    return out


def _train_loss(doc: dict, world: int, root: Path) -> float:
    """The training runtime's loss of step 1 (recorded before the update) from the checkpoint."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args

    from parity import run_job

    argv = ["train", "--load", str(root), "--train-iters", "1", "--global-batch-size", str(B), "--lr", "1e-3"]
    layout = layout_from_dict(doc, world_size=world)
    job = job_from_args(build_parser().parse_args(argv), layout).config
    return run_job(doc, world, job, timeout=240)[0]["records"][0]["loss"]


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_logits_equal_transformers(family, layout):
    doc, world = LAYOUTS[layout]
    loss = _train_loss(doc, world, family.ckpt)
    per_rank = run_ranks(world, _forward_rank, doc, str(family.ckpt), family.batch, timeout=240)
    logits = [r["logits"] for r in per_rank if "logits" in r]
    assert logits, "no rank produced the logits"
    loss_rel = abs(loss - family.loss) / abs(family.loss)
    logits_rel = max(_rel(x, family.logits) for x in logits)
    TABLE.append((family.name, layout, loss_rel, logits_rel))
    print(
        f"\nvs transformers {family.name} {layout}: loss {loss:.7f} (hf {family.loss:.7f}, rel {loss_rel:.2e}), "
        f"logits max rel {logits_rel:.2e}"
    )
    assert loss_rel < LOSS_TOL, (loss, family.loss)
    assert logits_rel < LOGITS_TOL, logits_rel


@pytest.mark.timeout(600)
def test_round_trip_to_one_llava_folder(family, tmp_path):
    """checkpoint-to-hf --model: one folder, bit-identical tensors under the original names, the
    original config (image token id, feature layer -1 for the cut tower) and the chat template; it
    loads with transformers and computes the original logits."""
    from safetensors.torch import load_file

    back = tmp_path / "back"
    _cli(["convert", "checkpoint-to-hf", str(family.ckpt), "--model", "--out", str(back)])
    a, b = load_file(family.hf / "model.safetensors"), load_file(back / "model.safetensors")
    cut = family.name == "clip-llama"  # feature layer -2 of 2: the tower's second layer is not converted
    dropped = {k for k in a if cut and "encoder.layers.1." in k}
    assert sorted(set(a) - dropped) == sorted(b), set(a) ^ set(b)
    assert all(torch.equal(a[k], b[k]) for k in b)
    cfg, orig = json.loads((back / "config.json").read_text()), json.loads((family.hf / "config.json").read_text())
    assert cfg["image_token_index"] == orig["image_token_index"] == 0
    assert cfg["vision_feature_layer"] == -1
    assert cfg["vision_config"]["num_hidden_layers"] == (1 if cut else 2)
    assert cfg["vision_feature_select_strategy"] == orig["vision_feature_select_strategy"]
    assert (back / "chat_template.jinja").read_text() == (family.hf / "chat_template.jinja").read_text()
    loss, logits = _hf_reference(back, family.batch)
    assert abs(loss - family.loss) <= 1e-6 * abs(family.loss) and _rel(logits, family.logits) < 1e-6


@pytest.mark.timeout(600)
def test_convert_train_and_back(family, tmp_path):
    """convert --model -> train (2 steps, colocated TP2) -> checkpoint-to-hf --model --like: transformers
    loads it, its loss on the batch equals our trained model's loss there, the config carries over."""
    from megatron_hetero.cli import build_parser
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.cli.train_door import job_from_args

    from parity import run_job

    doc, world = LAYOUTS["colocated: vision DP2, language TP2"]
    saved, back = tmp_path / "trained", tmp_path / "back"
    argv = ["train", "--load", str(family.ckpt), "--train-iters", "2", "--global-batch-size", str(B), "--lr", "1e-2"]
    argv += ["--save", str(saved)]
    layout = layout_from_dict(doc, world_size=world)
    job = job_from_args(build_parser().parse_args(argv), layout).config
    run_job(doc, world, job, timeout=240)
    _cli(["convert", "checkpoint-to-hf", str(saved), "--model", "--like", str(family.hf), "--out", str(back)])
    assert json.loads((back / "config.json").read_text())["image_token_index"] == 0
    assert (back / "chat_template.jinja").is_file()
    loss, logits = _hf_reference(back, family.batch)
    per_rank = run_ranks(1, _forward_rank, LAYOUTS["world 1"][0], str(saved), family.batch, timeout=240)
    assert abs(loss - family.loss) > 1e-4 * family.loss  # it trained
    assert _rel(per_rank[0]["logits"], logits) < LOGITS_TOL


@pytest.mark.timeout(600)
def test_hybrid_model_language_model_equals_transformers(family, tmp_path):
    """convert --model --hybrid-layer-pattern '*-*-': the language model is Megatron's HybridModel (one
    attention and one MLP layer per Hugging Face layer); loss and logits equal transformers' under
    world 1 and the disjoint PP2 layout, and checkpoint-to-hf --model gives the tensors back bit-identical."""
    from safetensors.torch import load_file

    ckpt, back = tmp_path / "hybrid", tmp_path / "back"
    _cli(
        ["convert", "hf-to-checkpoint", "--model", str(family.hf), "--seq-length", str(S)]
        + ["--hybrid-layer-pattern", "*-*-", "--out", str(ckpt)]
    )
    for layout in ("world 1", "disjoint: vision 1 rank, language PP2"):
        doc, world = LAYOUTS[layout]
        loss = _train_loss(doc, world, ckpt)
        per_rank = run_ranks(world, _forward_rank, doc, str(ckpt), family.batch, timeout=240)
        logits_rel = max(_rel(r["logits"], family.logits) for r in per_rank if "logits" in r)
        loss_rel = abs(loss - family.loss) / abs(family.loss)
        TABLE.append((f"{family.name} (HybridModel *-*-)", layout, loss_rel, logits_rel))
        print(f"\nvs transformers {family.name} HybridModel {layout}: loss rel {loss_rel:.2e}, logits {logits_rel:.2e}")
        assert loss_rel < LOSS_TOL and logits_rel < LOGITS_TOL, (layout, loss_rel, logits_rel)
    _cli(["convert", "checkpoint-to-hf", str(ckpt), "--model", "--out", str(back)])
    a, b = load_file(family.hf / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(b) <= set(a) and all(torch.equal(a[k], b[k]) for k in b)


def test_llava_options_the_family_cannot_express_are_refused(tmp_path, capsys):
    """Refused from config.json alone (no weights are read), the option named, exit 2."""
    base = {
        "model_type": "llava",
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "image_size": 16,
            "patch_size": 4,
        },
        "text_config": {
            "model_type": "qwen2",
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "vocab_size": 64,
        },
        "vision_feature_select_strategy": "full",
    }
    cases = [
        ({"vision_feature_select_strategy": "default"}, "drops its first patch"),
        ({"vision_feature_layer": [-2, -1]}, "several feature layers"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'"),
        ({"model_type": "llava_next"}, "not a LlavaForConditionalGeneration folder"),
        ({"text_config": {**base["text_config"], "hidden_act": "gelu"}}, "hidden_act 'gelu'"),
    ]
    for i, (change, message) in enumerate(cases):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **change}))
        (folder / "model.safetensors").write_bytes(b"not read")
        rc = main(["convert", "hf-to-checkpoint", "--model", str(folder), "--out", str(tmp_path / f"o{i}")])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (change, err)
        assert not (tmp_path / f"o{i}").exists()
    rc = main(["convert", "hf-to-checkpoint", "--model", str(folder), "--vision", str(folder), "--out", "x"])
    assert rc == 2 and "--model takes a whole LLaVA folder" in capsys.readouterr().err
    good = tmp_path / "good"
    good.mkdir()
    (good / "config.json").write_text(json.dumps(base))
    (good / "model.safetensors").write_bytes(b"not read")
    for pattern in ("*-*E", "*-*-*-"):  # not one '*-' pair per Hugging Face layer
        rc = main(
            ["convert", "hf-to-checkpoint", "--model", str(good), "--hybrid-layer-pattern", pattern, "--out", "x"]
        )
        err = capsys.readouterr().err
        assert rc == 2 and "a converted model of 2 layers is '*-*-'" in err, err


def test_zz_print_table():
    """The logits/loss table of this run (docs/checkpoints.md quotes it)."""
    for fam, lay, loss, logits in TABLE:
        print(f"| {fam} | {lay} | {loss:.1e} | {logits:.1e} |")
