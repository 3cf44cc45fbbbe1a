"""`train`'s mixed-precision flags (Megatron-LM's names and defaults) and their ValueErrors, and the
checkpoint record of the model's precision. Pure: no torch."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hetero import cli
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.layout.flags import values
from megatron_hetero.config.model import LlavaSpec
from megatron_hetero.config.optim import OptimConfig


def test_fp16_flags_parse_with_megatrons_defaults() -> None:
    args = cli.build_parser().parse_args(["train", "--fp16"])
    o = OptimConfig(**values(OptimConfig, args))
    assert (o.fp16, o.loss_scale, o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis) == (
        True,
        None,
        2.0**32,
        1.0,
        1000,
        2,
    )
    argv = ["train", "--fp16", "--loss-scale", "8", "--initial-loss-scale", "64", "--min-loss-scale", "2"]
    argv += ["--loss-scale-window", "10", "--hysteresis", "1"]
    o = OptimConfig(**values(OptimConfig, cli.build_parser().parse_args(argv)))
    assert (o.loss_scale, o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis) == (
        8.0,
        64.0,
        2.0,
        10.0,
        1,
    )
    o.validate()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(bf16=True, fp16=True), "--bf16 and --fp16 exclude each other"),
        (dict(fp16=True, loss_scale=0.0), "--loss-scale must be > 0"),
        (dict(fp16=True, min_loss_scale=8.0, initial_loss_scale=4.0), "need 0 < min <= initial"),
        (dict(fp16=True, loss_scale_window=0), "--loss-scale-window must be >= 1"),
        (dict(fp16=True, hysteresis=0), "--hysteresis must be a positive integer"),
        (dict(loss_scale=8.0), "--loss-scale 8.0 needs --fp16"),
    ],
)
def test_bad_precision_flags_are_value_errors(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kw).validate()


def test_the_model_record_names_fp16_only_when_set() -> None:
    # checkpoints saved before --fp16 existed (fp32, bf16) keep matching the record of the same job
    assert "fp16" not in spec_record(LlavaSpec()) and spec_record(LlavaSpec())["bf16"] is False
    assert spec_record(dataclasses.replace(LlavaSpec(), fp16=True))["fp16"] is True
