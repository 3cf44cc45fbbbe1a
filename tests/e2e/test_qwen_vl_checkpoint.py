"""`convert hf-to-checkpoint --model` of a tiny random `Qwen2_5_VLForConditionalGeneration` folder
(`convert.hf_qwen_checkpoint`): a checkpoint of the family's model (the Qwen2.5-VL encoder kind at
--image-size 8x12: 2 x 3 merged tokens; the M-RoPE decoder). Loaded into the training runtime's
modules at world 1, at colocated vision TP2 + language TP2 and with the tower on two pipeline
stages (vision PP2 + language DP2), two samples with the image at text
position 1 give transformers' logits within 1e-4 relative; `checkpoint-to-hf --model` returns every
tensor bit for bit with the config and the processor files; `train --load` trains from it on a
disjoint layout (the loss falls). Bad input (image size, flags) exits 2 with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.cli import main  # noqa: E402
from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

from qwen_vl_case import END, IMAGE, START, reference  # noqa: E402

B, S, ROWS, COLS = 2, 40, 2, 3
TOKENS = ROWS * COLS


def _cli(argv: list[str]) -> int:
    return main(argv)


def _run(argv: list[str]) -> int:
    return run_ranks(1, _cli, argv, init_distributed=False, timeout=300)[0]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S]: vision start, the image's tokens, vision end, text; features [B, 6, 96])."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 100, (B, S), generator=g)
    tokens[:, 0], tokens[:, 1 : 1 + TOKENS], tokens[:, 1 + TOKENS] = START, IMAGE, END
    return tokens, torch.randn(B, TOKENS, 4 * 24, generator=g)


def _forward_rank(doc: dict, root: str) -> dict:
    """Logits [B, S, V] of the checkpoint's modules on this layout (vocabulary gathered over TP)."""
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
        pgs = topo.pg_collection(m.name)
        states[m.name] = SimpleNamespace(
            name=m.name, module=build_module(m.name, layout, spec, pgs).eval(), pgs=pgs, optimizer=None
        )
    load_weights(root, layout, spec, topo, states)
    tokens, features = _batch()
    with torch.no_grad():
        image = _tower_tokens(states["vision"], spec, features)
        lm = states["language"].module
        logits = lm(lm.embed(tokens, {"vision": image}))
        tp = states["language"].pgs.tp
        parts = [torch.empty_like(logits) for _ in range(tp.size())]
        dist.all_gather(parts, logits.contiguous(), group=tp)
    return {"logits": torch.cat(parts, dim=-1), "spec": spec}


