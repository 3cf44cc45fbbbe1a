"""The `megatron-hetero` command package (cli/): the subcommand registry, the shared model flags,
the hardware presets as package data, and `search` planning the model `train` runs: `search`
without model flags writes a layout that `train` without model flags trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_hetero import cli
from megatron_hetero.cli import search as cli_search
from megatron_hetero.cli.model_flags import MODEL_FLAGS
from megatron_hetero.cli.train_door import model_flags
from megatron_hetero.planner.hardware_presets import DEFAULT_HARDWARE, hardware_names, load_hardware
from megatron_hetero.config.model import EncoderSpec, LlavaSpec, spec_from_flags
from megatron_hetero.planner.model import workload

REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _search_args(*argv: str):
    return cli.build_parser().parse_args(["search", *argv])


# ------------------------------------------------------------------------------------------
# registry
# ------------------------------------------------------------------------------------------
def test_every_registered_subcommand_follows_the_convention() -> None:
    mods = cli.subcommand_modules()
    assert list(mods) == [
        "plan",
        "train",
        "dryrun",
        "schedule",
        "profile",
        "search",
        "bench",
        "slurm",
        "data",
        "checkpoint",
        "convert",
        "timeline",
        "megatron-lm",
    ]
    for name, mod in mods.items():
        assert mod.NAME == name and callable(mod.add_parser) and callable(mod.run), name
    sub = cli.build_parser()._subparsers._group_actions[0]
    assert list(sub.choices) == list(mods)


def test_command_failed_exits_1_without_traceback(capsys, monkeypatch) -> None:
    from megatron_hetero.cli import plan

    def fail(args):
        raise cli.CommandFailed("failed: rank 3 exited with code 9")

    monkeypatch.setattr(plan, "run", fail)
    rc, out, err = _run(capsys, "plan", str(REPO / "examples/layouts/homogeneous.yaml"))
    assert (rc, out, err) == (1, "", "megatron-hetero plan: failed: rank 3 exited with code 9\n")


# ------------------------------------------------------------------------------------------
# one set of model flags
# ------------------------------------------------------------------------------------------
def test_train_and_search_share_the_model_flags() -> None:
    parser = cli.build_parser()
    subs = parser._subparsers._group_actions[0].choices
    for cmd in ("train", "search"):
        dests = {a.dest for a in subs[cmd]._actions}
        assert set(MODEL_FLAGS) <= dests, (cmd, set(MODEL_FLAGS) - dests)
    plan_dests = {a.dest for a in subs["plan"]._actions}
    assert {"global_batch_size", "seq_length", "hidden_size"} <= plan_dests
    argv = [
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "64",
        "--vocab-size",
        "256",
        "--encoder-num-layers",
        "3",
        "--encoder-hidden-size",
        "48",
        "--encoder-num-attention-heads",
        "6",
        "--encoder-tokens",
        "16",
        "--encoder-feature-dim",
        "12",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "2",
    ]
    train, search = parser.parse_args(["train", *argv]), parser.parse_args(["search", *argv])
    want = LlavaSpec(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=8,
        seq_length=64,
        vocab_size=256,
        encoders={
            "vision": EncoderSpec(num_layers=3, hidden_size=48, num_attention_heads=6, tokens=16, feature_dim=12)
        },
    )
    assert spec_from_flags(model_flags(train)) == spec_from_flags(model_flags(search)) == want
    assert (
        (train.global_batch_size, train.micro_batch_size)
        == (search.global_batch_size, search.micro_batch_size)
        == (16, 2)
    )


def test_earlier_search_flag_spellings_still_parse() -> None:
    old = _search_args(
        "--llm-layers",
        "4",
        "--llm-hidden",
        "128",
        "--llm-heads",
        "8",
        "--llm-ffn-hidden",
        "512",
        "--encoder-layers",
        "3",
        "--encoder-hidden",
        "48",
        "--encoder-heads",
        "6",
        "--image-tokens",
        "16",
        "--encoder-ffn-hidden",
        "96",
        "--simulate",
        "h100_80gb",
    )
    new = _search_args(
        "--num-layers",
        "4",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "8",
        "--ffn-hidden-size",
        "512",
        "--encoder-num-layers",
        "3",
        "--encoder-hidden-size",
        "48",
        "--encoder-num-attention-heads",
        "6",
        "--encoder-tokens",
        "16",
        "--encoder-ffn-hidden-size",
        "96",
        "--hardware",
        "h100_80gb",
    )
    assert vars(old) == vars(new)
    assert "--llm-hidden" not in cli.build_parser()._subparsers._group_actions[0].choices["search"].format_help()


def test_model_flags_default_to_the_model_description() -> None:
    """The model flags are generated from the model's description (config.model): with none given,
    train builds LlavaSpec's defaults, and every flag's help names its field's default."""
    from megatron_hetero.layout import load_layout
    from megatron_hetero.layout.flags import dest, value
    from megatron_hetero.config.job import JobConfig
    from megatron_hetero.cli.train_door import batch_from_args

    layout = load_layout(REPO / "examples/layouts/homogeneous.yaml")
    args = cli.build_parser().parse_args(["train"])
    assert spec_from_flags(model_flags(args), layout) == LlavaSpec(encoders={"vision": EncoderSpec()}) == LlavaSpec()
    assert batch_from_args(args, layout) == (JobConfig().global_batch_size, 1) == (8, 1)
    assert all(getattr(args, d) is None for d in MODEL_FLAGS)  # None: not given
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for f in MODEL_FLAGS.values():
        if dest(f) not in ("ffn_hidden_size", "micro_batch_size"):  # a rule, not a number
            assert f"(default {value(args, f)})" in help_text or f"(default: {value(args, f)}," in help_text, dest(f)


