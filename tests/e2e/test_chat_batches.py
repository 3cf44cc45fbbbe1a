"""Conversation training batches with image tiles (`data/chat_batches.py`) on a small digits
conversation dataset (`write_digits_chat_dataset`, energon-prepared once per module).

The expected values are computed here from the shards themselves (tarfile + PIL + json), not through
the reader: tiles from each image's size, features from the decoded PNG, the loss mask from
`tokenize_conversation` of the JSON's conversation.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_hetero.config.data import CaptionDataConfig
from megatron_hetero.data.caption_reader import epoch_order
from megatron_hetero.data.chat_batches import (
    ChatBatches,
    chat_heldout,
    is_chat_dataset,
    resolve_chat_config,
    tile_features,
)
from megatron_hetero.data.chat_default import CHATML_TEMPLATE, chat_template_for, default_chat_template
from megatron_hetero.data.chat_tokens import tokenize_conversation, train_sample
from megatron_hetero.data.digits_chat import write_digits_chat_dataset
from megatron_hetero.data.energon_data import patchify
from megatron_hetero.data.tokenizer import load_tokenizer

G, SEQ, ENC = 8, 384, "vision"


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chat-batches")
    write_digits_chat_dataset(out, samples=40, val_samples=10, train_shards=2)
    return out


@pytest.fixture(scope="module")
def shards(ds) -> dict[str, dict]:
    """key -> {"json": doc, part: bytes} of every sample in the train and val shards."""
    out: dict[str, dict] = {}
    for tar in sorted(ds.glob("*/shard-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, part = m.name.split(".", 1)
                data = tf.extractfile(m).read()
                out.setdefault(key, {})[part] = json.loads(data) if part == "json" else data
    return out


@pytest.fixture(scope="module")
def cfg(ds):
    return resolve_chat_config(CaptionDataConfig(str(ds), seed=5))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _with_markers(tok):
    """The tokenizer the conversations are tokenised with: the image and ChatML markers added."""
    from megatron_hetero.data.chat_tokens import marker_tokenizer

    return marker_tokenizer(tok.tokenizer, extra=default_chat_template().markers)[0]


def _batches(cfg, tok, seq=SEQ, workers=0) -> ChatBatches:
    return ChatBatches(
        cfg, tok, default_chat_template(), encoder=ENC, seq_length=seq, global_batch=G, num_workers=workers
    )


def _png(data: bytes) -> torch.Tensor:
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(rgb.transpose(2, 0, 1).copy())


def _count_decodes(b: ChatBatches) -> list:
    seen: list = []
    real = b.source.index.image

    def counting(pos, name):
        seen.append((pos, name))
        return real(pos, name)

    b.source.index.image = counting
    return seen


def test_format_and_detection(cfg, ds):
    assert cfg.image_size == (8, 8) and cfg.channels == 1  # grey digits, 8x8 tile
    assert (cfg.image_tokens, cfg.feature_dim) == (4, 16)  # T = (8/4)^2, F = 1 * 4^2
    assert is_chat_dataset(ds) and not is_chat_dataset(ds / "train")
    from megatron_hetero.data.chat_batches import ChatIndex

    index = ChatIndex(ds, "train")  # without "sizes" in a JSON, the image headers give them (no decoding)
    with_sizes = [index.record(pos) for pos in range(6)]
    real = index.member

    def without_sizes(pos: int, part: str) -> bytes:
        data = real(pos, part)
        if part != "json":
            return data
        doc = json.loads(data)
        del doc["sizes"]
        return json.dumps(doc).encode()

    index.member = without_sizes
    assert [index.record(pos) for pos in range(6)] == with_sizes
    assert any(r.images for r in with_sizes)
    index.close()


def test_tiles_masks_and_features_match_the_shards(cfg, tok, shards):
    b = _batches(cfg, tok)
    T = cfg.image_tokens
    seen_16 = False
    for step in range(2):
        rows = range(step * G, (step + 1) * G)
        batch = b.batch(rows)
        feats, tiles = batch["features"][ENC], batch["tiles"][ENC]
        assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (G, SEQ)
        assert batch["image_mask"][ENC].dtype == torch.bool and batch["tokens"].dtype == torch.long
        at = 0
        for r, key in enumerate(b.keys(step)):
            doc = shards[key]["json"]
            want = [{8: 1, 16: 4}[s] for s in doc["sizes"]]
            assert int(tiles[r]) == sum(want)  # nothing is cut at this length
            assert int(batch["image_mask"][ENC][r].sum()) == sum(want) * T
            for name, n in zip(doc["images"], want):
                img = _png(shards[key][name])
                got = feats[at : at + n]
                # each tile is the patchified quarter (row-major): tile 0 top-left, tile 1 top-right
                for k in range(n):
                    y, x = divmod(k, img.shape[-1] // 8)
                    quarter = img[:, 8 * y : 8 * y + 8, 8 * x : 8 * x + 8]
                    assert torch.equal(got[k], patchify(quarter, cfg))
                seen_16 |= n == 4
                at += n
        assert at == feats.shape[0] == int(tiles.sum()) and feats.shape[1:] == (T, cfg.feature_dim)
    assert seen_16


def test_loss_mask_is_the_assistant_tokens(cfg, tok, shards):
    b = _batches(cfg, tok)
    batch = b.batch(range(0, G))
    tpl = default_chat_template()
    for r, key in enumerate(b.keys(0)):
        doc = shards[key]["json"]
        ct = tokenize_conversation(doc["conversation"], [s * s // 16 for s in doc["sizes"]], tok, tpl)
        mask = (ct.mask + [0] * (SEQ + 1))[1 : SEQ + 1]
        assert batch["loss_mask"][r].tolist() == mask
        picked = batch["labels"][r][batch["loss_mask"][r].bool()].tolist()
        answers = "".join(m["content"] + "<|im_end|>" for m in doc["conversation"] if m["role"] == "assistant")
        assert _with_markers(tok).decode(picked, skip_special_tokens=False) == answers


def test_image_tiles_and_loss_tokens_decode_no_image(cfg, tok):
    b = _batches(cfg, tok)
    seen = _count_decodes(b)
    rows = range(G, 2 * G)
    tiles = b.image_tiles(rows)
    loss = b.loss_tokens(1)
    assert seen == [] and b.image_reads == []
    batch = b.batch(rows)
    assert loss == int(batch["loss_mask"].sum()) and b.loss_tokens(0) == int(b.batch(range(G))["loss_mask"].sum())
    assert tiles == {ENC: batch["tiles"][ENC].tolist()} and seen == []  # tiles from the text, still no decode
    part = b.batch(range(G + 2, G + 5))
    part["features"]
    assert sorted(b.image_reads) == [G + 2, G + 3, G + 4]  # exactly the rows asked for
    assert len(seen) == sum(len(b.conversation(i)[2]) for i in range(G + 2, G + 5))


def test_order_is_the_caption_permutation_and_rows_split_alike(cfg, tok):
    b = _batches(cfg, tok)
    n = b.source.samples_per_epoch
    assert n == 40
    for step in (0, 5):  # step 5 is in epoch 1
        want = [b.source.index.key(epoch_order(n, 5, i // n, True)[i % n]) for i in range(step * G, (step + 1) * G)]
        assert b.keys(step) == want
    whole = b.batch(range(0, G))
    halves = [_batches(cfg, tok).batch(range(0, 3)), _batches(cfg, tok).batch(range(3, G))]
    for k in ("tokens", "labels", "loss_mask"):
        assert torch.equal(whole[k], torch.cat([h[k] for h in halves]))
    assert torch.equal(whole["features"][ENC], torch.cat([h["features"][ENC] for h in halves]))


def test_cut_images_are_dropped_with_their_tiles(cfg, tok):
    short = 40  # cuts some images (a ChatML turn header is 3 tokens, a system turn about 15)
    b = _batches(cfg, tok, seq=short, workers=1)
    T, cut = cfg.image_tokens, 0
    for step in range(5):
        rows = range(step * G, (step + 1) * G)
        batch = b.batch(rows)
        tiles = batch["tiles"][ENC]
        assert torch.equal(batch["image_mask"][ENC].sum(1), tiles * T)
        assert batch["features"][ENC].shape[0] == int(tiles.sum())
        assert b.image_tiles(rows)[ENC] == tiles.tolist()
        cut += sum(len(b.conversation(i)[0].images) > len(b.conversation(i)[2]) for i in rows)
    assert cut > 0
    with pytest.raises(ValueError, match="too short for any image"):
        _batches(cfg, tok, seq=T)


def test_heldout_is_the_val_split_in_stored_order(cfg, tok, shards):
    h = chat_heldout(cfg, tok, default_chat_template(), encoder=ENC, seq_length=SEQ, global_batch=4)
    keys = [h.keys(s) for s in range(3)]
    flat = [k for ks in keys for k in ks]
    val = sorted(k for k in shards if int(k) >= 40)
    assert flat[:10] == val and flat[10:] == val[:2]  # i mod N


def test_train_sample_keeps_an_image_only_whole_in_tokens(tok):
    tpl = default_chat_template()
    ct = tokenize_conversation(
        [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "one"}], [4], tok, tpl
    )
    start, n = ct.image_spans[0]
    for seq, kept in ((start + n, 4), (start + n - 1, 0)):  # start+n-1: the last placeholder would be a label only
        assert int(train_sample(ct, seq, tok.pad_id)["image_mask"].sum()) == kept


def test_tile_features_of_any_size(cfg):
    img = torch.rand(3, 16, 24)
    f = tile_features(img, cfg)
    assert f.shape == (6, 4, 16)  # 2 x 3 tiles, row-major
    assert torch.equal(f[4], patchify(img[:, 8:16, 8:16], cfg))
    assert tile_features(torch.rand(3, 12, 8), cfg).shape == (2, 4, 16)  # 12 rows: resized to 2 tiles


def test_chat_template_choice(tmp_path, tok):
    assert chat_template_for(None).source == CHATML_TEMPLATE
    text = default_chat_template().render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"}], add_generation_prompt=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\none<|im_end|>\n"
    (tmp_path / "tokenizer.json").write_text("{}")
    assert chat_template_for(str(tmp_path / "tokenizer.json")).source == CHATML_TEMPLATE  # no config: the default
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert chat_template_for(str(tmp_path / "tokenizer.json")).source == "{{ messages[0]['content'] }}"


def test_markers_that_do_not_match_the_images_name_the_sample(cfg, tok):
    from megatron_hetero.data.chat_batches import ChatRecord

    b = _batches(cfg, tok)
    bad = ChatRecord("k1", [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}],
                     ("img0.png",), ((8, 8),))  # fmt: skip
    b.source.index.record = lambda pos: bad
    with pytest.raises(ValueError, match=r"sample k1: .*2 <image> marker\(s\) but 1 image"):
        b.image_tiles(range(0, 1))


def test_chat_runner_switches_to_heldout_and_counts_answers(cfg, tok):
    """One rank, no process group: the runner's data side (batch, loss_tokens, image_tiles, the
    held-out switch) and its answer counting from the loss stage's logits."""
    from types import SimpleNamespace

    from megatron_hetero.layout.yaml_io import layout_from_dict
    from megatron_hetero.models.chat_runner import ChatStageRunner, end_of_turn_ids
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.model import EncoderSpec
    from megatron_hetero.plan.rank_plan import rank_plan

    doc = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
    plan = rank_plan(layout_from_dict(doc, world_size=1), 0, G, 1, False)
    spec = LlavaSpec(seq_length=SEQ, vocab_size=384, encoders={ENC: EncoderSpec(offset=1, tokens=4, feature_dim=16)})
    one_rank = SimpleNamespace(pgs=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))
    runner = ChatStageRunner(spec, plan, {"language": one_rank}, _batches(cfg, tok))
    assert _with_markers(tok).decode(runner.end_ids, skip_special_tokens=False) == "<|im_end|>"
    assert len(runner.end_ids) == 1  # the shipped tokenizer is given the ChatML markers as tokens
    assert runner.end_ids == end_of_turn_ids(tok, default_chat_template())
    rows = range(G, 2 * G)
    assert runner.image_tiles(rows) == runner.data.image_tiles(rows)
    assert runner.loss_tokens(1) == runner.data.loss_tokens(1)
    runner.set_eval(True)
    held = runner.heldout()
    assert runner.heldout_size() == 10
    b = runner.batch(range(0, G))
    assert runner.loss_tokens(0) == int(b["loss_mask"].sum()) == held.loss_tokens(0)
    assert runner.image_tiles(range(0, G)) == held.image_tiles(range(0, G))
    labels, mask = b["labels"], b["loss_mask"]
    logits = torch.nn.functional.one_hot(labels, 384).float()  # a model that is always right
    runner.eval_logits("language", logits, labels, mask)
    hits, answers = runner.take_eval_counts()
    want = sum(
        sum(m["role"] == "assistant" for m in held.conversation(i)[0].messages) for i in range(G)
    )  # nothing is cut at this length
    assert hits == answers == want > 0
    logits[0, :, :] = 0.0  # row 0 now predicts token 0 everywhere: its answers are wrong
    runner.eval_logits("language", logits, labels, mask)
    row0 = sum(m["role"] == "assistant" for m in held.conversation(0)[0].messages)
    assert runner.take_eval_counts() == (want - row0, want) and runner.take_eval_counts() == (0, 0)
    runner.set_eval(False)
    assert runner.batch(range(0, G))["tokens"].equal(runner.data.batch(range(0, G))["tokens"])


