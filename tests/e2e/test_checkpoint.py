"""Checkpoints (`checkpoint/save_load.py`): exact resume under the same layout, resume under other
layouts (colocated <-> disjoint, TP -> DP, PP 1 -> 2, encoder to its own island, one language
module -> pipeline segments) with Adam, SGD's momentum, damaged checkpoints rejected before training, and
`checkpoint inspect`. fp32, tiny model, world <= 3. Killed saves, crafted and flipped files:
test_checkpoint_safety.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity import losses, max_loss_rel_diff, run_job
from megatron_hetero.training.setup import JobConfig

ROOT = Path(__file__).resolve().parents[2]

COLOC_TP2 = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"tp": 2}},
    "edges": ["vision -> language"],
}
COLOC_DP2 = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"dp": 2}},
    "edges": ["vision -> language"],
}
COLOC_PP2 = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"pp": 2}},
    "edges": ["vision -> language"],
}
DISJOINT_1_1 = {"placement": "disjoint", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}
DISJOINT_SEGMENTS = {
    "placement": "disjoint",
    "modules": {"vision": {}, "language_a": {"layers": "0-0"}, "language_b": {"layers": "1-1"}},
    "edges": ["vision -> language_a", "language_a -> language_b"],
}

JOB = JobConfig(train_iters=4)  # Adam, lr 1e-3, global batch 8, micro-batch 1


@pytest.fixture(scope="module")
def saved(tmp_path_factory, megatron_compat):
    """The uninterrupted 4-step run under COLOC_TP2, and a 2-step run of it that saved at iteration 2."""
    root = tmp_path_factory.mktemp("ckpt") / "run"
    full = losses(run_job(COLOC_TP2, 2, JOB))
    first = losses(run_job(COLOC_TP2, 2, dataclasses.replace(JOB, train_iters=2, save=str(root), save_interval=2)))
    assert first == full[:2]
    return root, full


@pytest.mark.timeout(300)
def test_layout_of_checkpoint_and_global_keys(saved):
    root, _ = saved
    from megatron_hetero.checkpoint import save_load as ckpt
    from megatron_hetero.checkpoint.files import STATE_FILE, TRACKER, read_train_state

    marker = (root / TRACKER).read_text().splitlines()
    assert (
        marker[0] == "2"
        and marker[1] == "sha256 " + hashlib.sha256((root / "iter_0000002" / STATE_FILE).read_bytes()).hexdigest()
    )
    d, state = read_train_state(root)
    assert d == root / "iter_0000002"
    assert sorted(p.name for p in d.iterdir()) == ["language", "layout.yaml", "rng", "train_state.json", "vision"]
    assert state["iteration"] == 2 and state["consumed_samples"] == 16
    assert state["data"] == {"kind": "synthetic", "next_sample": 16, "iteration": 2}
    assert state["layout_dict"]["modules"]["language"]["tp"] == 2 and "tp: 2" in state["layout"]
    assert state["modules"]["language"]["optimizer"] == "adam"
    assert state["modules"]["language"]["common_steps"] == {"": 2.0}
    assert state["modules"]["language"]["scheduler"]["num_steps"] == 2
    shapes = ckpt.tensor_shapes(d / "language")
    # full (unsharded) shapes under global names, model and Adam moments alike
    assert shapes["language.gpt.decoder.layers.1.self_attention.linear_qkv.weight"] == ((192, 64), "float32")
    assert shapes["optimizer.state.exp_avg.language.gpt.output_layer.weight"] == ((128, 64), "float32")
    assert not any("_extra_state" in k for k in shapes)


@pytest.mark.timeout(300)
def test_resume_same_layout_is_exact(saved):
    root, full = saved
    resumed = losses(run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(root))))
    assert resumed == full[2:]  # bitwise: model, Adam moments and step, schedule and RNG restored


# (target layout, world): TP2 colocated -> disjoint islands (the encoder on its own rank); LLM TP2 ->
# DP2; LLM PP 1 -> 2; one language module -> two pipeline segments on their own islands; LLM TP2 -> CP2;
# the encoder DP2 -> PP2.
CHANGES = {
    "colocated->disjoint": (DISJOINT_1_1, 2),
    "tp2->dp2": (COLOC_DP2, 2),
    "pp1->pp2": (COLOC_PP2, 2),
    "one module->segments": (DISJOINT_SEGMENTS, 3),
    "tp2->cp2": (
        {
            "placement": "colocated",
            "modules": {"vision": {"dp": 2}, "language": {"cp": 2}},
            "edges": ["vision -> language"],
        },
        2,
    ),
    "encoder dp2->pp2": (
        {
            "placement": "colocated",
            "modules": {"vision": {"pp": 2}, "language": {"tp": 2}},
            "edges": ["vision -> language"],
        },
        2,
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_resume_under_another_layout(saved, change):
    root, full = saved
    doc, world = CHANGES[change]
    resumed = losses(run_job(doc, world, dataclasses.replace(JOB, load=str(root))))
    diff = max_loss_rel_diff(resumed, full[2:])
    print(f"{change}: max relative loss difference {diff:.2e}")
    assert diff <= 1e-5, (change, resumed, full[2:])


@pytest.mark.timeout(300)
def test_sgd_with_momentum_resumes_exactly(tmp_path):
    """--optimizer sgd (Megatron's SGD: momentum 0.9): the checkpoint holds every parameter's momentum
    buffer, and a resume loads it (fix.sgd_load_state: Megatron's SGD has no init_state_fn, so the load
    failed with TypeError) to the uninterrupted run's losses, bitwise. Saved at 2 of 3 iterations, the
    marker rolled back to 2 by hand (the marker decides)."""
    from megatron_hetero.checkpoint import save_load as ckpt
    from megatron_hetero.checkpoint.files import STATE_FILE, iteration_dir, read_train_state, sha256_file, write_marker
    from megatron_hetero.config.optim import OptimConfig

    job = JobConfig(train_iters=3, optim=OptimConfig(optimizer="sgd", lr=0.5))
    root = tmp_path / "run"
    full = losses(run_job(COLOC_TP2, 2, dataclasses.replace(job, save=str(root), save_interval=2)))
    write_marker(root, 2, sha256_file(iteration_dir(root, 2) / STATE_FILE))
    d, state = read_train_state(root)
    assert state["iteration"] == 2 and state["modules"]["language"]["optimizer"] == "sgd"
    shapes = ckpt.tensor_shapes(d / "language")
    params = {k for k in shapes if not k.startswith("optimizer.")}
    momenta = {k[len("optimizer.state.momentum_buffer.") :] for k in shapes if "momentum_buffer" in k}
    assert momenta == params and len(params) > 10, (sorted(momenta ^ params)[:5], len(params))
    resumed = losses(run_job(COLOC_TP2, 2, dataclasses.replace(job, load=str(root))))
    print(f"SGD: resumed {resumed} vs {full[2:]}")
    assert len(full) == 3 and resumed == full[2:]  # bitwise: the momentum buffers are the run's


@pytest.mark.timeout(300)
def test_fp16_sgd_resumes_a_checkpoint_saved_before_any_step_succeeded(tmp_path):
    """--fp16 --optimizer sgd, the steps skipped (--initial-loss-scale 2**32 overflows): SGD has no
    momentum buffer yet, so the checkpoint of iteration 1 holds no optimizer state, and the resume
    starts SGD afresh (the load asked for momentum buffers the checkpoint does not have) with the saved
    loss scale: the uninterrupted run's second iteration."""
    from megatron_hetero.checkpoint.files import STATE_FILE, iteration_dir, sha256_file, write_marker
    from megatron_hetero.config.optim import OptimConfig

    optim = OptimConfig(optimizer="sgd", lr=0.5, fp16=True, initial_loss_scale=2.0**32)
    job = JobConfig(spec=dataclasses.replace(JOB.spec, fp16=True), train_iters=2, optim=optim)
    full = run_job(COLOC_TP2, 2, dataclasses.replace(job, save=str(tmp_path), save_interval=1))
    write_marker(tmp_path, 1, sha256_file(iteration_dir(tmp_path, 1) / STATE_FILE))
    state = json.loads((iteration_dir(tmp_path, 1) / STATE_FILE).read_text())
    assert all(m["optimizer_stateless"] for m in state["modules"].values())
    resumed = run_job(COLOC_TP2, 2, dataclasses.replace(job, load=str(tmp_path)))
    want = [(x["skipped"], x["loss_scale"], x["loss"]) for x in full[0]["records"]]
    assert want[0][0] and [(x["skipped"], x["loss_scale"], x["loss"]) for x in resumed[0]["records"]] == want[1:]


@pytest.mark.timeout(300)
def test_disjoint_segments_checkpoint_resumes_colocated(tmp_path):
    """The other direction: saved by segments on islands (world 3), resumed colocated TP2 (world 2)."""
    root = tmp_path / "seg"
    full = losses(run_job(DISJOINT_SEGMENTS, 3, JOB))
    run_job(DISJOINT_SEGMENTS, 3, dataclasses.replace(JOB, train_iters=2, save=str(root), save_interval=2))
    resumed = losses(run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(root))))
    assert max_loss_rel_diff(resumed, full[2:]) <= 1e-5