def test_search_without_model_flags_plans_trains_model() -> None:
    wl = cli_search.workload_from_args(_search_args("--world-size", "4", "--hardware", DEFAULT_HARDWARE))
    assert wl == workload(LlavaSpec(), 8, 1)
    assert (wl.llm.num_layers, wl.llm.hidden, wl.llm.seq, wl.encoder.seq, wl.global_batch) == (2, 64, 32, 8, 8)
    # model flags change train's model; --encoder/--llm choose a preset instead (as before)
    wl = cli_search.workload_from_args(_search_args("--world-size", "4", "--hidden-size", "128"))
    assert wl.llm.hidden == 128 and wl.dtype_bytes == 4
    # what train runs anyway may be spelled out
    assert cli_search.workload_from_args(
        _search_args("--encoder-ffn-hidden-size", "128", "--images-per-sample", "1")
    ) == workload(LlavaSpec(), 8, 1)
    wl = cli_search.workload_from_args(_search_args("--llm", "14B"))
    assert wl.llm.hidden == 5120 and wl.llm.seq == 8192 and wl.encoder.hidden == 1536 and wl.dtype_bytes == 2


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--encoder-ffn-hidden-size", "256"], "--encoder-ffn-hidden-size 256 applies to the --encoder/--llm presets"),
        (["--images-per-sample", "2"], "--images-per-sample 2 applies to the --encoder/--llm presets"),
        (
            ["--encoder-hidden-size", "30"],
            "--encoder-hidden-size 30 is not divisible by --encoder-num-attention-heads 4",
        ),
        (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    ],
)
def test_search_invalid_model_flags_exit_2(capsys, argv, message) -> None:
    rc, out, err = _run(capsys, "search", "--world-size", "4", "--hardware", DEFAULT_HARDWARE, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("megatron-hetero search: invalid input: ") and message in err


# ------------------------------------------------------------------------------------------
# hardware presets: package data, by name or path
# ------------------------------------------------------------------------------------------
def test_hardware_presets_are_package_data(tmp_path, capsys) -> None:
    assert DEFAULT_HARDWARE in hardware_names()
    assert not (REPO / "examples" / "hardware").exists()
    hw = load_hardware(DEFAULT_HARDWARE)
    assert hw.memory_bytes == 80e9 and hw.devices_per_node == 8
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"megatron_hetero.planner.hardware_presets" = ["*.json"]' in pyproject
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(hw.to_dict()))
    assert load_hardware(str(path)) == load_hardware(path) == hw
    argv = ["search", "--world-size", "8", "--top", "3", "--json"]  # train's model (no model flags)
    docs = []
    for source in (DEFAULT_HARDWARE, str(path)):
        rc, out, err = _run(capsys, *argv, "--hardware", source)
        assert rc == 0, err
        docs.append(json.loads(out))
    assert docs[0]["ranked"] == docs[1]["ranked"] and len(docs[0]["ranked"]) == 3
    rc, _, err = _run(capsys, "search", "--world-size", "8", "--hardware", str(tmp_path / "none.json"))
    assert rc == 2 and "cannot read hardware spec file" in err
    # `--regime-table` with no cost source (the default preset): tests/e2e/test_regime_table.py


def test_flags_are_generated_from_their_fields() -> None:
    """layout.flags: a field declares its flag once (default, help, group); the parser's default is
    the field's (None for a `given` flag, the `cli` default where the command line's differs), and
    `values` reads a namespace back into the dataclass."""
    import argparse
    import dataclasses
    from typing import Optional

    from megatron_hetero.layout.flags import add_flags, dest, flag_field, flags_of, given, values
    from megatron_hetero.config.optim import OptimConfig
    from megatron_hetero.config.job import JobConfig, train_flag_fields

    @dataclasses.dataclass(frozen=True)
    class Demo:
        size: int = flag_field(3, "size (default {default})", group="g", given=True)
        rate: float = flag_field(0.5, "rate", flag="--learning-rate")
        name: Optional[str] = flag_field(None, metavar="NAME", group="g")
        quiet: bool = flag_field(False, "no lines")
        lines: int = flag_field(0, "lines every N", cli=1)
        internal: int = 7

    p = argparse.ArgumentParser()
    add_flags(p, flags_of(Demo), {"g": "the group"})
    assert [f.name for f in flags_of(Demo)] == ["size", "rate", "name", "quiet", "lines"]
    a = p.parse_args([])
    assert (a.size, a.learning_rate, a.name, a.quiet, a.lines) == (None, 0.5, None, False, 1)
    assert Demo(**values(Demo, a)) == Demo(lines=1) and not given(a, flags_of(Demo, ["size"])[0])
    a = p.parse_args(["--size", "4", "--learning-rate", "2", "--name", "x", "--quiet"])
    assert Demo(**values(Demo, a)) == Demo(size=4, rate=2.0, name="x", quiet=True, lines=1)
    text = p.format_help()
    assert "size (default 3)" in text and "the group:" in text and "--learning-rate LEARNING_RATE" in text
    # train's parser: every flag of a field has the field's default (or None: given; or its cli default)
    args = cli.build_parser().parse_args(["train"])
    for f in train_flag_fields():
        meta = f.metadata["cli_flag"]
        want = None if meta["given"] else meta.get("cli", f.default)
        assert getattr(args, dest(f)) == want, f.name
    assert OptimConfig(**values(OptimConfig, args)) == OptimConfig()
    assert {f.name for f in flags_of(JobConfig)} >= {"train_iters", "save", "load", "eval_interval", "trace"}
