"""`pretrain_vlm.py --hetero-autotune` before any rank starts (`megatron_lm/autotune.py`; pure: parsed
Megatron arguments as a namespace, no Megatron-LM tree): the flags on a parser, the model the cost
model prices, the degrees the script's model keeps, what is refused, and which candidates the script's
checks let through. The runs are in tests/e2e/test_megatron_lm_autotune.py."""

from __future__ import annotations

import argparse

import pytest

from megatron_hetero.layout.yaml_io import layout_from_dict
from megatron_hetero.megatron_lm import autotune as MA
from megatron_hetero.megatron_lm.vlm import VLM
from megatron_hetero.config.autotune import parse_fix, AutotuneConfig
from megatron_hetero.config.job import JobDraft
from test_megatron_lm_checks import _args as megatron_args

COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": 2}, "language": {"dp": 2}},
    "edges": ["vision -> language"],
}


def _args(**kw) -> argparse.Namespace:
    """What Megatron's parser gives the tiny LLaVA of tests/e2e/test_megatron_lm.py, with the flags."""
    parser = MA.add_autotune_args(argparse.ArgumentParser())
    ns = parser.parse_args(kw.pop("argv", ["--hetero-autotune"]))
    base = vars(megatron_args())  # what driver.check_common and vlm.check_vlm read
    base.update(
        num_layers=None,
        decoder_num_layers=2,
        encoder_num_layers=1,
        hidden_size=64,
        ffn_hidden_size=256,
        seq_length=32,
        dataloader_seq_length=None,
        img_h=32,
        img_w=32,
        patch_dim=16,
        disable_vision_class_token=False,
        vocab_size=128,
        padded_vocab_size=None,
        bf16=False,
        fp16=False,
        swiglu=False,
        group_query_attention=False,
        num_query_groups=1,
        global_batch_size=4,
        micro_batch_size=1,
        train_iters=9,
        save="/tmp/ckpt",
        save_interval=100,
        hetero_offload_encoder=False,
        hetero_comm_timeout=60.0,
        clip_grad=1.0,
    )
    base.update(kw)
    for k, v in base.items():
        setattr(ns, k, v)
    return ns


def _layout(doc=COLOC, world: int = 2):
    return layout_from_dict(doc, world)


def test_the_flags_are_trains_with_its_defaults():
    tune = MA.autotune_config(
        _args(argv=["--hetero-autotune", "--autotune-steps", "4", "--autotune-fix", "language.tp=2"])
    )
    assert tune == AutotuneConfig(hetero_autotune=True, autotune_steps=4, autotune_fix="language.tp=2")
    assert MA.autotune_config(_args(argv=[])) is None


def test_the_cost_model_prices_pretrain_vlms_llava():
    spec = MA.cost_spec(_args())
    (enc,) = spec.encoders.values()
    # 2x2 patches of 16 pixels and the class token; the decoder sequence: text + image tokens
    assert (enc.tokens, enc.feature_dim, enc.kind, enc.hidden_size, enc.num_layers) == (5, 768, "clip", 64, 1)
    assert (spec.num_layers, spec.hidden_size, spec.seq_length, spec.vocab_size) == (2, 64, 37, 128)
    # after build.vlm_sizes rewrote seq_length to the image tokens: the same model
    after = MA.cost_spec(_args(seq_length=5, dataloader_seq_length=32, padded_vocab_size=128))
    assert after == spec


def test_the_degrees_the_script_keeps_are_pinned_unless_the_user_pinned_them():
    pins = parse_fix(MA.script_fixes(AutotuneConfig(True)))
    assert pins == {"vision": {"pp": 1, "cp": 1}, "language": {"cp": 1}}
    mine = parse_fix(MA.script_fixes(AutotuneConfig(True, autotune_fix="language.tp=2,vision.cp=1")))
    assert mine == {"language": {"tp": 2, "cp": 1}, "vision": {"cp": 1, "pp": 1}}


@pytest.mark.parametrize(
    "script, change, says",
    [
        ("pretrain_gpt.py", {}, "not supported with pretrain_gpt.py"),
        ("pretrain_vlm.py", {"save": None}, "needs --save DIR"),
        ("pretrain_vlm.py", {"train_iters": 3}, "--train-iters 3 is fewer"),
        ("pretrain_vlm.py", {"argv": ["--hetero-autotune", "--autotune-steps", "1"]}, "--autotune-steps must be"),
        ("pretrain_vlm.py", {"argv": ["--hetero-autotune", "--autotune-fix", "audio.tp=2"]}, "names ['audio']"),
        ("pretrain_vlm.py", {"argv": ["--hetero-autotune", "--autotune-fix", "vision.pp"]}, "MODULE.FIELD=INT"),
    ],
)
def test_refused_before_any_rank_starts(script, change, says):
    with pytest.raises(ValueError) as e:
        MA.check_script_autotune(script, _args(**change), _layout())
    assert says in str(e.value), str(e.value)


def test_without_the_flag_nothing_is_checked():
    MA.check_script_autotune("pretrain_gpt.py", _args(argv=[], save=None), _layout())


def test_candidates_pass_the_scripts_own_checks():
    args = _args(padded_vocab_size=128)
    job = MA.cost_job(args, AutotuneConfig(True))
    check = MA.candidate_check(VLM, args)
    layout = _layout({**COLOC, "placement": "disjoint", "modules": {"vision": {}, "language": {}}})
    made = check(JobDraft(layout, job))  # the Job the run moves to
    assert (made.layout, made.config) == (layout, job) and made.checked is not None
    for doc, says in [
        ({**COLOC, "modules": {"vision": {"dp": 1, "pp": 2}, "language": {"dp": 1, "pp": 2}}}, "pp=2"),
        ({**COLOC, "modules": {"vision": {"dp": 1, "cp": 2}, "language": {"dp": 1, "cp": 2}}}, "cp=2"),
    ]:
        with pytest.raises(ValueError, match=says):
            check(JobDraft(_layout(doc), job))
    with pytest.raises(ValueError, match="padded vocabulary 129"):
        MA.candidate_check(VLM, _args(padded_vocab_size=129))(
            JobDraft(_layout({**COLOC, "modules": {"vision": {"tp": 2, "dp": 1}, "language": {"tp": 2, "dp": 1}}}), job)
        )
