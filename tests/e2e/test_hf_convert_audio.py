"""`convert hf-to-checkpoint --audio HF_DIR` (a Whisper encoder as the `audio` module beside the vision
tower and the language model) and back: the encoder's tensors return bit-identical, and the written
folder loads in transformers and computes the original encoder's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.cli import main  # noqa: E402
from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

MEL, TOKENS = 8, 6


def _tiny(root: Path) -> dict[str, Path]:
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        LlamaConfig,
        LlamaForCausalLM,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    torch.manual_seed(0)
    out = {"clip": root / "clip", "llama": root / "llama", "whisper": root / "whisper"}
    CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
        )
    ).save_pretrained(out["clip"])
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=32,
            max_position_embeddings=32,
        )
    ).save_pretrained(out["llama"])
    whisper = WhisperForConditionalGeneration(
        WhisperConfig(
            num_mel_bins=MEL,
            d_model=16,
            encoder_layers=2,
            encoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_layers=1,
            decoder_attention_heads=2,
            decoder_ffn_dim=32,
            max_source_positions=TOKENS,
            max_target_positions=8,
            vocab_size=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    )
    with torch.no_grad():  # non-trivial LayerNorms and biases
        for name, p in whisper.model.encoder.named_parameters():
            if "embed_positions" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    whisper.save_pretrained(out["whisper"])
    return out


def _cli(argv: list[str]) -> int:
    return main(argv)


def _run(argv: list[str]) -> int:
    return run_ranks(1, _cli, argv, init_distributed=False, timeout=240)[0]


@pytest.mark.timeout(300)
def test_audio_encoder_converts_in_and_out_bit_identical(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import WhisperForConditionalGeneration, WhisperModel

    hf = _tiny(tmp_path)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    argv = ["convert", "hf-to-checkpoint", "--vision", str(hf["clip"]), "--language", str(hf["llama"])]
    assert _run(argv + ["--audio", str(hf["whisper"]), "--out", str(ckpt)]) == 0
    state = json.loads(next(ckpt.rglob("train_state.json")).read_text())
    audio = state["model"]["encoders"]["audio"]
    assert (audio["kind"], audio["tokens"], audio["feature_dim"], audio["offset"]) == ("whisper", TOKENS, 2 * MEL, 5)
    assert _run(["convert", "checkpoint-to-hf", str(ckpt), "--out", str(back)]) == 0
    src = load_file(hf["whisper"] / "model.safetensors")
    want = {k[len("model.") :]: v for k, v in src.items() if k.startswith("model.encoder.")}
    got = load_file(back / "audio" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    for name in ("vision", "language", "projector", "audio_projector"):
        assert (back / name / "model.safetensors").is_file(), name
    # the written folder is a WhisperModel transformers loads, with the original encoder
    mel = torch.randn(2, MEL, 2 * TOKENS, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = WhisperForConditionalGeneration.from_pretrained(hf["whisper"]).eval().model.encoder(mel)
        out = WhisperModel.from_pretrained(back / "audio").eval().encoder(mel)
    assert torch.equal(ref.last_hidden_state, out.last_hidden_state)


@pytest.mark.timeout(200)
def test_audio_that_is_not_whisper_is_refused(tmp_path, capsys):
    hf = _tiny(tmp_path)
    argv = ["convert", "hf-to-checkpoint", "--vision", str(hf["clip"]), "--language", str(hf["llama"])]
    # refused before any weight is read or process group made: in this process
    assert main(argv + ["--audio", str(hf["clip"]), "--out", str(tmp_path / "x")]) == 2
    assert "is not a Whisper model" in capsys.readouterr().err
