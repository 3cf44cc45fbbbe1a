"""The digits captioning dataset (`megatron-hetero data digits`) and reading energon caption data by
global sample index (`data/energon_data.py`), plus the held-out accuracy helper."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from megatron_hetero import cli
from megatron_hetero.models.caption_eval import digit_accuracy, greedy_captions, greedy_digit_accuracy
from megatron_hetero.data.samples import PLACEHOLDER_ID
from megatron_hetero.data.digits import (
    DIGIT_WORDS,
    digit_caption,
    digit_of_caption,
    heldout_indices,
    write_digits_dataset,
)
from megatron_hetero.data.caption_batches import CaptionBatches
from megatron_hetero.data.caption_reader import heldout_batch
from megatron_hetero.data.energon_data import (
    CaptionDataConfig,
    caption_spec,
    patchify,
    resolve_config,
    text_sample,
)
from megatron_hetero.models.llava import EncoderSpec, LlavaSpec
from megatron_hetero.data.tokenizer import load_tokenizer

S, G = 16, 8


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    write_digits_dataset(out)
    return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def cfg(digits):
    return resolve_config(CaptionDataConfig(str(digits), seed=3))


def _batches(cfg, tok, **kw) -> CaptionBatches:
    return CaptionBatches(cfg, tok, encoder="vision", seq_length=S, global_batch=kw.pop("global_batch", G))


def _members(tar: Path) -> list[str]:
    with tarfile.open(tar) as tf:
        return tf.getnames()


# ------------------------------------------------------------------------------------------
# building the dataset
# ------------------------------------------------------------------------------------------
def test_captions_name_their_digit():
    assert digit_caption(7) == "a handwritten seven"
    assert [digit_of_caption(digit_caption(d)) for d in range(10)] == list(range(10))
    assert digit_of_caption("A handwritten Seven.") == 7
    assert digit_of_caption("a handwritten") is None and digit_of_caption("seven or one") is None


def test_heldout_split_is_stratified_and_deterministic():
    from sklearn.datasets import load_digits

    target = load_digits().target
    held = heldout_indices(target, 200, seed=0)
    assert len(held) == 200 == len(set(held)) and held == sorted(held)
    assert Counter(int(target[i]) for i in held) == {d: 20 for d in range(10)}
    assert heldout_indices(target, 200, seed=0) == held and heldout_indices(target, 200, seed=1) != held
    with pytest.raises(ValueError, match="multiple of 10"):
        heldout_indices(target, 15, seed=0)


def test_shards_splits_and_energon_metadata(digits):
    train = sorted((digits / "train").glob("*.tar"))
    held = sorted((digits / "heldout").glob("*.tar"))
    assert len(train) == 4 and len(held) == 1
    train_keys = [n for t in train for n in _members(t)]
    held_keys = _members(held[0])
    assert len(train_keys) == 2 * 1597 and len(held_keys) == 2 * 200
    assert {k[:4] for k in train_keys}.isdisjoint({k[:4] for k in held_keys})
    info = json.loads((digits / ".nv-meta" / ".info.json").read_text())
    assert sum(info["shard_counts"].values()) == 1797
    split = (digits / ".nv-meta" / "split.yaml").read_text()
    assert "train:" in split and "val:" in split and "test:" in split
    assert "CaptioningSample" in (digits / ".nv-meta" / "dataset.yaml").read_text()
    with tarfile.open(held[0]) as tf:
        png = tf.extractfile(held_keys[0]).read()
        caption = tf.extractfile(held_keys[1]).read().decode()
    from PIL import Image
    import io

    img = Image.open(io.BytesIO(png))
    assert img.size == (8, 8) and img.mode == "L"
    assert digit_of_caption(caption) is not None


@pytest.mark.timeout(120)
def test_energon_info_and_lint_accept_it(digits):
    energon = [sys.executable, "-c", "import sys; from megatron.energon.cli.main import main; sys.exit(main())"]
    info = subprocess.run(energon + ["info", str(digits)], capture_output=True, text=True, timeout=100)
    assert info.returncode == 0, info.stderr
    assert "1,797 samples" in info.stdout and "1,597 samples" in info.stdout and "200 samples" in info.stdout
    lint = subprocess.run(energon + ["lint", str(digits)], capture_output=True, text=True, timeout=100)
    assert lint.returncode == 0, lint.stderr[-2000:]


def test_cli_data_digits_builds_byte_identical_shards(digits, tmp_path, capsys):
    assert "data" in cli.SUBCOMMANDS
    out = tmp_path / "d"
    assert cli.main(["data", "digits", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["train"] == 1597 and summary["heldout"] == 200 and len(summary["shards"]) == 5
    assert summary["splits"] == {"train": 1597, "val": 200, "test": 200}
    for tar in sorted(digits.glob("*/*.tar")):  # the same seed writes the same bytes
        assert (out / tar.parent.name / tar.name).read_bytes() == tar.read_bytes(), tar
    assert cli.main(["data", "digits", "--out", str(out)]) == 2  # not empty
    assert "--force" in capsys.readouterr().err
    assert cli.main(["data", "digits", "--out", str(tmp_path / "e"), "--held-out", "7"]) == 2
    assert "multiple of 10" in capsys.readouterr().err


def test_cli_data_module_does_not_import_torch():
    code = (
        "import sys, argparse; from megatron_hetero.cli import data; p = argparse.ArgumentParser(); "
        "data.add_parser(p.add_subparsers()); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------
# a sample: image patches, caption tokens, loss mask
# ------------------------------------------------------------------------------------------
def test_format_and_model_sizes_come_from_the_data(cfg, tok):
    assert cfg.image_size == (8, 8) and cfg.channels == 1  # grey PNGs decode to R = G = B
    assert (cfg.image_tokens, cfg.feature_dim) == (4, 16)
    spec = caption_spec(LlavaSpec(seq_length=S), cfg, tok)
    assert spec.encoders["vision"].tokens == 4 and spec.encoders["vision"].feature_dim == 16
    assert spec.vocab_size == 384
    assert caption_spec(LlavaSpec(seq_length=S), cfg, tok, vocab_size=320).vocab_size == 320
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        caption_spec(LlavaSpec(seq_length=S), cfg, tok, vocab_size=128)
    with pytest.raises(ValueError, match="at least"):
        caption_spec(LlavaSpec(seq_length=5), cfg, tok)  # BOS + 4 image + caption token + EOS = 7 > 5 + 1
    with pytest.raises(ValueError, match="offset 1"):
        caption_spec(LlavaSpec(encoders={"vision": EncoderSpec(offset=3)}), cfg, tok)
    with pytest.raises(ValueError, match="one image encoder"):
        caption_spec(LlavaSpec(encoders={"vision": EncoderSpec(), "audio": EncoderSpec(offset=9)}), cfg, tok)
    with pytest.raises(ValueError, match="not divisible by --patch-size 3"):
        resolve_config(CaptionDataConfig(cfg.path, patch_size=3))
    p2 = resolve_config(CaptionDataConfig(cfg.path, patch_size=2))
    assert (p2.image_tokens, p2.feature_dim) == (16, 4)


def _processor_config(path: Path, **cfg) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "preprocessor_config.json").write_text(json.dumps(cfg))
    return str(path)


def test_image_processor_flag_preprocesses_as_the_tower_was_trained(digits, tok, tmp_path):
    """--image-processor: the processor fixes the format (its output size, RGB) and the features are its
    pixels in patches. SigLIP at the digits' own 8x8 (mean = std = 0.5) is exactly the RGB [-1, 1]
    scaling; a CLIP-style 16x16 upscale with CLIP's mean/std matches transformers' own processor."""
    same = _processor_config(
        tmp_path / "siglip8", image_processor_type="SiglipImageProcessor", size={"height": 8, "width": 8}
    )
    cfg = resolve_config(CaptionDataConfig(str(digits), seed=3, image_processor=same))
    assert (cfg.image_size, cfg.channels, cfg.image_tokens, cfg.feature_dim) == ((8, 8), 3, 4, 48)
    rgb = resolve_config(CaptionDataConfig(str(digits), seed=3, channels=3))
    got, want = _batches(cfg, tok).step_batch(0), _batches(rgb, tok).step_batch(0)
    assert got["keys"] == want["keys"] and torch.equal(got["tokens"], want["tokens"])
    diff = float((got["features"]["vision"] - want["features"]["vision"]).abs().max())
    assert diff <= 1e-6, diff

    clip16 = dict(
        image_processor_type="CLIPImageProcessor",
        size={"shortest_edge": 16},
        crop_size={"height": 16, "width": 16},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    up = resolve_config(
        CaptionDataConfig(str(digits), seed=3, image_processor=_processor_config(tmp_path / "c", **clip16))
    )
    assert (up.image_size, up.image_tokens, up.feature_dim) == ((16, 16), 16, 48)
    held = heldout_batch(up, tok, encoder="vision", seq_length=S + 12, limit=3)
    assert held["features"]["vision"].shape == (3, 16, 48)
    transformers = pytest.importorskip("transformers")
    from megatron_hetero.data.energon_data import open_split
    from megatron_hetero.data.image_processor import to_patches

    hf = transformers.CLIPImageProcessor(**{k: v for k, v in clip16.items() if k != "image_processor_type"})
    _, it = open_split(str(digits), "val")
    images = [next(it).image for _ in range(3)]
    ref = torch.stack(
        [
            to_patches(
                hf((im * 255).round().to(torch.uint8).permute(1, 2, 0).numpy(), return_tensors="pt")["pixel_values"][0],
                4,
            )
            for im in images
        ]
    )
    assert float((held["features"]["vision"] - ref).abs().max()) <= 1e-6

    for cfg_kw, match in (
        (
            {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 8}, "do_center_crop": False},
            "depends on the input",
        ),
        ({"image_processor_type": "SiglipImageProcessor", "size": {"height": 10, "width": 10}}, "do not cut into 4x4"),
        ({"image_processor_type": "LlavaNextImageProcessor"}, "not supported"),
    ):
        bad = _processor_config(tmp_path / f"bad{len(match)}", **cfg_kw)
        with pytest.raises(ValueError, match=match):
            resolve_config(CaptionDataConfig(str(digits), image_processor=bad))
    with pytest.raises(ValueError, match="the encoder takes 8x8"):  # a CLIP encoder's image size is fixed
        resolve_config(
            CaptionDataConfig(
                str(digits), image_size=(8, 8), image_processor=_processor_config(tmp_path / "c", **clip16)
            )
        )


def test_patchify_cuts_row_major_patches():
    img = torch.arange(64, dtype=torch.float32).reshape(8, 8) / 63
    rgb = img.expand(3, 8, 8)
    cfg = CaptionDataConfig("x", image_size=(8, 8), channels=1, patch_size=4)
    x = patchify(rgb, cfg)
    assert x.shape == (4, 16)
    quadrants = [img[:4, :4], img[:4, 4:], img[4:, :4], img[4:, 4:]]
    for k, q in enumerate(quadrants):
        torch.testing.assert_close(x[k], (q.reshape(16) - 0.5) / 0.5)
    # RGB kept as 3 channels (channel-major inside a patch), and a resize to the configured size
    colour = torch.rand(3, 16, 12)
    y = patchify(colour, CaptionDataConfig("x", image_size=(8, 8), channels=3, patch_size=4))
    assert y.shape == (4, 48) and y.min() >= -1 and y.max() <= 1


def test_text_sample_masks_caption_tokens_only(tok):
    cap = tok.encode("a handwritten seven")
    t = text_sample("a handwritten seven", tok, seq_length=S, image_tokens=4)
    full = [tok.bos_id] + [PLACEHOLDER_ID] * 4 + cap + [tok.eos_id]
    full += [tok.pad_id] * (S + 1 - len(full))
    assert t["tokens"].tolist() == full[:-1] and t["labels"].tolist() == full[1:]
    assert t["tokens"][1:5].tolist() == [PLACEHOLDER_ID] * 4  # the encoder's span at offset 1
    # the mask is 1 where the label is a caption token or its EOS: positions 4..7 predict tokens 5..8
    assert t["loss_mask"].tolist() == [0.0] * 4 + [1.0] * 4 + [0.0] * (S - 8)
    assert tok.decode(t["labels"][t["loss_mask"].bool()].tolist()) == "a handwritten seven"
    # a prompt is not in the loss
    p = text_sample("a handwritten seven", tok, seq_length=S, image_tokens=4, prompt="Caption:")
    assert (
        p["loss_mask"].sum() == 4
        and tok.decode(p["tokens"][5 : 5 + len(tok.encode("Caption:"))].tolist()) == "Caption:"
    )
    # a caption longer than the sequence is cut (no EOS then)
    long = text_sample("a handwritten seven " * 10, tok, seq_length=S, image_tokens=4)
    assert long["loss_mask"].sum() == S - 4 and tok.eos_id not in long["labels"].tolist()


def _colour_dataset(out: Path) -> Path:
    """Another energon captioning dataset: 24 RGB 12x10 JPEGs of plain colours, one split."""
    import io

    from PIL import Image

    out.mkdir()
    colours = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
    with tarfile.open(out / "shard-000000.tar", "w") as tf:
        for i in range(24):
            name = list(colours)[i % 3]
            buf = io.BytesIO()
            Image.new("RGB", (10, 12), colours[name]).save(buf, "JPEG")
            for ext, data in (("jpg", buf.getvalue()), ("txt", f"a {name} picture".encode())):
                info = tarfile.TarInfo(f"{i:03d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    energon = [sys.executable, "-c", "import sys; from megatron.energon.cli.main import main; sys.exit(main())"]
    subprocess.run(
        energon
        + [
            "prepare",
            str(out),
            "--non-interactive",
            "--split-ratio",
            "1,0,0",
            "--sample-type",
            "CaptioningSample",
            "--field-map",
            '{"image": "jpg", "caption": "txt"}',
            "--num-workers",
            "1",
            "--no-progress",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.mark.timeout(120)
def test_any_captioning_dataset_rgb_and_resized(tmp_path, tok):
    path = str(_colour_dataset(tmp_path / "colours"))
    cfg = resolve_config(CaptionDataConfig(path, patch_size=2))
    assert cfg.image_size == (12, 10) and cfg.channels == 3
    assert (cfg.image_tokens, cfg.feature_dim) == (30, 12)
    with pytest.raises(ValueError, match="12x10 is not divisible by --patch-size 4"):
        resolve_config(CaptionDataConfig(path))
    small = resolve_config(CaptionDataConfig(path, patch_size=4, image_size=(8, 8)))  # resized
    assert (small.image_tokens, small.feature_dim) == (4, 48)
    data = CaptionBatches(small, tok, encoder="vision", seq_length=S, global_batch=4)
    win = data.step_batch(0)
    assert win["features"]["vision"].shape == (4, 4, 48)
    for caption, feats in zip(win["captions"], win["features"]["vision"]):
        rgb = feats.reshape(4, 3, 16).mean(dim=(0, 2))  # per-channel mean in [-1, 1]
        assert int(rgb.argmax()) == ["red", "green", "blue"].index(caption.split()[1])
    # byte-level tokens of these words are long: captions are cut at the sequence end (S + 1 - BOS - 4 image)
    assert data.loss_tokens(0) == sum(min(len(tok.encode(c)) + 1, S - 4) for c in win["captions"])


# ------------------------------------------------------------------------------------------
# the global sample stream
# ------------------------------------------------------------------------------------------
def test_batches_are_addressed_by_global_sample_index(cfg, tok):
    a, b = _batches(cfg, tok), _batches(cfg, tok)
    w0 = a.step_batch(0)
    assert w0["tokens"].shape == (G, S) and w0["features"]["vision"].shape == (G, 4, 16)
    assert len(set(w0["keys"])) == G
    # any rows of a step, in any order of requests, are the same rows of the same step
    part = b.batch(range(G + 2, G + 5))  # step 1 first on this reader
    whole = a.step_batch(1)
    for k in ("tokens", "labels", "loss_mask"):
        assert torch.equal(part[k], whole[k][2:5])
    assert torch.equal(part["features"]["vision"], whole["features"]["vision"][2:5])
    assert torch.equal(b.batch(range(0, G))["tokens"], w0["tokens"])  # going back replays
    assert a.loss_tokens(0) == int(w0["loss_mask"].sum()) == 4 * G  # 3 caption tokens + EOS each
    with pytest.raises(ValueError, match="cross the end of step"):
        a.batch(range(G - 1, G + 1))
    # another seed, another order
    other = _batches(resolve_config(CaptionDataConfig(cfg.path, seed=4)), tok).step_batch(0)
    assert other["keys"] != w0["keys"]


@pytest.mark.timeout(120)
def test_each_epoch_is_a_permutation_and_epochs_differ(cfg, tok):
    n = 1597
    data = _batches(cfg, tok, global_batch=1)
    first = [data.source.key(i) for i in range(n)]
    assert len(set(first)) == n
    nxt = [data.source.key(i) for i in range(n, n + 20)]
    assert nxt != first[:20]
    assert len(set(nxt)) == 20


def test_position_is_plain_data_and_restores_exactly(cfg, tok):
    a = _batches(cfg, tok)
    for step in range(3):
        a.step_batch(step)
    state = a.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain data, no pickle
    assert state == {
        "consumed": 3 * G,
        "epoch": 0,
        "index_in_epoch": 3 * G,
        "samples_per_epoch": 1597,
        "seed": 3,
        "split": "train",
        "shuffle": True,
        "order": "permutation",
    }
    expected = [a.step_batch(s)["keys"] for s in (3, 4)]
    b = _batches(cfg, tok)
    b.load_state_dict(state)
    assert b.source.replayed == 0  # random access: positioned without reading a sample
    assert [b.step_batch(s)["keys"] for s in (3, 4)] == expected
    # across an epoch boundary: position 1600 = epoch 1, sample 3
    c, d = _batches(cfg, tok), _batches(cfg, tok)
    c.load_state_dict({**state, "consumed": 1600})
    assert c.step_batch(200)["keys"] == d.step_batch(200)["keys"]
    with pytest.raises(ValueError, match="order"):
        d.load_state_dict({**state, "order": "energon-shuffle"})
    with pytest.raises(ValueError, match="seed"):
        d.load_state_dict({**state, "seed": 99})
    with pytest.raises(ValueError, match="whole number of global batches"):
        d.load_state_dict({**state, "consumed": 5})


def test_heldout_batch_is_the_stored_order(cfg, tok):
    h = heldout_batch(cfg, tok, encoder="vision", seq_length=S)
    assert h["tokens"].shape == (200, S) and h["features"]["vision"].shape == (200, 4, 16)
    assert Counter(digit_of_caption(c) for c in h["captions"]) == {d: 20 for d in range(10)}
    assert heldout_batch(cfg, tok, encoder="vision", seq_length=S, limit=5)["keys"] == h["keys"][:5]
    assert heldout_batch(cfg, tok, encoder="vision", seq_length=S, split="test")["keys"] == h["keys"]


# ------------------------------------------------------------------------------------------
# greedy caption accuracy
# ------------------------------------------------------------------------------------------
def test_greedy_digit_accuracy_on_synthetic_logits(tok):
    digits = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    texts = [text_sample(digit_caption(d), tok, seq_length=S, image_tokens=4) for d in digits]
    labels = torch.stack([t["labels"] for t in texts])
    mask = torch.stack([t["loss_mask"] for t in texts])
    V = tok.vocab_size
    noise = torch.randn(len(digits), S, V, generator=torch.Generator().manual_seed(0))
    perfect = torch.nn.functional.one_hot(labels, V).float() * 20 + noise
    assert greedy_captions(perfect, mask, tok) == [digit_caption(d) for d in digits]
    assert greedy_digit_accuracy(perfect, mask, tok, digits) == 1.0
    # the digit word is wrong in 3 samples (predict the next digit's word)
    wrong = perfect.clone()
    for i in (0, 4, 9):
        pos = int(mask[i].nonzero()[2])  # the third caption token: the digit word
        wrong[i, pos] = 0
        wrong[i, pos, tok.encode(digit_caption((digits[i] + 1) % 10))[2]] = 30
    assert greedy_digit_accuracy(wrong, mask, tok, digits) == pytest.approx(0.7)
    # predictions after the first EOS do not count; positions outside the mask are ignored
    ids = labels.clone()
    ids[mask == 0] = tok.encode(" seven")[0]
    assert greedy_digit_accuracy(ids, mask, tok, digits) == 1.0
    early_eos = ids.clone()
    early_eos[3, int(mask[3].nonzero()[1])] = tok.eos_id  # "a" then EOS: no digit named
    assert greedy_captions(early_eos, mask, tok)[3] == "a"
    assert greedy_digit_accuracy(early_eos, mask, tok, digits) == pytest.approx(0.9)
    assert digit_accuracy(["a handwritten one or two"], [1]) == 0.0
    with pytest.raises(ValueError):
        digit_accuracy([], [])
    with pytest.raises(ValueError, match="disagree"):
        greedy_captions(perfect[:, :4], mask, tok)
    assert set(DIGIT_WORDS) == {digit_caption(d).split()[-1] for d in range(10)}
