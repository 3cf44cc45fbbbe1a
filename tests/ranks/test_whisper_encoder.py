"""The Whisper speech encoder (`models.whisper_encoder`) against transformers' `WhisperModel.encoder`.

A tiny random Whisper built offline; its encoder tensors go into `WhisperEncoderModule` (world 1 and
TP2 through the fork launcher) and the encoder output on the same log-mel input must equal
transformers' `last_hidden_state` within 1e-5 (fp32); the tensors come back bit-identical; a short
clip (15 frames -> 8 tokens) equals transformers' layers run on that clip alone (transformers' own
forward takes only full-length input); the key bias stays zero under backward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from megatron_hetero.runtime.launcher import run_ranks  # noqa: E402

MEL, TOKENS, HIDDEN, HEADS, LAYERS, FFN = 16, 12, 32, 4, 2, 64
TOL = 1e-5


def _hf_whisper():
    from transformers import WhisperConfig, WhisperModel

    torch.manual_seed(0)
    cfg = WhisperConfig(
        num_mel_bins=MEL,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_layers=1,
        decoder_attention_heads=HEADS,
        decoder_ffn_dim=FFN,
        max_source_positions=TOKENS,
        max_target_positions=16,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        activation_function="gelu",
    )
    model = WhisperModel(cfg).eval()
    with torch.no_grad():  # random LayerNorms and biases, so a wrong mapping shows
        for name, p in model.encoder.named_parameters():
            if "embed_positions" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _enc() -> SimpleNamespace:
    return SimpleNamespace(
        kind="whisper",
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        tokens=TOKENS,
        feature_dim=2 * MEL,
        norm_epsilon=1e-5,
    )


def _rank(tp: int, hf_state: dict, mel_full: torch.Tensor, mel_short: torch.Tensor) -> dict:
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hetero.compat import ensure_global_memory_buffer
    from megatron_hetero.layout import layout_from_dict
    from megatron_hetero.models.hf_whisper_names import whisper_to_hf, whisper_to_ours
    from megatron_hetero.models.whisper_encoder import WhisperEncoderModule, mel_to_pairs
    from megatron_hetero.runtime.topology import Topology

    ensure_global_memory_buffer()
    model_parallel_cuda_manual_seed(1, tp_rank=0, ep_rank=0, etp_rank=0)
    doc = {
        "placement": "colocated",
        "modules": {"audio": {"tp": tp}, "language": {"tp": tp}},
        "edges": ["audio -> language"],
    }
    layout = layout_from_dict(doc, world_size=dist.get_world_size())
    topo = Topology.build(layout)
    pgs = topo.pg_collection("audio")
    enc = _enc()
    mod = WhisperEncoderModule("audio", enc, 24, layout.module("audio"), pgs, seed=3).eval()
    ours = whisper_to_ours(hf_state.__getitem__, enc)
    rank = pgs.tp.rank()
    local = {}
    for name, p in mod.named_parameters():
        if name.startswith("projector."):
            continue
        full = ours[name]
        dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
        local[name] = full.chunk(tp, dim)[rank] if dim >= 0 else full
    missing = set(ours) - set(local)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name in local:
                p.copy_(local[name])
        full = mod.mel_features(mel_full)
        short = mod.mel_features(mel_short)
        projected = mod(mel_to_pairs(mel_full))
        paired = mod.features(mel_to_pairs(mel_full))
    back = whisper_to_hf(ours, enc)
    # the key bias holds at zero under training: its gradient is masked
    mod.train()
    mod.mel_features(mel_full).square().sum().backward()
    key_grad = max(
        float(layer.self_attention.linear_qkv.bias.grad.reshape(-1, 3, HIDDEN // HEADS)[:, 1].abs().max())
        for layer in mod.decoder.layers
    )
    with pytest.raises(ValueError, match=r"this encoder takes 1\.\.24"):
        mod.mel_features(torch.zeros(1, MEL, 25))
    topo.destroy()
    return {
        "full": full,
        "short": short,
        "projected": projected.shape,
        "paired": torch.equal(paired, full),
        "back": back,
        "missing": missing,
        "key_grad": key_grad,
    }


@pytest.fixture(scope="module")
def reference():
    model = _hf_whisper()
    torch.manual_seed(1)
    mel_full = torch.randn(2, MEL, 2 * TOKENS)
    mel_short = mel_full[:, :, :15].clone()  # 15 frames -> 8 tokens
    with torch.no_grad():
        want_full = model.encoder(mel_full).last_hidden_state
        # transformers takes only full-length input: run its layers on the short clip by hand
        enc = model.encoder
        x = torch.nn.functional.gelu(enc.conv2(torch.nn.functional.gelu(enc.conv1(mel_short)))).permute(0, 2, 1)
        x = x + enc.embed_positions.weight[: x.shape[1]]
        for layer in enc.layers:
            x = layer(x, None, layer_head_mask=None)[0]
        want_short = enc.layer_norm(x)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("encoder.")}
    return SimpleNamespace(state=state, mel_full=mel_full, mel_short=mel_short, full=want_full, short=want_short)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_whisper_encoder_matches_transformers_and_round_trips(reference, tp):
    got = run_ranks(tp, _rank, tp, reference.state, reference.mel_full, reference.mel_short, timeout=200)
    for res in got:
        assert res["full"].shape == reference.full.shape == (2, TOKENS, HIDDEN)
        full = float((res["full"] - reference.full).abs().max())
        assert res["short"].shape == reference.short.shape == (2, 8, HIDDEN)
        short = float((res["short"] - reference.short).abs().max())
        print(f"\nWhisper encoder tp{tp}: max |ours - transformers| full clip {full:.1e}, 15-frame clip {short:.1e}")
        assert full <= TOL and short <= TOL, (full, short)
        assert res["projected"] == (2, TOKENS, 24)
        assert res["paired"]  # frame pairs [b, tokens, 2*mel] are the same input
        assert not res["missing"], res["missing"]
        assert res["key_grad"] == 0.0
        assert set(res["back"]) == set(reference.state)
        for name, t in reference.state.items():
            assert torch.equal(res["back"][name], t), name


def test_expected_whisper_names_and_shapes_match_transformers(reference):
    from megatron_hetero.models.hf_whisper_names import expected_whisper

    want = {k: tuple(v.shape) for k, v in reference.state.items()}
    assert expected_whisper(_enc()) == want