def _tower_tokens(state, spec, features: torch.Tensor) -> torch.Tensor:
    """The vision module's merged tokens [B, tokens, H] on every rank of its pipeline: a stage before
    the last sends its [tokens * merge**2, B, h] to the next, and the last broadcasts the tokens."""
    import torch.distributed as dist

    pp = state.pgs.pp
    if pp.size() == 1:
        return state.module(features)
    ranks, r, enc = dist.get_process_group_ranks(pp), pp.rank(), spec.encoders["vision"]
    x = features
    if r > 0:
        x = torch.empty(enc.tokens * enc.merge_size**2, features.shape[0], enc.hidden_size)
        dist.recv(x, src=ranks[r - 1])
    y = state.module(x)
    if r < pp.size() - 1:
        dist.send(y.contiguous(), dst=ranks[r + 1])
        y = torch.empty(features.shape[0], enc.tokens, spec.hidden_size)
    dist.broadcast(y, src=ranks[-1], group=pp)
    return y


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    root = tmp_path_factory.mktemp("qwen")
    cfg, hf, _ = reference()
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg, attn_implementation="eager")).eval()
    model.load_state_dict(hf)
    src = root / "src"
    model.save_pretrained(src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    ckpt = root / "ckpt"
    argv = ["convert", "hf-to-checkpoint", "--model", str(src), "--image-size", "8x12", "--seq-length", str(S)]
    assert _run([*argv, "--out", str(ckpt)]) == 0
    tokens, features = _batch()
    with torch.no_grad():
        want = model(
            input_ids=tokens,
            pixel_values=features.reshape(B * TOKENS * 4, 24),
            image_grid_thw=torch.tensor([[1, 2 * ROWS, 2 * COLS]] * B),
        ).logits
    return SimpleNamespace(root=root, src=src, ckpt=ckpt, want=want)


LAYOUTS = {
    "world 1": (
        1,
        {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]},
    ),
    # the tower's blocks on two pipeline stages: the checkpoint's blocks by global index
    "colocated vision PP2, language DP2": (
        2,
        {
            "placement": "colocated",
            "modules": {"vision": {"pp": 2}, "language": {"dp": 2}},
            "edges": ["vision -> language"],
        },
    ),
    "colocated vision TP2, language TP2": (
        2,
        {
            "placement": "colocated",
            "modules": {"vision": {"tp": 2}, "language": {"tp": 2}},
            "edges": ["vision -> language"],
        },
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_converted_qwen_checkpoint_gives_transformers_logits(converted, name):
    world, doc = LAYOUTS[name]
    got = run_ranks(world, _forward_rank, doc, str(converted.ckpt), timeout=240)
    spec = got[0]["spec"]
    assert spec.position_embedding_type == "mrope" and spec.encoders["vision"].kind == "qwen2.5-vl"
    assert (spec.encoders["vision"].tokens, spec.encoders["vision"].image_rows) == (TOKENS, ROWS)
    for r in got:
        rel = float((r["logits"] - converted.want).abs().max() / converted.want.abs().max())
        print(f"\nQwen2.5-VL checkpoint, {name}, vs transformers: logits {rel:.2e} relative")
        assert rel <= 1e-4, rel


@pytest.mark.timeout(300)
def test_the_checkpoint_on_two_tower_stages_gives_the_one_stage_logits(converted):
    """The tower's blocks load by global index onto each stage: PP2's logits are the world-1 run's."""
    one = run_ranks(1, _forward_rank, LAYOUTS["world 1"][1], str(converted.ckpt), timeout=240)[0]["logits"]
    world, doc = LAYOUTS["colocated vision PP2, language DP2"]
    for r in run_ranks(world, _forward_rank, doc, str(converted.ckpt), timeout=240):
        rel = float((r["logits"] - one).abs().max() / one.abs().max())
        print(f"\nQwen2.5-VL checkpoint, vision PP2 vs world 1: logits {rel:.2e} relative")
        assert rel <= 1e-6, rel


@pytest.mark.timeout(300)
def test_qwen_checkpoint_back_to_a_folder_bit_for_bit(converted):
    from safetensors.torch import load_file

    out = converted.root / "back"
    assert _run(["convert", "checkpoint-to-hf", str(converted.ckpt), "--model", "--out", str(out)]) == 0
    a, b = load_file(str(converted.src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "config.json").read_text() and (out / "chat_template.jinja").is_file()


@pytest.mark.timeout(300)
def test_train_loads_the_qwen_checkpoint_on_a_disjoint_layout(converted, capsys):
    layout = converted.root / "layout.yaml"
    layout.write_text(
        "placement: disjoint\nmodules:\n  vision: {ranks: '0-0'}\n  language: {tp: 2, ranks: '1-2'}\n"
        "edges: ['vision -> language']\n"
    )
    argv = ["train", "--hetero-layout", str(layout), "--nproc-per-node", "3", "--load", str(converted.ckpt)]
    argv += ["--train-iters", "8", "--lr", "0.01", "--global-batch-size", "4", "--micro-batch-size", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    loss = [float(x.split("lm loss ")[1].split()[0]) for x in out.splitlines() if "lm loss" in x]
    assert len(loss) == 8 and loss[-1] < loss[0], loss


@pytest.mark.parametrize(
    "extra, words",
    [(["--image-size", "8x10"], "multiples of"), (["--image-size", "big"], "HEIGHTxWIDTH")],
)
def test_bad_qwen_convert_input_is_refused(converted, tmp_path, capsys, extra, words):
    argv = ["convert", "hf-to-checkpoint", "--model", str(converted.src), *extra, "--out", str(tmp_path / "c")]
    assert main(argv) == 2  # refused before any process group or weight
    assert words in capsys.readouterr().err
