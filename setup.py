"""megatron-hetero: per-module parallel layouts for multimodal training on Megatron-core."""
from setuptools import find_packages, setup

# Real image-caption data (`megatron-hetero data digits`, `train --data-path`): Megatron's multimodal
# loader, the bundled digits, PNG decoding, and the caption tokenizer (notes/energon-...-on-cpu.md).
# What Megatron-LM's training package (core_v0.16.1) imports beyond megatron-core:
# six, regex (tokenizer), pydantic (training.py imports megatron.rl).
MEGATRON_LM = ["six", "regex", "pydantic"]
DATA = ["megatron-energon==7.4.1", "scikit-learn", "pillow", "tokenizers"]

setup(
    name="megatron-hetero",
    version="0.1.0",
    description=(
        "Heterogeneous parallelism for Megatron-core: each module of a multimodal graph "
        "(encoders, projector, language model) with its own TP/CP/PP/DP/EP layout and placement."
    ),
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_hetero", "megatron_hetero.*"]),
    # hardware presets (`megatron-hetero search --hardware NAME`) and the caption tokenizer
    # (models/digits_tokenizer.json, `train --data-path` without --tokenizer-model) ship inside the package
    package_data={"megatron_hetero": ["py.typed"], "megatron_hetero.planner.hardware_presets": ["*.json"],
                  "megatron_hetero.models": ["*.json"]},
    install_requires=[
        # CPU machines: install torch==2.13.0 first (a local CPU wheel); an unpinned torch pulls
        # a multi-GB CUDA build. The range below is satisfied by that pin and installs nothing more.
        "torch>=2.4",
        "megatron-core==0.16.1",
        "einops",
        "numpy",
        "PyYAML>=6",
        # `megatron-hetero convert` reads and writes Hugging Face weights as safetensors (never pickle);
        # small, no dependencies. `train` itself never imports it.
        "safetensors>=0.4",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "hypothesis>=6",
            *DATA,
            "matplotlib",  # tests/test_draw.py and test_trace.py check the pictures
            # tests/test_megatron_lm.py runs Megatron-LM's own scripts, which import these
            *MEGATRON_LM,
            # tests/test_hf_convert.py builds tiny Hugging Face models (CLIPVisionModel, Llama, Qwen2)
            # and compares their forward with the converted modules; a test extra only: neither
            # `train` nor `convert` imports transformers (4.57.1: works with torch 2.13; it pins
            # tokenizers < 0.23, which the caption tokenizer also runs on)
            "transformers==4.57.1",
        ],
        "data": DATA,
        "megatron-lm": MEGATRON_LM,
        "bench": ["matplotlib"],
        # GPU machines only. Never install on a CPU machine: the transformer-engine meta package
        # alone makes `import megatron.core` raise. NVIDIA apex is not on PyPI (the PyPI package
        # named `apex` is an unrelated web toolkit); build it from NVIDIA's apex source if wanted.
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["megatron-hetero=megatron_hetero.cli:main"]},
)
