"""The caption data path that scales (`data/caption_index.py`, `data/caption_reader.py`, `data/caption_batches.py`): random
access through energon's index, each rank decoding only the rows its stages read, the loss-token
count from caption text alone, resume without replay, prefetch workers. Prints the figures quoted in
docs/data.md (rows decoded per rank and data time per step at world 1, 4 and 8; resume time on a
100,000-sample dataset)."""

from __future__ import annotations

import io
import json
import os
import random
import sqlite3
import struct
import tarfile
import time
from pathlib import Path

import pytest
import torch

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.data.caption_index import CaptionIndex, indexable
from megatron_hetero.data.digits import write_digits_dataset
from megatron_hetero.data.caption_batches import CaptionBatches
from megatron_hetero.data.caption_reader import IndexSource
from megatron_hetero.data.energon_data import (
    CaptionDataConfig,
    caption_loss_tokens,
    epoch_seed,
    open_split,
    resolve_config,
    text_sample,
)
from megatron_hetero.data.tokenizer import load_tokenizer
from megatron_hetero.plan.batch import dp_rows
from megatron_hetero.plan.rank_plan import rank_plan

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


def _batches(cfg, tok, workers: int = 0, global_batch: int = G) -> CaptionBatches:
    return CaptionBatches(cfg, tok, encoder="vision", seq_length=S, global_batch=global_batch, num_workers=workers)


def test_index_reads_what_energon_reads(digits):
    """The stored order and the decoded images and captions are energon's own (its val loader)."""
    assert indexable(digits) is None
    for split, count in (("val", 200), ("train", 60)):
        idx = CaptionIndex(digits, split)
        n, it = open_split(str(digits), split)
        assert len(idx) == n
        for p in range(count):
            s = next(it)
            assert idx.key(p) == str(s.__key__)
            assert torch.equal(idx.image(p), s.image)
            assert idx.caption(p) == s.caption
    assert len(CaptionIndex(digits, "train")) == 1597
    with pytest.raises(ValueError, match="no split 'nope'"):
        CaptionIndex(digits, "nope")
    with pytest.raises(ValueError, match=r"not in the split's \[0, 200\)"):
        CaptionIndex(digits, "val").key(200)


def test_index_refuses_stale_or_code_members(digits, tmp_path):
    import shutil

    bad = tmp_path / "stale"
    shutil.copytree(digits, bad)
    tar = bad / "heldout" / "shard-000000.tar"
    data = bytearray(tar.read_bytes())
    data[0:512] = bytes(512)  # the first member's header is gone: the index no longer matches
    tar.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the shard"):
        CaptionIndex(bad, "val").image(0)
    pth = tmp_path / "pth"
    shutil.copytree(digits, pth)
    yaml_path = pth / ".nv-meta" / "dataset.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("image: png", "image: pth"))
    with pytest.raises(ValueError, match="decodes images only from"):
        CaptionIndex(pth, "val")
    loader = tmp_path / "loader"  # a dataset that names code is never read by index
    shutil.copytree(digits, loader)
    y = loader / ".nv-meta" / "dataset.yaml"
    y.write_text(y.read_text() + "sample_loader: loader.py:load\n")
    assert indexable(loader) == "dataset.yaml has sample_loader"


def test_loss_tokens_come_from_the_text_alone(cfg, tok):
    head = 1 + 4
    for caption in ("a handwritten seven", "", "x" * 40, "a handwritten seven " * 10):
        want = int(text_sample(caption, tok, seq_length=S, image_tokens=4)["loss_mask"].sum())
        assert caption_loss_tokens(caption, tok, seq_length=S, head=head) == want
        p = text_sample(caption, tok, seq_length=S, image_tokens=4, prompt="Caption:")
        ph = head + len(tok.encode("Caption:"))
        assert caption_loss_tokens(caption, tok, seq_length=S, head=ph) == int(p["loss_mask"].sum())
    data = _batches(cfg, tok)
    for step in range(3):
        assert data.loss_tokens(step) == 4 * G
    assert data.image_reads == [] and data.text_reads == []  # counted without decoding a sample
    whole = _batches(cfg, tok).step_batch(2)
    assert data.loss_tokens(2) == int(whole["loss_mask"].sum())


