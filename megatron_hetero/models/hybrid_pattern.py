"""`--hybrid-layer-pattern` (Megatron-core's hybrid layer pattern: `*` attention, `-` MLP, `E` MoE,
`M` Mamba, `|` pipeline stage) without torch: what this build runs (`check_pattern`,
`check_pipeline`), and the names of a GPT model's parameters in the HybridModel of `*-` pairs, one
pair per GPT layer (`gpt_to_hybrid_name`, `hybrid_to_gpt_name`, `is_gpt_pairs`: what Hugging Face
conversion goes through). The model is built in `models.hybrid_lm`."""

from __future__ import annotations

import re
from typing import Optional

SYMBOLS = {"*": "attention", "-": "MLP", "E": "MoE", "M": "Mamba"}
PIPE = "|"


def pattern_layers(pattern: str) -> str:
    """The layer symbols of a pattern, pipes removed."""
    return pattern.replace(PIPE, "")


def check_pattern(pattern: str, impl: str, num_experts: Optional[int]) -> None:
    """ValueError (one line, the reason) for a pattern this build cannot run: an unknown symbol (MTP
    `/` and Megatron's other symbols included), an empty stage, `E` without --num-experts, `M`
    with the local implementation."""
    if "/" in pattern:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: multi-token prediction ('/') is not supported")
    bad = sorted({c for c in pattern_layers(pattern) if c not in SYMBOLS})
    if bad:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: symbols {bad} are not supported "
            f"(supported: {', '.join(f'{k} {v}' for k, v in SYMBOLS.items())}, | pipeline split)"
        )
    if any(not seg for seg in pattern.split(PIPE)):
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: every pipeline stage ('|'-separated) needs layers")
    if "E" in pattern and not num_experts:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: MoE layers ('E') need --num-experts")
    if "M" in pattern and impl != "transformer_engine":
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: Mamba layers ('M') need Megatron's Mamba mixer, which runs on "
            "the mamba-ssm and causal-conv1d CUDA kernels with Transformer Engine: on a GPU machine use "
            "--transformer-impl transformer_engine (not on CPU)"
        )


def check_pipeline(pattern: str, module: str, pp: int) -> None:
    """ValueError unless the pattern's stages match the module's pp: pp - 1 pipes, or none with
    the layers splitting evenly (Megatron's rule)."""
    stages = pattern.count(PIPE) + 1
    if stages > 1 and stages != pp:
        raise ValueError(
            f"module {module}: --hybrid-layer-pattern {pattern!r} has {stages} pipeline stages, the layout's pp is {pp}"
        )
    if stages == 1 and len(pattern) % pp:
        raise ValueError(
            f"module {module}: the {len(pattern)} layers of --hybrid-layer-pattern {pattern!r} do not split over "
            f"pp({pp}); mark the stages with '|'"
        )


_GPT_LAYER = re.compile(r"^(.*decoder\.layers\.)(\d+)\.(input_layernorm|self_attention|pre_mlp_layernorm|mlp)\.(.*)$")


def gpt_to_hybrid_name(name: str) -> str:
    """A GPT language module's parameter name -> the same parameter's in the HybridModel of the
    pattern `*-` per GPT layer: layer i's input_layernorm and self_attention go to layer 2i (`*`),
    its pre_mlp_layernorm and mlp to layer 2i+1 (`-`); `final_layernorm` is `final_norm`; the
    embedding and output layer keep their names."""
    m = _GPT_LAYER.match(name)
    if m:
        prefix, i, part, rest = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        j = 2 * i if part in ("input_layernorm", "self_attention") else 2 * i + 1
        return f"{prefix}{j}.{part}.{rest}"
    return name.replace("decoder.final_layernorm.", "decoder.final_norm.")


def hybrid_to_gpt_name(name: str) -> str:
    """`gpt_to_hybrid_name`'s inverse (a pattern of `*-` pairs)."""
    m = _GPT_LAYER.match(name)
    if m:
        return f"{m.group(1)}{int(m.group(2)) // 2}.{m.group(3)}.{m.group(4)}"
    return name.replace("decoder.final_norm.", "decoder.final_layernorm.")


def is_gpt_pairs(pattern: Optional[str]) -> bool:
    """Whether a pattern is a GPT model in hybrid form: `*-` pairs only (pipes between pairs)."""
    if not pattern:
        return False
    return all(seg and len(seg) % 2 == 0 and seg == "*-" * (len(seg) // 2) for seg in pattern.split(PIPE))