def test_spec_is_fitted_to_the_data(cfg, tok, shards):

    from megatron_hetero.models.chat_runner import chat_spec, max_sample_tiles
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.model import EncoderSpec

    want = max(sum({8: 1, 16: 4}[s] for s in shards[k]["json"]["sizes"]) for k in shards if int(k) < 40)
    assert max_sample_tiles(cfg, 8) == want
    spec = chat_spec(LlavaSpec(seq_length=SEQ, encoders={ENC: EncoderSpec(offset=1)}), cfg, tok, max_tiles=want)
    enc = spec.encoders[ENC]
    assert (enc.tokens, enc.feature_dim, enc.max_tiles, spec.vocab_size) == (4, 16, want, 384)
    with pytest.raises(ValueError, match="too short for any image"):
        chat_spec(LlavaSpec(seq_length=4, encoders={ENC: EncoderSpec(offset=1)}), cfg, tok, max_tiles=want)
    with pytest.raises(ValueError, match="through the Qwen image processor"):  # native resolution needs it
        chat_spec(LlavaSpec(seq_length=SEQ, encoders={ENC: EncoderSpec(kind="qwen2.5-vl")}), cfg, tok, max_tiles=want)


def test_train_flags_on_a_conversation_dataset_pick_the_chat_runner(ds):

    from megatron_hetero import cli
    from megatron_hetero.models.job_data import job_data, runner_factory
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.model import EncoderSpec

    spec = LlavaSpec(seq_length=SEQ, encoders={ENC: EncoderSpec(offset=1)})
    from megatron_hetero.cli.train_door import data_request

    def parse(argv):
        return data_request(cli.build_parser().parse_args(argv))

    got, data = job_data(parse(["train", "--data-path", str(ds), "--seq-length", str(SEQ)]), spec)
    assert data.kind == "chat" and data.image_size == (8, 8) and data.channels == 1
    enc = got.encoders[ENC]
    assert (enc.tokens, enc.feature_dim, enc.max_tiles, got.vocab_size) == (4, 16, 8, 384)
    assert runner_factory(data, got, G).__qualname__.startswith("chat_runner_factory")
    assert job_data(parse(["train"]), spec) == (spec, None)  # no --data-path: the synthetic data
    with pytest.raises(ValueError, match="--data-prompt: applies to caption data"):
        job_data(parse(["train", "--data-path", str(ds), "--data-prompt", "x"]), spec)
    with pytest.raises(ValueError, match="--seq-length 7: too short for the images"):
        job_data(parse(["train", "--data-path", str(ds), "--seq-length", "7"]), replace(spec, seq_length=7))
    with pytest.raises(ValueError, match="--encoder-tokens 9: .* gives 4 per image tile"):
        job_data(parse(["train", "--data-path", str(ds), "--encoder-tokens", "9"]), spec)