# ------------------------------------------------------------------------------------------
# each rank decodes its rows: simulated from the plans of layouts at world 1, 4 and 8
# ------------------------------------------------------------------------------------------
def _doc(vision: dict, language: dict, placement: str = "colocated") -> dict:
    return {
        "placement": placement,
        "modules": {"vision": vision, "language": language},
        "edges": ["vision -> language"],
    }


LAYOUTS = {
    1: _doc({}, {}),
    4: _doc({"dp": 4}, {"tp": 2, "dp": 2}),
    8: _doc({"dp": 8}, {"tp": 2, "dp": 4}),
}


def _rank_rows(doc: dict, world: int, rank: int) -> tuple[list[range], list[range]]:
    """(image rows, text rows) of a step that rank `rank`'s stages read, as micro-batches of 1."""
    layout = layout_from_dict(doc, world_size=world)
    plan = rank_plan(layout, rank, G, 1, False)
    img, txt = [], []
    for name, me in plan.modules.items():
        rows = dp_rows(G, me.dp, me.coord.dp)
        mbs = [range(r, r + 1) for r in rows]
        if name == "vision" and me.first_stage:
            img += mbs
        elif name == "language" and (me.first_stage or me.last_stage):
            txt += mbs
    return img, txt


@pytest.mark.timeout(120)
def test_each_rank_decodes_only_its_rows_and_figures(cfg, tok):
    steps = 3
    ref = _batches(cfg, tok)
    whole = [ref.step_batch(s) for s in range(steps)]
    figures = {}
    for world, doc in LAYOUTS.items():
        per_rank = []
        for rank in range(world):
            img, txt = _rank_rows(doc, world, rank)
            data = _batches(cfg, tok)
            t0 = time.perf_counter()
            for step in range(steps):
                first = step * G
                for r in img:
                    got = data.batch(range(first + r.start, first + r.stop))["features"]["vision"]
                    assert torch.equal(got, whole[step]["features"]["vision"][r.start : r.stop])
                for r in txt:
                    b = data.batch(range(first + r.start, first + r.stop))
                    for k in ("tokens", "labels", "loss_mask"):
                        assert torch.equal(b[k], whole[step][k][r.start : r.stop])
                assert data.loss_tokens(step) == int(whole[step]["loss_mask"].sum())
            ms = (time.perf_counter() - t0) * 1000 / steps
            want_img = sorted(s * G + i for s in range(steps) for r in img for i in r)
            want_txt = sorted(s * G + i for s in range(steps) for r in txt for i in r)
            assert sorted(data.image_reads) == want_img  # decoded exactly its rows, each once
            assert sorted(data.text_reads) == want_txt
            per_rank.append((len(data.image_reads) // steps, len(data.text_reads) // steps, ms))
        figures[world] = per_rank
        imgs = max(p[0] for p in per_rank)
        txts = max(p[1] for p in per_rank)
        ms = sum(p[2] for p in per_rank) / world
        print(
            f"\nworld {world}: per rank per step {imgs} images decoded, {txts} captions tokenised "
            f"(+ {G} caption texts counted), data time {ms:.1f} ms (mean over ranks)"
        )
    # flat or falling with the world size: 8 -> 2 -> 1 images, 8 -> 4 -> 2 texts per rank
    assert [max(p[0] for p in figures[w]) for w in (1, 4, 8)] == [8, 2, 1]
    assert [max(p[1] for p in figures[w]) for w in (1, 4, 8)] == [8, 4, 2]


def test_workers_give_the_batches_of_no_workers(cfg, tok):
    plain, threaded = _batches(cfg, tok, workers=0), _batches(cfg, tok, workers=3)
    try:
        for step in (0, 1, 2, 5, 6, 3):  # forward, a jump ahead and one back
            for lo, hi in ((0, 3), (3, 8)):
                rows = range(step * G + lo, step * G + hi)
                a, b = plain.batch(rows), threaded.batch(rows)
                for k in ("tokens", "labels", "loss_mask"):
                    assert torch.equal(a[k], b[k])
                assert torch.equal(a["features"]["vision"], b["features"]["vision"])
            assert plain.loss_tokens(step) == threaded.loss_tokens(step)
        # the workers decoded ahead: the next step's rows, no sample twice while it is kept (quiesce lets
        # the submitted decodes finish: a worker may not have started the last ones yet)
        threaded.quiesce()
        assert len(threaded.image_reads) > len(plain.image_reads)
        assert set(plain.image_reads) <= set(threaded.image_reads)
        # a fork (the launcher forks ranks) first lets the workers finish and end: the child inherits
        # no thread mid-decode, and its reads are the same
        threaded.batch(range(7 * G, 8 * G))["features"]
        assert threaded._pool is not None
        pid = os.fork()
        if pid == 0:  # the child
            same = torch.equal(
                threaded.batch(range(8 * G, 9 * G))["features"]["vision"], plain.step_batch(8)["features"]["vision"]
            )
            os._exit(0 if same else 1)
        assert threaded._pool is None
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        threaded.close()


def test_resumed_reader_continues_exactly(cfg, tok):
    run = _batches(cfg, tok)
    for step in range(4):
        run.batch(range(step * G, (step + 1) * G))["tokens"]
    state = run.state_dict()
    assert json.loads(json.dumps(state)) == state and state["consumed"] == 4 * G
    nxt = [run.step_batch(s) for s in (4, 5, 199, 200)]  # 199-200 cross the epoch end (1597)
    back = _batches(cfg, tok)
    back.load_state_dict(state)
    assert back.source.replayed == 0
    for s, want in zip((4, 5, 199, 200), nxt):
        got = back.step_batch(s)
        assert got["keys"] == want["keys"]
        assert torch.equal(got["features"]["vision"], want["features"]["vision"])
        assert torch.equal(got["tokens"], want["tokens"])


# ------------------------------------------------------------------------------------------
# 100,000 samples: resume is random access, not replay
# ------------------------------------------------------------------------------------------
def _ustar(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    return info.tobuf(tarfile.USTAR_FORMAT)


def _write_big(out: Path, n: int, shards: int) -> None:
    """n samples `NNNNNN.png` (one 4x4 grey PNG) + `NNNNNN.txt` ("a sample NNNNNN"), with energon's
    index written directly in prepare's format (.info.json, split.yaml, dataset.yaml, index.sqlite,
    .tar.idx): energon prepare itself takes ~25 s for 100,000 samples on this machine. Headers are
    patched from one template per member kind (name and checksum), so writing takes ~2 s."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (4, 4), 9).save(buf, "PNG")
    png = buf.getvalue()
    cap_len = len(b"a sample 000000")
    templates = {ext: bytearray(_ustar(f"000000.{ext}", size)) for ext, size in (("png", len(png)), ("txt", cap_len))}

    def header(key: str, ext: str) -> bytes:
        h = bytearray(templates[ext])
        h[0:6] = key.encode()
        h[148:156] = b"        "
        h[148:156] = b"%06o\0 " % sum(h)
        return bytes(h)

    def pad(b: bytes) -> bytes:
        return b + bytes(-len(b) % 512)

    (out / "s").mkdir(parents=True)
    meta = out / ".nv-meta"
    meta.mkdir()
    db = sqlite3.connect(meta / "index.sqlite")
    db.execute(
        "CREATE TABLE samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE, "
        "sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER)"
    )
    db.execute(
        "CREATE TABLE sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT, "
        "content_byte_offset INTEGER, content_byte_size INTEGER)"
    )
    png_block, counts = pad(png), {}
    for s in range(shards):
        keys = range(s * n // shards, (s + 1) * n // shards)
        chunks, samples, parts, offsets, off = [], [], [], [], 0
        for j, p in enumerate(keys):
            key = f"{p:06d}"
            chunks += [header(key, "png"), png_block, header(key, "txt"), pad(b"a sample " + key.encode())]
            samples.append((s, key, j, off, 2048))
            parts += [(s, j, "png", off + 512, len(png)), (s, j, "txt", off + 1536, cap_len)]
            offsets.append(off)
            off += 2048
        offsets.append(off)
        name = f"s/shard-{s:06d}.tar"
        (out / name).write_bytes(b"".join(chunks) + bytes(1024))
        (out / f"{name}.idx").write_bytes(struct.pack(f"<{len(offsets)}Q", *offsets))
        db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?)", samples)
        db.executemany("INSERT INTO sample_parts VALUES (?, ?, ?, ?, ?)", parts)
        counts[name] = len(keys)
    db.execute("CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)")
    db.execute(
        "CREATE INDEX idx_sample_parts_full ON sample_parts"
        "(tar_file_id, sample_index, part_name, content_byte_offset, content_byte_size)"
    )
    db.commit()
    db.close()
    (meta / ".info.json").write_text(json.dumps({"energon_version": "7.4.1", "shard_counts": counts}))
    (meta / "split.yaml").write_text(
        "split_parts:\n  train:\n  - s/shard-{000000..%06d}.tar\n  val: []\n  test: []\nexclude: []\n" % (shards - 1)
    )
    (meta / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
        "field_map:\n  image: png\n  caption: txt\n"
    )


@pytest.mark.timeout(120)
def test_resume_on_100k_samples_takes_well_under_a_second(tmp_path, tok):
    n, seed = 100_000, 11
    t0 = time.perf_counter()
    _write_big(tmp_path / "big", n, shards=10)
    built = time.perf_counter() - t0
    path = str(tmp_path / "big")
    # energon itself reads the index written here: its stored order, decoding and caption
    _, it = open_split(path, "train")
    for p in range(3):
        s = next(it)
        assert str(s.__key__) == f"{p:06d}" and s.caption == f"a sample {p:06d}"
    cfg = CaptionDataConfig(path, seed=seed, image_size=(4, 4), channels=1)
    consumed = 1_234_560  # epoch 12, sample 34,560 of it
    t0 = time.perf_counter()
    data = CaptionBatches(cfg, tok, encoder="vision", seq_length=S + 8, global_batch=G, num_workers=0)
    data.load_state_dict({**data.state_dict(), "consumed": consumed})
    step = consumed // G
    first = data.step_batch(step)
    resumed = time.perf_counter() - t0
    assert isinstance(data.source, IndexSource) and data.source.replayed == 0
    epoch, j = divmod(consumed, n)
    order = list(range(n))
    random.Random(epoch_seed(seed, epoch)).shuffle(order)  # the documented order, computed here
    assert first["keys"] == [f"{p:06d}" for p in order[j : j + G]]
    assert first["captions"] == [f"a sample {p:06d}" for p in order[j : j + G]]
    assert first["features"]["vision"].shape == (G, 1, 16)
    print(
        f"\n100,000 samples: built in {built:.1f} s; resumed at global sample {consumed:,} (epoch {epoch}) "
        f"and read its first step in {resumed:.2f} s (energon replay: ~{j / 1800:.0f} s at 1,800 samples/s)"
    )
    assert resumed < 5.0, resumed


def test_energon_stream_fallback_reads_a_step_in_any_order_without_replay(cfg, tok, monkeypatch):
    """A dataset the index does not read goes through energon's loader (StreamSource): a step's rows
    asked in any order, and the loss-token count, cost no replay; the rows are the whole step's."""
    from megatron_hetero.data import caption_reader
    from megatron_hetero.data.caption_reader import StreamSource

    monkeypatch.setattr(caption_reader, "indexable", lambda path: "forced for the test")
    ref, data = _batches(cfg, tok), _batches(cfg, tok)
    assert isinstance(data.source, StreamSource) and data.source.order == "energon-shuffle"
    for step in range(3):
        whole = ref.step_batch(step)
        first = step * G
        tail = data.batch(range(first + 4, first + G))["features"]["vision"]
        head = data.batch(range(first, first + 4))["tokens"]
        assert torch.equal(tail, whole["features"]["vision"][4:])
        assert torch.equal(head, whole["tokens"][:4])
        assert data.loss_tokens(step) == int(whole["loss_mask"].sum())
    assert data.source.replayed == 0
    assert data.state_dict()["order"] == "energon-shuffle"
