"""Conversation data at native resolution for a Qwen2.5-VL tower (`data.chat_batches` with `native`,
`models.chat_runner.chat_job_data`): each image through the Qwen image processor whole, a tile one
merged token, each row's image grids from the sizes alone; the features equal the processor's own
output on the decoded PNGs (computed here from the shards)."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import replace

import pytest
import torch

from megatron_hetero import cli
from megatron_hetero.cli.train_door import data_request
from megatron_hetero.data.chat_batches import ChatBatches
from megatron_hetero.data.chat_default import default_chat_template
from megatron_hetero.data.qwen_image_processor import QwenImageProcessor
from megatron_hetero.data.tokenizer import load_tokenizer
from megatron_hetero.models.chat_runner import chat_job_data, native_processor

from qwen_chat_case import GRIDS, PROCESSOR, write_case
from qwen_train_case import SPEC

G = 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return write_case(tmp_path_factory.mktemp("qwen-chat"))


def _fitted(data, proc, *more):
    argv = ["train", "--data-path", str(data), "--image-processor", str(proc), *more]
    return chat_job_data(data_request(cli.build_parser().parse_args(argv)), SPEC, G)


def _sizes(data) -> dict[str, list[tuple[int, int]]]:
    """Each training sample's image (H, W), from the PNGs of the shards."""
    from PIL import Image

    out: dict[str, list[tuple[int, int]]] = {}
    for tar in sorted(data.glob("train/shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in sorted(tf.getmembers(), key=lambda m: m.name):
                key, part = m.name.split(".", 1)
                out.setdefault(key, [])
                if part.endswith(".png"):
                    with Image.open(io.BytesIO(tf.extractfile(m).read())) as im:
                        out[key].append((im.height, im.width))
    return out


def test_the_spec_takes_merged_tokens_and_the_processors_features(case):
    data, proc = case
    spec, cfg = _fitted(*case)
    enc = spec.encoders["vision"]
    sizes = _sizes(data)
    assert set(GRIDS) == {s for v in sizes.values() for s in v}  # 8x8, 16x16 and 8x16 images
    most = max(sum(GRIDS[s][0] * GRIDS[s][1] for s in v) for v in sizes.values())
    assert (enc.tokens, enc.image_rows, enc.feature_dim) == (1, 0, 4 * 3 * 2 * 2 * 2)
    assert enc.max_tiles == most
    assert (cfg.kind, cfg.image_tokens, cfg.image_processor) == ("chat", 1, str(proc))
    assert native_processor(cfg, enc) == QwenImageProcessor.from_dict(PROCESSOR)


def test_batches_hold_each_images_merged_tokens_and_grid(case):
    data, _ = case
    spec, cfg = _fitted(*case)
    enc = spec.encoders["vision"]
    native = native_processor(cfg, enc)
    tok = load_tokenizer(cfg.tokenizer_model)
    b = ChatBatches(
        cfg, tok, default_chat_template(), encoder="vision", seq_length=spec.seq_length, global_batch=G,
        num_workers=0, native=native,
    )  # fmt: skip
    rows = range(0, G)
    got = b.batch(rows)
    grids = b.image_grids(rows)["vision"]
    tiles = got["tiles"]["vision"].tolist()
    assert tiles == [sum(h * w for h, w in g) for g in grids]
    assert got["image_mask"]["vision"].sum(1).tolist() == tiles
    assert {g for row in grids for g in row} == set(GRIDS.values())  # both sizes in one batch
    assert any(len(g) == 2 for g in grids) and any(not g for g in grids)  # two images; text only
    # the features: the processor on each decoded image, computed from the shards
    want = []
    for i in rows:
        rec, _, kept = b.conversation(i)
        assert [GRIDS[s] for s in rec.sizes[: len(kept)]] == grids[i]
        for name in rec.images[: len(kept)]:
            with tarfile.open(next(data.glob("train/shard-*.tar"))) as tf:
                png = tf.extractfile(f"{rec.key}.{name}").read()
            from PIL import Image

            want.append(native(Image.open(io.BytesIO(png)).convert("RGB"))[0].reshape(-1, 1, enc.feature_dim))
    feats = got["features"]["vision"]
    assert feats.shape == (sum(tiles), 1, enc.feature_dim)
    assert torch.allclose(feats, torch.cat(want), atol=1e-6)
    b.close()


def test_without_a_processor_config_qwens_bounds_at_the_towers_patch(case):
    spec, cfg = _fitted(*case)
    got = native_processor(replace(cfg, image_processor=None), spec.encoders["vision"])
    assert got == QwenImageProcessor.for_tower(2, 2, 2)
    assert (got.min_pixels, got.max_pixels) == (4 * 16, 1280 * 16)  # 4 and 1280 merged tokens of 4x4 pixels
    assert [got.merged_grid(s) for s in ((8, 8), (16, 16), (8, 16), (2, 2))] == [(2, 2), (4, 4), (2, 4), (2, 2)]


def test_an_image_processor_of_another_patch_is_refused(case, tmp_path):
    data, _ = case
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "patch_size": 14}))
    with pytest.raises(ValueError, match="not the tower's"):
        _fitted(data, tmp_path)
    without = replace(SPEC.encoders["vision"], kind="clip")
    assert native_processor(_fitted(*case)[1], without) is None


QWEN = ["--vision-model-type", "qwen2.5-vl", "--patch-dim", "2", "--position-embedding-type", "mrope"]
QWEN += ["--mrope-section", "2", "3", "3", "--encoder-hidden-size", "32", "--encoder-num-attention-heads", "2"]


@pytest.mark.timeout(300)
def test_train_reads_the_conversations_at_native_resolution(case, tmp_path, capsys):
    data, proc = case
    log = tmp_path / "log.jsonl"
    argv = ["train", "--hetero-placement", "colocated", "--hetero-edge", "vision->language", *QWEN]
    argv += ["--hetero-module", "vision:dp=1", "--hetero-module", "language:tp=1", "--data-path", str(data)]
    argv += ["--image-processor", str(proc), "--global-batch-size", "8", "--micro-batch-size", "4"]
    argv += ["--train-iters", "2", "--eval-interval", "2", "--lr", "1e-3", "--log-jsonl", str(log)]
    assert cli.main(argv) == 0
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    assert sorted({r["iteration"] for r in records if "loss" in r}) == [1, 2]
    assert "held-out answers" in capsys.readouterr().out
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "merge_size": 1}))
    argv[argv.index(str(proc))] = str(tmp_path / "bad")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not the tower's" in err[0], err