def test_workers_and_a_restored_position_give_the_same_batches(cfg, tok):
    ref = _batches(cfg, tok)
    ahead = _batches(cfg, tok, workers=2)
    for step in range(3):
        rows = range(step * G, (step + 1) * G)
        assert torch.equal(ahead.batch(rows)["features"][ENC], ref.batch(rows)["features"][ENC])
    ahead.quiesce()  # the submitted decodes finish (a worker may not have started one yet)
    assert set(range(3 * G, 4 * G)) <= set(ahead.image_reads)  # the next step's rows were decoded ahead
    ahead.close()
    state = ref.state_dict()
    assert state["consumed"] == 3 * G and json.loads(json.dumps(state)) == state
    back = _batches(cfg, tok)
    back.load_state_dict(state)
    rows = range(3 * G, 4 * G)
    a, b = back.batch(rows), ref.batch(rows)
    for k in ("tokens", "labels", "loss_mask"):
        assert torch.equal(a[k], b[k])
    assert torch.equal(a["features"][ENC], b["features"][ENC]) and torch.equal(a["tiles"][ENC], b["tiles"][ENC])
    assert back.loss_tokens(3) == ref.loss_tokens(3)


@pytest.mark.timeout(300)
def test_train_cli_on_conversations_is_the_same_in_two_layouts(ds, tmp_path, capsys):
    """`train --data-path` on the conversations (the model side's variable tiles): world 1 and a
    disjoint world 2 give the same losses and held-out answer counts."""
    from megatron_hetero.cli import main

    common = ["train", "--seq-length", "256", "--train-iters", "2", "--data-path", str(ds), "--eval-interval", "2"]
    runs = {}
    for name, placement, vision, language in (
        ("one", "colocated", "vision:dp=1", "language:tp=1"),
        ("disjoint", "disjoint", "vision:dp=1", "language:dp=1"),
    ):
        log = tmp_path / f"{name}.jsonl"
        layout = ["--hetero-placement", placement, "--hetero-module", vision, "--hetero-module", language]
        rc = main([*common, *layout, "--hetero-edge", "vision->language", "--log-jsonl", str(log)])
        assert rc == 0, capsys.readouterr().err[-3000:]
        runs[name] = [json.loads(line) for line in log.read_text().splitlines()]
    one, two = runs["one"], runs["disjoint"]
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two], rel=1e-6)
    assert all(r["grad_norm_per_module"]["vision"] > 0 for r in one)  # the tiles reach the encoder
    assert one[-1]["eval_loss"] == pytest.approx(two[-1]["eval_loss"], rel=1e-6)
    assert one[-1]["eval_accuracy"] == two[-1]["eval_accuracy"]


