"""train's door (`cli/train_door.py`): the flags read once into typed objects, which JobConfig fields
are flags said once (on the fields), and the floors below taking no namespace."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_hetero import cli
from megatron_hetero.cli.train_door import arch_flags, data_request, model_flags
from megatron_hetero.layout.flags import flags_of
from megatron_hetero.config.data import CaptionDataConfig, DataRequest
from megatron_hetero.config.model import EncoderSpec, LlavaSpec, ModelFlags, flag_values, spec_from_flags
from megatron_hetero.config.arch import ArchFlags
from megatron_hetero.config.job import DERIVED_JOB_FLAGS, JobConfig, plain_job_flags, train_flag_fields

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_hetero"


def _train(*argv: str):
    return cli.build_parser().parse_args(["train", *argv])


def test_model_flags_hold_what_was_given() -> None:
    got = model_flags(_train("--hidden-size", "96", "--encoder-tokens", "4", "--num-experts", "2", "--seed", "9"))
    assert got.language == {"hidden_size": 96} and got.encoder == {"tokens": 4}
    assert got.moe == {"num_experts": 2, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.0} and got.seed == 9
    assert model_flags(_train()) == ModelFlags(moe={"moe_router_topk": 2, "moe_aux_loss_coeff": 0.0})


def test_spec_from_model_flags_round_trips_flag_values() -> None:
    spec = LlavaSpec(num_layers=3, hidden_size=48, encoders={"vision": EncoderSpec(tokens=4, feature_dim=12)})
    assert spec_from_flags(ModelFlags.from_dests(flag_values(spec, keep_none=True))) == spec
    with pytest.raises(ValueError, match="--hidden-size must be >= 1"):
        spec_from_flags(ModelFlags(language={"hidden_size": 0}))


def test_data_request_reads_the_data_flags_and_their_defaults() -> None:
    assert data_request(_train()) == DataRequest()
    for name in ("tokenizer_model", "patch_size", "image_processor", "prompt", "trust_code", "num_workers"):
        want = next(f.default for f in dataclasses.fields(CaptionDataConfig) if f.name == name)
        assert getattr(DataRequest(), name) == want, name
    got = data_request(_train("--data-path", "D", "--num-workers", "0", "--seq-length", "16", "--vocab-size", "300"))
    assert (got.data_path, got.num_workers, got.seq_length_given, got.vocab_size) == ("D", 0, True, 300)
    assert (got.encoder_tokens, got.encoder_feature_dim, got.seed) == (None, None, 1234)


def test_arch_flags_none_when_not_given() -> None:
    assert arch_flags(_train()) == ArchFlags()
    assert arch_flags(_train("--swiglu")).swiglu is True


def test_job_flags_are_said_once_on_the_fields() -> None:
    """Every JobConfig field with a flag is on train's parser (the batch by the shared model flags,
    the rest by `train_flag_fields`), and the door takes as given all but the derived ones."""
    job_flags = {f.name for f in flags_of(JobConfig)}
    on_train = {f.name for f in train_flag_fields() if f in dataclasses.fields(JobConfig)}
    assert on_train == job_flags - {"global_batch_size", "micro_batch_size"}
    assert {f.name for f in plain_job_flags()} == job_flags - set(DERIVED_JOB_FLAGS)


def test_no_floor_below_the_doors_reads_a_namespace() -> None:
    """`layout.flags.value/values/given` read a namespace: only the doors (cli/, the Megatron-LM
    scripts' megatron_lm/, layout/ itself) call them."""
    readers = {"value", "values", "given"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if rel[0] in ("cli", "megatron_lm", "layout"):
            continue
        text = path.read_text()
        for m in re.finditer(r"from megatron_hetero\.layout\.flags import (?:\(([\w\s,]+)\)|([\w ,]+))", text):
            names = {n.split(" as ")[0].strip() for n in (m.group(1) or m.group(2)).split(",")}
            offenders += [f"{'/'.join(rel)}: {n}" for n in sorted(names & readers)]
    assert offenders == []
