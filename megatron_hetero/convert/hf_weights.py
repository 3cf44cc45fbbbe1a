"""Hugging Face folders <-> a megatron-hetero checkpoint (`megatron-hetero convert`).

    hf_to_checkpoint(vision=HF_DIR, language=HF_DIR, projector=FILE|None, out=DIR)
    checkpoint_to_hf(DIR, out=OUT)  ->  OUT/vision, OUT/language (config.json + model.safetensors),
                                        OUT/projector/model.safetensors (LLaVA's names): in
                                        `hf_export.py`, which builds on this file

hf -> checkpoint, in order: (1) both `config.json`s are read and mapped to the model family
(`models.hf_config`): a model it cannot express is refused with the reason here, before any weight
is read; (2) the safetensors headers (names and shapes only) are checked against the names and
shapes that configuration implies (`models.hf_names.check_tensors`: every missing, unexpected or
mis-shaped tensor named with both shapes); (3) only then are tensors read (safetensors, memory
mapped; pickle files are never opened), fused into Megatron-core's layouts and loaded into the
modules, built in this process as a world of one (gloo, TP1/PP1: whole tensors); (4) each logical
model (`vision` with its projector, `language`) is saved with `dist_checkpointing` under the same
layout-independent global keys `train --save` uses (`checkpoint.sharded.model_sharded_state_dict`),
so `train --load DIR` reads it under ANY layout. The projector is LLaVA's
`multi_modal_projector.linear_1/2` from `--projector FILE.safetensors`, or else the family's own
deterministic initialisation (LLaVA stage 1 trains it from scratch).

The checkpoint is iteration 0 and marked `"origin": "convert"` in its `train_state.json`: it holds
model weights only (no optimizer, scheduler, data position or RNG), records the model
(`spec_record`: `train --load DIR` builds that model without its flags, `training.job.recorded_spec`),
and keeps the original `config.json`s under `hf/` (written back by `checkpoint_to_hf`). Its
manifest (bytes + sha256 of every file) is checked on load like any checkpoint's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Optional

from megatron_hetero.models import hf_config
from megatron_hetero.checkpoint.pretrained import ORIGIN
from megatron_hetero.checkpoint.files import FORMAT, LAYOUT_FILE, publish, stage_dir, write_train_state
from megatron_hetero.checkpoint.records import spec_record
from megatron_hetero.convert import hf_audio
from megatron_hetero.models.hybrid_pattern import gpt_to_hybrid_name, hybrid_to_gpt_name, is_gpt_pairs, pattern_layers

HF_DIR = "hf"
VISION, LANGUAGE = "vision", "language"


# ---------------------------------------------------------------------------------------------------
# safetensors (no pickle)
# ---------------------------------------------------------------------------------------------------


def safetensors_files(folder: str | Path) -> list[Path]:
    """The *.safetensors files of a Hugging Face folder (or the file itself); ValueError if none."""
    p = Path(folder)
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"{p}: not a .safetensors file (pickle checkpoints are not read)")
        return [p]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        found = sorted(x.name for x in p.glob("*.bin")) + sorted(x.name for x in p.glob("*.pt"))
        raise ValueError(
            f"{p}: no *.safetensors file"
            + (
                f" (found {found}: pickle files are not read; save the model with safe_serialization=True)"
                if found
                else ""
            )
        )
    return files


def tensor_index(folder: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """(name -> shape, name -> file) from the safetensors headers only (no tensor is read)."""
    from safetensors import safe_open

    shapes, where = {}, {}
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name in where:
                    raise ValueError(f"tensor {name} is in both {where[name]} and {f}")
                shapes[name] = tuple(st.get_slice(name).get_shape())
                where[name] = f
    return shapes, where


class _Reader:
    """`reader(name)` -> the tensor, from the file the index names (files opened once)."""

    def __init__(self, where: dict[str, Path]) -> None:
        self.where, self.open = where, {}

    def __call__(self, name: str):
        from safetensors import safe_open

        f = self.where[name]
        if f not in self.open:
            self.open[f] = safe_open(str(f), framework="pt")
        return self.open[f].get_tensor(name)


# ---------------------------------------------------------------------------------------------------
# a world of one, for building the modules whole
# ---------------------------------------------------------------------------------------------------


def world_of_one_layout(encoders: list[str]):
    from megatron_hetero.layout import layout_from_dict

    doc = {
        "placement": "colocated",
        "modules": {**{e: {} for e in encoders}, LANGUAGE: {}},
        "edges": [f"{e} -> {LANGUAGE}" for e in encoders],
    }
    return layout_from_dict(doc, world_size=1)


@contextmanager
def world_of_one(layout) -> Iterator:
    """A gloo process group of one rank (a file store: no port) and the layout's Topology; if this
    process already belongs to a group, that one is used."""
    import torch.distributed as dist

    from megatron_hetero.compat import require_compat
    from megatron_hetero.runtime.topology import Topology

    require_compat("training.convert.world_of_one")
    tmp, own = None, not dist.is_initialized()
    if own:
        tmp = tempfile.mkdtemp(prefix="mh-convert-")
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1), rank=0, world_size=1)
    topo = Topology.build(layout, backend="gloo")
    try:
        yield topo
    finally:
        topo.destroy()
        if own:
            dist.destroy_process_group()
            shutil.rmtree(tmp, ignore_errors=True)


def build_whole(layout, spec, topo) -> dict[str, SimpleNamespace]:
    """Each module of `layout`, whole (TP1/PP1), as the `state` objects `checkpoint.save_load` takes."""
    from megatron_hetero.training.setup import build_module

    out = {}
    for m in layout.modules:
        pgs = topo.pg_collection(m.name)
        out[m.name] = SimpleNamespace(
            name=m.name, module=build_module(m.name, layout, spec, pgs).cpu(), pgs=pgs, optimizer=None
        )
    return out


def _load_whole(module, tensors: dict, where: str) -> None:
    own = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shaped = [k for k in own if k in tensors and tuple(own[k].shape) != tuple(tensors[k].shape)]
    if missing or unexpected or shaped:  # the name mapping and the module disagree: a bug, said plainly
        raise RuntimeError(
            f"{where}: mapping and module differ: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"shapes {[(k, list(own[k].shape), list(tensors[k].shape)) for k in shaped[:5]]}"
        )
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=False)


# ---------------------------------------------------------------------------------------------------
# hf -> checkpoint
# ---------------------------------------------------------------------------------------------------


def spec_from_hf(
    vision: str | Path,
    language: str | Path,
    seq_length: Optional[int] = None,
    seed: int = 1234,
    feature_layer: int = -1,
):
    """(LlavaSpec, vision config, language config) from the two config.json files; refuses what the
    family cannot express (ValueError / hf_config.UnsupportedModel). No weight is read.
    feature_layer: LLaVA's `vision_feature_layer` (Hugging Face's hidden_states index: -1 the last
    layer's output, -2 the one before (LLaVA-1.5), k >= 1 the output of layer k): the encoder keeps
    the layers up to it."""
    vcfg, lcfg = hf_config.read_config(vision), hf_config.read_config(language)
    spec = spec_from_configs(
        vcfg, lcfg, f"--vision {vision}", f"--language {language}", seq_length, seed, feature_layer
    )
    return spec, vcfg, lcfg


def spec_from_configs(
    vcfg: dict,
    lcfg: dict,
    vwhere: str,
    lwhere: str,
    seq_length: Optional[int] = None,
    seed: int = 1234,
    feature_layer: int = -1,
    last_hidden_state: bool = True,
):
    """The LlavaSpec of a vision and a language config.json (`spec_from_hf`). `last_hidden_state`:
    feature layer -1 of a SigLIP tower is its last_hidden_state (after the post LayerNorm: the
    two-folder form); False: hidden_states[-1], without it (what LlavaForConditionalGeneration reads)."""
    import dataclasses

    from megatron_hetero.models.llava import EncoderSpec, LlavaSpec

    enc = EncoderSpec(offset=1, **hf_config.encoder_fields(vcfg, vwhere))
    keep = feature_layer if feature_layer >= 0 else enc.num_layers + 1 + feature_layer
    if not 1 <= keep <= enc.num_layers:
        raise ValueError(
            f"--vision-feature-layer {feature_layer}: the tower has {enc.num_layers} layers "
            f"(valid: 1..{enc.num_layers} or -{enc.num_layers}..-1)"
        )
    enc = dataclasses.replace(enc, num_layers=keep)
    if enc.kind == "siglip":  # -1: last_hidden_state (post LayerNorm); any other layer: hidden_states[k]
        enc = dataclasses.replace(enc, post_norm=feature_layer == -1 and last_hidden_state)
    lm = hf_config.language_fields(lcfg, lwhere)
    if seq_length is None:
        seq_length = max(enc.tokens + 64, min(int(lcfg.get("max_position_embeddings", 2048)), 2048))
    if enc.offset + enc.tokens > seq_length:
        raise ValueError(
            f"--seq-length {seq_length} cannot hold the image's {enc.tokens} tokens after position {enc.offset}"
        )
    return LlavaSpec(**lm, seq_length=seq_length, encoders={VISION: enc}, seed=seed)


def hf_to_checkpoint(
    vision: str | Path,
    language: str | Path,
    out: str | Path,
    projector: Optional[str] = None,
    seq_length: Optional[int] = None,
    feature_layer: int = -1,
    hybrid_layer_pattern: Optional[str] = None,
    audio: Optional[str | Path] = None,
) -> dict:
    """Convert (module docstring); returns a summary {model, tensors per module, directory}.
    `hybrid_layer_pattern`: the language model as Megatron's HybridModel (`with_hybrid_pattern`);
    `audio`: a Whisper folder whose encoder becomes the `audio` module (`convert.hf_audio`)."""
    from megatron_hetero.models import hf_names

    # refusal happens here, before any weight is read
    spec, vcfg, lcfg = spec_from_hf(vision, language, seq_length, feature_layer=feature_layer)
    spec = with_hybrid_pattern(spec, hybrid_layer_pattern)
    configs = {VISION: vcfg, LANGUAGE: lcfg}
    asource = None
    if audio:
        configs[hf_audio.AUDIO] = acfg = hf_config.read_config(audio)
        spec = hf_audio.with_audio(spec, acfg, f"--audio {audio}", seq_length is not None)
        ashapes, awhere = tensor_index(audio)
        asource = Source(ashapes, _Reader(awhere), f"--audio {audio}")
    vshapes, vwhere = tensor_index(vision)
    lshapes, lwhere = tensor_index(language)
    psource = None
    if projector:  # LLaVA's names, with or without the `multi_modal_projector.` prefix
        pshapes, pfiles = tensor_index(projector)
        full = {n: n if n.startswith(hf_names.PROJECTOR_PREFIX) else hf_names.PROJECTOR_PREFIX + n for n in pshapes}
        pwhere = {full[n]: n for n in pshapes}  # LLaVA name -> the file's name
        read = _Reader(pfiles)
        psource = Source(
            {full[n]: s for n, s in pshapes.items()}, lambda k: read(pwhere[k]), f"--projector {projector}"
        )
    return convert_sources(
        spec,
        Source(vshapes, _Reader(vwhere), f"--vision {vision}"),
        Source(lshapes, _Reader(lwhere), f"--language {language}"),
        psource,
        out,
        origin={
            "vision": str(vision),
            "language": str(language),
            "projector": projector,
            **hf_audio.audio_origin(audio),
        },
        configs=configs,
        audio=asource,
    )


class Source(SimpleNamespace):
    """One part's Hugging Face tensors: `shapes` (name -> shape, from the headers), `read(name)` ->
    the tensor, `where` (the option and folder, for messages)."""

    def __init__(self, shapes: dict, read, where: str) -> None:
        super().__init__(shapes=shapes, read=read, where=where)


def convert_sources(
    spec,
    vision: Source,
    language: Source,
    projector: Optional[Source],
    out: str | Path,
    origin: dict,
    configs: dict,
    extra_files: Optional[dict[str, Path]] = None,
    audio: Optional[Source] = None,
) -> dict:
    """Check every part's names and shapes against `spec` (before any tensor is read), then read,
    fuse, load into the whole modules and write the checkpoint; `extra_files`: name under `hf/` ->
    a file copied there (a LLaVA folder's processor and tokenizer files); `audio`: a Whisper
    folder's tensors for the `audio` encoder of `spec` (`convert.hf_audio`)."""
    from megatron_hetero.models import hf_names

    aprefix = hf_audio.check_audio(audio, spec.encoders[hf_audio.AUDIO]) if audio is not None else None

    enc = spec.encoders[VISION]
    hf_names.check_tensors(
        vision.shapes,
        hf_names.expected_vision(enc),
        vision.where,
        lambda n: hf_names.ignorable_vision(n, enc.num_layers),
    )
    hf_names.check_tensors(
        language.shapes,
        hf_names.expected_language(gpt_view(spec)),
        language.where,
        lambda n: hf_names.ignorable_language(n, gpt_view(spec)),
    )
    if projector is not None:
        hf_names.check_tensors(
            projector.shapes, hf_names.expected_projector(enc.hidden_size, spec.hidden_size), projector.where
        )
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out}: exists and is not empty")
    vision_t = hf_names.vision_to_ours(vision.read, enc)
    language_t = to_hybrid_names(hf_names.language_to_ours(language.read, gpt_view(spec)), spec)
    if projector is not None:
        vision_t.update(hf_names.projector_to_ours(projector.read))
    encoders = [VISION] + ([hf_audio.AUDIO] if audio is not None else [])
    layout = world_of_one_layout(encoders)
    with world_of_one(layout) as topo:
        states = build_whole(layout, spec, topo)
        if audio is not None:
            amod = states[hf_audio.AUDIO].module
            audio_t = hf_audio.audio_to_ours(audio, spec.encoders[hf_audio.AUDIO], aprefix)
            audio_t.update({k: v for k, v in amod.state_dict().items() if k.startswith("projector.")})
            _load_whole(amod, {k: v for k, v in audio_t.items() if not k.endswith("_extra_state")}, audio.where)
        if projector is None:  # the family's own initialisation of the projector
            vision_t.update(
                {
                    k: v
                    for k, v in states[VISION].module.state_dict().items()
                    if k.startswith("projector.") and not k.endswith("_extra_state")
                }
            )
        _load_whole(states[VISION].module, vision_t, vision.where)
        _load_whole(states[LANGUAGE].module, language_t, language.where)
        d = write_checkpoint(out, layout, spec, states, origin=origin, configs=configs, extra_files=extra_files)
    return {
        "directory": str(d),
        "model": spec,
        "tensors": {
            VISION: len(vision_t),
            LANGUAGE: len(language_t),
            **({hf_audio.AUDIO: len(audio_t)} if audio else {}),
        },
        "projector": "converted" if projector is not None else "initialised",
    }