def _tree_digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def _train_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_hetero.cli", "train", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "damage",
    [
        "truncated .distcp",
        "truncated .metadata",
        "truncated train_state.json",
        "zeroed bytes in .distcp",
        "no marker",
    ],
)
def test_damaged_checkpoint_exits_2_naming_the_file(saved, tmp_path, damage):
    import shutil

    from megatron_hetero.cli import main

    root = tmp_path / "copy"
    shutil.copytree(saved[0], root)
    d = root / "iter_0000002"
    target = {
        "truncated .distcp": d / "language" / "__0_0.distcp",
        "truncated .metadata": d / "vision" / ".metadata",
        "truncated train_state.json": d / "train_state.json",
        "zeroed bytes in .distcp": d / "language" / "__1_0.distcp",
        "no marker": root / "latest_checkpointed_iteration.txt",
    }[damage]
    if damage == "no marker":
        target.unlink()
    elif damage.startswith("zeroed"):
        data = bytearray(target.read_bytes())
        data[1000 : 1000 + 4096] = bytes(4096)
        target.write_bytes(bytes(data))
    else:
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    before = _tree_digest(root)
    layout = tmp_path / "l.yaml"
    import yaml

    layout.write_text(yaml.safe_dump(COLOC_TP2))
    rc = main(["train", "--hetero-layout", str(layout), "--train-iters", "4", "--load", str(root)])
    assert rc == 2
    assert _tree_digest(root) == before  # nothing was written or removed
    rc_inspect = main(["checkpoint", "inspect", str(root)])
    assert rc_inspect == 2


