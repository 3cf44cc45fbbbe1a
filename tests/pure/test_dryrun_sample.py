"""`dryrun`'s pure parts: which ranks it samples (`--ranks`), and the search's memory model against
`planner.memory` on the regime presets' encoders (the term the dry run found missing: an encoder's
parameters outside its layers, on its first and last stage)."""

from __future__ import annotations

import pytest

from megatron_hetero.layout import layout_from_dict
from megatron_hetero.training.dryrun_world import default_ranks, parse_ranks

N = 16384
COLOC = {
    "placement": "colocated",
    "modules": {"vision": {"dp": N}, "language": {"tp": 8, "pp": 4, "dp": N // 32}},
    "edges": ["vision -> language"],
}
DISJ = {
    "placement": "disjoint",
    "modules": {
        "vision": {"dp": N // 2, "ranks": f"0-{N // 2 - 1}"},
        "language": {"tp": 8, "pp": 4, "dp": N // 64, "ranks": f"{N // 2}-{N - 1}"},
    },
    "edges": ["vision -> language"],
}


def test_default_sample_is_the_stage_leaders_and_the_ends() -> None:
    # colocated: rank 0, the last rank, the language stages' first ranks (4096 apart); the vision
    # module's last stage is its only one (rank 0); the language module's first stage starts at 0
    assert default_ranks(layout_from_dict(COLOC, world_size=N)) == [0, 4096, 8192, 12288, N - 1]
    # disjoint: plus the language island's first rank (the edge's destination leader)
    assert default_ranks(layout_from_dict(DISJ, world_size=N)) == [0, 8192, 10240, 12288, 14336, N - 1]


def test_ranks_flag() -> None:
    layout = layout_from_dict(COLOC, world_size=N)
    assert parse_ranks("0,17,N-1", layout) == [0, 17, N - 1]
    assert parse_ranks(" 5 , N-2 ", layout) == [5, N - 2]
    with pytest.raises(ValueError, match="outside the world of 16384"):
        parse_ranks("16384", layout)
    with pytest.raises(ValueError, match="'x' is not a rank"):
        parse_ranks("0,x", layout)
    with pytest.raises(ValueError, match="--ranks all: 16384 ranks"):
        parse_ranks("all", layout)
    small = layout_from_dict(COLOC | {"modules": {"vision": {"dp": 4}, "language": {"dp": 4}}}, world_size=4)
    assert parse_ranks("all", small) == [0, 1, 2, 3]


@pytest.mark.parametrize("enc,llm", [("1B", "14B"), ("12B", "120B")])
@pytest.mark.parametrize("tp,pp", [(8, 1), (8, 4), (1, 4)])
def test_search_state_of_an_encoder_stage_is_the_memory_models(enc: str, llm: str, tp: int, pp: int) -> None:
    """Every pipeline stage of a regime encoder on TP `tp`: the search's state bytes (per stage class,
    `planner.stages.module_stages`) within 0.5% of `planner.memory`'s (exact parameter counts; the rest
    is the layers' biases and norms the search does not count)."""
    import numpy as np

    from megatron_hetero.layout.spec import ModuleLayout
    from megatron_hetero.planner.hardware import Profile
    from megatron_hetero.planner.hardware_presets import DEFAULT_HARDWARE, load_hardware
    from megatron_hetero.planner.memory import StateFeatures, stage_params, stage_state_bytes
    from megatron_hetero.config.model import EncoderSpec, LlavaSpec
    from megatron_hetero.planner.presets import regime_workload
    from megatron_hetero.planner.stages import module_stages

    wl = regime_workload(enc, llm, 8192)
    e = wl.encoder
    dp = 64
    st = module_stages(
        Profile.from_hardware(load_hardware(DEFAULT_HARDWARE)),
        wl,
        e,
        tp,
        1,
        pp,
        dp,
        e.num_layers,
        1,
        runs=1,
        p2p=pp > 1,
        inter=True,
        placement="colocated",
        io_last=True,
    )
    encoder = EncoderSpec(
        num_layers=e.num_layers, hidden_size=e.hidden, num_attention_heads=e.heads, tokens=e.seq, feature_dim=e.features
    )
    spec = LlavaSpec(hidden_size=wl.llm.hidden, num_attention_heads=wl.llm.heads, encoders={"vision": encoder})
    lay = layout_from_dict(
        {
            "placement": "colocated",
            "modules": {"vision": {"tp": tp, "pp": pp, "dp": dp}, "language": {"tp": tp, "pp": pp, "dp": dp}},
            "edges": ["vision -> language"],
        },
        world_size=tp * pp * dp,
    )
    m: ModuleLayout = lay.module("vision")
    feats = StateFeatures(precision="bf16", distributed_optimizer=True)
    for stage in range(pp):
        want = sum(stage_state_bytes(m, stage_params(lay, spec, "vision", stage), feats).values())
        cls = 0 if stage == 0 else (3 if stage == pp - 1 else 2)
        got = float(np.asarray(st.state)[0, cls])
        assert got == pytest.approx(want, rel=5e-3), (stage, got, want)