def with_hybrid_pattern(spec, pattern: Optional[str]):
    """The converted model as Megatron's HybridModel (`--hybrid-layer-pattern`): only `*-` pairs, one
    per Hugging Face layer (pipes between pairs), express a Llama/Qwen2 model; ValueError otherwise."""
    import dataclasses

    if pattern is None:
        return spec
    if not is_gpt_pairs(pattern) or len(pattern_layers(pattern)) != 2 * spec.num_layers:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: a converted model of {spec.num_layers} layers is "
            f"{'*-' * spec.num_layers!r} (one attention and one MLP layer per Hugging Face layer), '|' between pairs"
        )
    if spec.rope_scaling:
        raise ValueError("--hybrid-layer-pattern: Megatron-core 0.19's HybridModel has no llama3 rope scaling")
    return dataclasses.replace(spec, hybrid_layer_pattern=pattern, num_layers=2 * spec.num_layers)


def gpt_view(spec):
    """The GPT model a HybridModel of `*-` pairs computes (the names Hugging Face's map to); `spec`
    itself for the GPT path."""
    import dataclasses

    if spec.hybrid_layer_pattern is None:
        return spec
    return dataclasses.replace(spec, hybrid_layer_pattern=None, num_layers=spec.num_layers // 2)


def to_hybrid_names(tensors: dict, spec) -> dict:
    """GPT language-module names -> the HybridModel's (`models.hybrid_lm.gpt_to_hybrid_name`)."""

    if spec.hybrid_layer_pattern is None:
        return tensors
    return {gpt_to_hybrid_name(k): v for k, v in tensors.items()}


def from_hybrid_names(tensors: dict, spec) -> dict:
    if spec.hybrid_layer_pattern is None:
        return tensors
    return {hybrid_to_gpt_name(k): v for k, v in tensors.items()}


def write_checkpoint(
    root: Path, layout, spec, states: dict, origin: dict, configs: dict, extra_files: Optional[dict] = None
) -> Path:
    """Iteration 0 of a weights-only checkpoint under `root` (world of one), written the way
    `train --save` writes: into a staging folder, sealed (`write_train_state`: manifest and its own
    checksum), then renamed into place and the marker written (`publish`). `configs`: name ->
    config.json kept under hf/NAME/; `extra_files`: relative path under hf/ -> a file copied there."""
    from megatron.core import dist_checkpointing

    from megatron_hetero.layout.yaml_io import dump_layout
    from megatron_hetero.checkpoint import save_load as ckpt
    from megatron_hetero.checkpoint.keys import logical_models
    from megatron_hetero.checkpoint.sharded import model_sharded_state_dict

    ckpt._writer_results_in_process()
    d = stage_dir(root, 0)
    d.mkdir(parents=True)
    logical = logical_models(layout)
    for name in sorted(logical):
        sd = {}
        for mod in logical[name]:
            sd.update({f"{mod}.model.{k}": v for k, v in model_sharded_state_dict(states[mod], layout, spec).items()})
        (d / name).mkdir()
        dist_checkpointing.save(sd, str(d / name))
    for name, cfg in configs.items():
        (d / HF_DIR / name).mkdir(parents=True)
        (d / HF_DIR / name / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for rel, src in (extra_files or {}).items():
        (d / HF_DIR / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, d / HF_DIR / rel)
    text = dump_layout(layout)
    (d / LAYOUT_FILE).write_text(text)
    models = {
        name: {
            "layout_modules": mods,
            "frozen": {},
            "optimizer": None,
            "common_steps": {},
            "scheduler": None,
            "scheduler_config": None,
        }
        for name, mods in logical.items()
    }
    state = {
        "format": FORMAT,
        "iteration": 0,
        "origin": ORIGIN,
        "converted_from": origin,
        "consumed_samples": 0,
        "data": {"kind": None, "next_sample": 0, "iteration": 0},
        "global_batch_size": None,
        "world_size": 1,
        "layout": text,
        "layout_dict": layout.to_dict(),
        "model": spec_record(spec),
        "modules": models,
    }
    return publish(root, 0, d, write_train_state(d, state))