@pytest.mark.timeout(300)
def test_damage_messages_name_the_file(saved, tmp_path, capsys):
    import shutil

    import yaml

    from megatron_hetero.cli import main

    root = tmp_path / "copy"
    shutil.copytree(saved[0], root)
    bad = root / "iter_0000002" / "language" / "__1_0.distcp"
    bad.write_bytes(bad.read_bytes()[:100])
    layout = tmp_path / "l.yaml"
    layout.write_text(yaml.safe_dump(COLOC_TP2))
    assert main(["train", "--hetero-layout", str(layout), "--train-iters", "4", "--load", str(root)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file {bad} is corrupt" in err and "truncated" in err
    assert main(["train", "--hetero-layout", str(layout), "--train-iters", "4", "--load", str(tmp_path / "none")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_in_rank_load_failure_names_the_directory(saved, tmp_path, monkeypatch):
    """Past the manifest check (a checkpoint altered after the launcher verified it), the ranks'
    dist_checkpointing failure (a BaseException) is re-raised as ValueError naming the directory."""
    import shutil

    from megatron_hetero.runtime.launcher import RankFailure
    from megatron_hetero.checkpoint import files as checkpoint_files

    root = tmp_path / "copy"
    shutil.copytree(saved[0], root)
    bad = root / "iter_0000002" / "language" / "__1_0.distcp"  # rank 1's tensors (rank 0's also hold the common state)
    bad.write_bytes(bad.read_bytes()[:1000])
    monkeypatch.setattr(checkpoint_files, "verify_manifest", lambda d, state: None)
    with pytest.raises(RankFailure) as info:
        run_job(COLOC_TP2, 2, dataclasses.replace(JOB, load=str(root)))
    assert f"ValueError: checkpoint {root / 'iter_0000002' / 'language'} cannot be loaded" in str(info.value)


@pytest.mark.timeout(300)
def test_mismatched_job_is_rejected_before_training(saved):
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.training.setup import JobDraft, validate_job

    root, _ = saved
    layout = layout_from_dict(COLOC_TP2, world_size=2)
    with pytest.raises(ValueError, match="hidden_size: 64 in the checkpoint, 32 now"):
        validate_job(JobDraft(layout, dataclasses.replace(JOB, load=str(root), spec=LlavaSpec(hidden_size=32))))
    with pytest.raises(ValueError, match="nothing to train"):
        validate_job(JobDraft(layout, dataclasses.replace(JOB, load=str(root), train_iters=2)))
    with pytest.raises(ValueError, match="--global-batch-size 16"):
        validate_job(JobDraft(layout, dataclasses.replace(JOB, load=str(root), global_batch_size=16)))


def test_finetune_and_no_load_optim_relax_only_what_they_do_not_load(saved):
    """A resume keeps the precision (its optimizer state is the saved precision's) and the batch (the
    data position is iteration x batch); --no-load-optim lifts the precision's refusal, --finetune
    (weights only, iteration 0) the batch's, the schedule's and --train-iters'; the model's shape
    stays required: the learned position table's --seq-length is named. Checked before any rank."""
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.llava import LlavaSpec
    from megatron_hetero.config.optim import OptimConfig
    from megatron_hetero.training.setup import validate_job
    from megatron_hetero.training.setup import JobDraft

    root, _ = saved
    layout = layout_from_dict(COLOC_TP2, world_size=2)
    bf16 = dataclasses.replace(
        JOB, load=str(root), spec=dataclasses.replace(JOB.spec, bf16=True), optim=OptimConfig(bf16=True)
    )
    with pytest.raises(
        ValueError, match=r"bf16: False in the checkpoint, True now\).*pass --no-load-optim or --finetune"
    ):
        validate_job(JobDraft(layout, bf16))
    validate_job(JobDraft(layout, dataclasses.replace(bf16, no_load_optim=True)))
    with pytest.raises(ValueError, match=r"--global-batch-size 16.*pass --finetune"):
        validate_job(
            JobDraft(layout, dataclasses.replace(JOB, load=str(root), global_batch_size=16, no_load_optim=True))
        )
    validate_job(JobDraft(layout, dataclasses.replace(bf16, finetune=True, global_batch_size=16, train_iters=1)))
    with pytest.raises(ValueError, match=r"--finetune .*seq_length: 32 in the checkpoint, 24 now.*position table"):
        validate_job(
            JobDraft(layout, dataclasses.replace(JOB, load=str(root), finetune=True, spec=LlavaSpec(seq_length=24)))
        )
    with pytest.raises(ValueError, match=r"--no-load-rng applies to --load DIR"):
        validate_job(JobDraft(layout, dataclasses.replace(JOB, no_load_rng=True)))


@pytest.mark.timeout(300)
def test_cli_save_resume_and_inspect(tmp_path, capsys):
    """`train --save` as a user starts it (a subprocess), then the resume and `checkpoint inspect`
    through the same CLI entry in this process (ranks forked from it; no second start-up)."""
    from megatron_hetero.cli import main

    layout = tmp_path / "l.yaml"
    import yaml

    layout.write_text(yaml.safe_dump(COLOC_TP2))
    ck = tmp_path / "ck"
    a = _train_cli(
        "--hetero-layout",
        str(layout),
        "--train-iters",
        "4",
        "--save",
        str(ck),
        "--save-interval",
        "2",
        "--log-jsonl",
        str(tmp_path / "a.jsonl"),
    )
    assert a.returncode == 0, a.stderr[-3000:]
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]
    full = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    (ck / "latest_checkpointed_iteration.txt").write_text("2\n")  # resume from iteration 2
    capsys.readouterr()
    rc = main(
        ["train", "--hetero-layout", str(layout), "--train-iters", "4", "--load", str(ck)]
        + ["--log-jsonl", str(tmp_path / "b.jsonl")]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    resumed = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert "iteration    3/4 | lm loss" in out and "iteration    1/4" not in out
    assert main(["checkpoint", "inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "iteration 2, consumed samples 16" in out
    assert "placement: colocated" in out
    assert re.search(r"\n  language\.gpt\.decoder\.layers\.1\.mlp\.linear_fc1\.weight +256x64  float32\n", out)
    assert main(["checkpoint", "inspect", str(ck / "iter_0000004"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["iteration"] == 4 and doc["modules"]["vision"]["tensors"]["vision.position"]["shape"] == [8, 32]


@pytest.mark.timeout(300)
def test_frozen_modules_resume_and_unfreeze(tmp_path):
    """LLaVA stage 1 (encoder trunk and LLM frozen, projector trains): exact resume; then stage 2
    (LLM unfrozen) starts from the stage-1 weights with a fresh LLM optimizer."""
    stage1 = {
        "placement": "colocated",
        "modules": {"vision": {"dp": 2, "frozen": True}, "language": {"tp": 2, "frozen": True}},
        "edges": ["vision -> language"],
    }
    root = tmp_path / "s1"
    full = losses(run_job(stage1, 2, JOB))
    run_job(stage1, 2, dataclasses.replace(JOB, train_iters=2, save=str(root), save_interval=2))
    from megatron_hetero.checkpoint.files import read_train_state

    _, state = read_train_state(root)
    assert state["modules"]["language"]["optimizer"] is None and state["modules"]["vision"]["optimizer"] == "adam"
    assert losses(run_job(stage1, 2, dataclasses.replace(JOB, load=str(root)))) == full[2:]
    stage2 = {**stage1, "modules": {"vision": {"dp": 2, "frozen": True}, "language": {"tp": 2}}}
    resumed = losses(run_job(stage2, 2, dataclasses.replace(JOB, load=str(root))))
    assert resumed[0] == full[2]  # same weights going in; the LLM trains from here on