def test_an_image_processor_preprocesses_each_tile_as_the_tower_was_trained(ds, tmp_path):
    """--image-processor on conversations: the tile side is the processor's output size, and every
    tile of an image gets the processor's whole recipe on its own (RGB, rescale, CLIP's mean/std)."""
    from megatron_hetero.data.chat_batches import tile_features
    from megatron_hetero.data.image_processor import caption_features, load_image_processor

    pre = {
        "image_processor_type": "CLIPImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": 8},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": 8, "width": 8},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    cfg = resolve_chat_config(CaptionDataConfig(str(ds), patch_size=4, image_processor=str(tmp_path)))
    assert (cfg.image_size, cfg.channels, cfg.image_tokens, cfg.feature_dim) == ((8, 8), 3, 4, 48)
    proc = load_image_processor(tmp_path)
    g = torch.Generator().manual_seed(0)
    image = (torch.randint(0, 256, (1, 16, 16), generator=g) / 255.0).float()
    got = tile_features(image, cfg)
    assert got.shape == (4, 4, 48)
    rgb = image.expand(3, -1, -1)
    for k, (i, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        want = caption_features(rgb[:, 8 * i : 8 * i + 8, 8 * j : 8 * j + 8], proc, 4)
        assert torch.allclose(got[k], want, atol=1e-6), k
    assert got.min() < -1.5 and got.max() > 1.5  # CLIP's normalisation, not patchify's [-1, 1]


def test_max_image_tiles_resizes_an_image_to_fit_its_grid(ds):
    from megatron_hetero.data.chat_batches import tile_features, tile_grid

    assert tile_grid((16, 16), 8) == (2, 2) and tile_grid((16, 16), 8, 1) == (1, 1)
    assert tile_grid((24, 40), 8, 6) == (2, 3) and tile_grid((600, 800), 336, 1) == (1, 1)
    cfg = resolve_chat_config(CaptionDataConfig(str(ds), patch_size=4, max_image_tiles=1))
    image = torch.rand(1, 16, 16, generator=torch.Generator().manual_seed(1))
    got = tile_features(image, cfg)
    assert got.shape == (1, 4, 16)
    assert torch.allclose(got[0], patchify(image, cfg))  # the whole image resized to one 8x8 tile
    tok_cfg = CaptionDataConfig(str(ds), patch_size=4, max_image_tiles=1)
    b = ChatBatches(
        resolve_chat_config(tok_cfg),
        load_tokenizer(),
        default_chat_template(),
        encoder=ENC,
        seq_length=SEQ,
        global_batch=G,
    )
    assert max(b.image_tiles(range(G))[ENC]) <= 2  # at most two images of one tile each


WORLD1 = ["--hetero-placement", "colocated", "--hetero-module", "vision:dp=1", "--hetero-module", "language:dp=1"]


def _length(doc: dict, tok) -> int:
    """Tokens of a sample's whole conversation, from its JSON (an 8x8 image 4 placeholders, 16x16 16)."""
    sizes = [s * s // 16 for s in doc["sizes"]]
    return len(tokenize_conversation(doc["conversation"], sizes, tok, default_chat_template()))


def _stored_lengths(cfg, tok, shards) -> list[int]:
    """Tokens of each training conversation in stored order."""
    index = _batches(cfg, tok).source.index
    return [_length(shards[index.key(pos)]["json"], tok) for pos in range(len(index))]


def test_without_seq_length_the_data_gives_it(ds, cfg, tok, shards):
    """No --seq-length: the length that holds the longest conversation whole (its tokens - 1: the last
    one is only a label), a multiple of 8; every answer of the first batch is then whole."""
    from megatron_hetero import cli
    from megatron_hetero.cli.train_door import data_request
    from megatron_hetero.models.job_data import job_data
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.model import EncoderSpec

    longest = max(_stored_lengths(cfg, tok, shards)) - 1  # 40 samples: all within the probe
    spec = LlavaSpec(encoders={ENC: EncoderSpec(offset=1)})  # seq_length: the flag's default, 32
    got, _ = job_data(
        data_request(cli.build_parser().parse_args(["train", "--data-path", str(ds), "--seed", "5"])), spec, G
    )
    assert got.seq_length == -(-longest // 8) * 8 and got.seq_length - 8 < longest <= got.seq_length
    b = _batches(cfg, tok, seq=got.seq_length)
    for i in range(G):
        assert int(b.text(i)["loss_mask"].sum()) == sum(b.conversation(i)[1].mask[1:])  # no answer token cut


@pytest.mark.timeout(300)
def test_train_cli_on_conversations_without_seq_length_trains(ds, cfg, tok, shards, tmp_path, capsys):
    """`data digits --chat` then `train --data-path` with no --seq-length: the run trains at the data's
    sequence length (tokens/s x step time = global batch x that length), every step with loss tokens."""
    from megatron_hetero.cli import main

    log = tmp_path / "chat.jsonl"
    argv = ["train", *WORLD1, "--hetero-edge", "vision->language", "--data-path", str(ds), "--seed", "5"]
    rc = main([*argv, "--global-batch-size", str(G), "--train-iters", "3", "--log-jsonl", str(log)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    seq = -(-(max(_stored_lengths(cfg, tok, shards)) - 1) // 8) * 8
    assert [r["iteration"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert np.isfinite(r["loss"]) and not r.get("no_loss_tokens") and r["grad_norm"] > 0
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(G * seq, rel=1e-9)


def test_a_seq_length_that_cuts_every_answer_of_the_first_batch_exits_2(ds, cfg, tok, shards, capsys):
    """--seq-length 24 keeps the images but cuts every answer of the first global batch: exit 2 before
    any rank starts, naming --seq-length and the lengths the batch needs: the shortest that reaches an
    answer (one less reaches none) and the one that holds every conversation whole."""
    import re

    from megatron_hetero.cli import main

    argv = ["train", *WORLD1, "--hetero-edge", "vision->language", "--data-path", str(ds), "--seed", "5"]
    assert main([*argv, "--global-batch-size", str(G), "--seq-length", "24"]) == 2
    err = capsys.readouterr().err
    m = re.search(
        r"--seq-length 24: cuts every answer of the first global batch \(8 samples of --data-path .*\): its "
        r"samples need --seq-length (\d+) to reach the earliest answer, (\d+) to hold the longest conversation whole",
        err,
    )
    assert m, err
    reach, whole = int(m.group(1)), int(m.group(2))
    # the run's first batch (seed 5: the fixture's order) reaches an answer at `reach`, none at one less
    assert 24 < reach < whole
    assert _batches(cfg, tok, seq=reach).loss_tokens(0) > 0 and _batches(cfg, tok, seq=reach - 1).loss_tokens(0) == 0
    # its longest conversation, tokens and labels together: `whole` + 1 tokens
    assert whole == max(_length(shards[k]["json"], tok) for k in _batches(cfg, tok).keys(0)) - 1
