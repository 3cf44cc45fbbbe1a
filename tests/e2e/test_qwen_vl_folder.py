"""A `Qwen2_5_VLForConditionalGeneration` folder (tiny, random, `save_pretrained`: hub names) read into
our two modules' states and written back (`convert.hf_qwen_vl`) returns every tensor bit for bit and
the config as read; `from_pretrained` of the written folder gives transformers' logits bitwise; the
read states, loaded into `models.qwen_vision` + `models.qwen_vl` on one rank, give transformers'
logits within 1e-4 and loss within 1e-5 relative. A folder of another architecture or with a stray
tensor is refused by name."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

from qwen_vl_case import IMAGE, batch, reference, vl_rank  # noqa: E402

LAYOUT = {"placement": "colocated", "modules": {"vision": {}, "language": {}}, "edges": ["vision -> language"]}


@pytest.mark.timeout(300)
def test_qwen_vl_folder_round_trip_and_logits(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from megatron_hetero.convert.hf_qwen_vl import read_qwen_vl, write_qwen_vl

    cfg, hf, ref = reference()
    src = tmp_path / "src"
    model = Qwen2_5_VLForConditionalGeneration(_config(cfg))
    model.load_state_dict(hf)
    model.save_pretrained(src)
    read_cfg, states = read_qwen_vl(src)
    out = write_qwen_vl(read_cfg, states, tmp_path / "out")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    tokens, patches, grid = batch()
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens, pixel_values=patches, image_grid_thw=grid).logits, ref["logits"])
    hub = {
        (
            "model.language_model." + k[6:]
            if k.startswith("model.")
            else "model." + k
            if k.startswith("visual.")
            else k
        ): v
        for k, v in a.items()
    }
    got = run_ranks(1, vl_rank, read_cfg, hub, LAYOUT, timeout=240)[0]
    rel = float((got["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max())
    assert rel <= 1e-4 and abs(float(got["loss"] - ref["loss"])) <= 1e-5 * abs(float(ref["loss"])), rel
    assert IMAGE in tokens
    bad = tmp_path / "bad"
    write_qwen_vl(read_cfg, states, bad)
    save_file({**b, "visual.extra.weight": torch.zeros(1)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensors of no converted part: \['visual.extra.weight'\]"):
        read_qwen_vl(bad)
    (bad / "config.json").write_text(json.dumps({**read_cfg, "model_type": "llava"}))
    with pytest.raises(ValueError, match="is not Qwen2_5_VLForConditionalGeneration"):
        read_qwen_vl(bad)


def _config(cfg: dict):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(**{k: v for k, v in cfg.items()}, attn_implementation="eager")
