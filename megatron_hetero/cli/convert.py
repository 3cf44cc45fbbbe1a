"""`megatron-hetero convert`: start from pretrained Hugging Face weights, and write them back.

    megatron-hetero convert hf-to-checkpoint --vision HF_DIR --language HF_DIR [--projector FILE.safetensors]
                                             [--seq-length N] [--vision-feature-layer K] --out DIR
    megatron-hetero convert hf-to-checkpoint --model HF_DIR [--seq-length N] [--image-size HxW] --out DIR
    megatron-hetero convert checkpoint-to-hf DIR --out OUT [--model [--like HF_DIR]]

hf-to-checkpoint: a CLIP or SigLIP vision tower (`CLIPVisionModel` / `SiglipVisionModel`, or a full
`CLIPModel` / `SiglipModel` whose vision tower is taken) and a Llama (3.1+ rope scaling included)
or Qwen2/Qwen2.5 causal LM, each a folder with config.json and *.safetensors, become
a checkpoint `train --load DIR` starts from under any layout, without repeating model flags (the
checkpoint records the model). --projector: LLaVA's `multi_modal_projector` weights (else the
projector starts from the family's initialisation, as LLaVA stage 1 trains it). --seq-length: the
training sequence length recorded with the model (default: the LM's max_position_embeddings, at
most 2048, at least the image tokens + 64). --vision-feature-layer: LLaVA's vision_feature_layer
(-1: the last layer's output, for SigLIP its last_hidden_state after the post LayerNorm; another
layer k: Hugging Face's hidden_states[k]; LLaVA-1.5 takes -2): the tower is cut after that layer (the layers
after it are not converted, so they do not come back from checkpoint-to-hf). A model the family cannot express is refused with the
reason before any weight is read; a missing, unexpected or mis-shaped tensor is named with both
shapes; both exit 2. Pickle files (*.bin, *.pt) are never read.

hf-to-checkpoint --model: one `LlavaForConditionalGeneration` folder (vision tower, LLaVA's
projector and a Llama/Qwen2 language model under one config.json; `convert.hf_llava`): its
vision_feature_layer and vision_feature_select_strategy are honoured (CLIP: "default", SigLIP:
"full"; the other pairings are refused), its image token id, processor and tokenizer files (chat
template included) are kept in the checkpoint.

hf-to-checkpoint --model of a `Qwen2_5_VLForConditionalGeneration` folder (config.json model_type
`qwen2_5_vl`; `convert.hf_qwen_checkpoint`): the Qwen2.5-VL tower (encoder kind qwen2.5-vl) and
the Qwen2.5 decoder with M-RoPE, trained at one fixed image size (--image-size HxW pixels, default
448x448, multiples of patch * merge); checkpoint-to-hf --model of such a checkpoint writes the
folder back (bit-identical tensors).

checkpoint-to-hf: the latest checkpoint under DIR (converted, or saved by `train --save` after
training) becomes OUT/vision and OUT/language (config.json + model.safetensors, loadable with
`CLIPVisionModel.from_pretrained` / `AutoModelForCausalLM.from_pretrained`) and
OUT/projector/model.safetensors (LLaVA's names). With --model: one LLaVA folder OUT (config.json,
model.safetensors, the processor files) that `LlavaForConditionalGeneration.from_pretrained` loads;
--like HF_DIR takes the LLaVA config (image token id, ...) and processor files from the folder the
weights came from (a checkpoint `train --save` wrote keeps no copy of them).

Runs in this process as a world of one (gloo, file store: no port), builds the modules whole.
"""

from __future__ import annotations

import argparse
from megatron_hetero.convert import hf_llava, hf_qwen_checkpoint as qwen, hf_weights as convert
from megatron_hetero.convert.hf_export import checkpoint_to_hf

NAME = "convert"
USES_MEGATRON = True  # run_command applies megatron_hetero.compat first


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="Hugging Face weights <-> checkpoints (start from a pretrained CLIP + LLM)")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = actions.add_parser(
        "hf-to-checkpoint", help="CLIP vision tower + Llama/Qwen2 LM -> a checkpoint for train --load"
    )
    a.add_argument(
        "--model",
        default=None,
        metavar="HF_DIR",
        help="a whole LlavaForConditionalGeneration folder (instead of --vision and --language)",
    )
    a.add_argument(
        "--vision",
        default=None,
        metavar="HF_DIR",
        help="CLIPVisionModel, CLIPModel, SiglipVisionModel or SiglipModel folder",
    )
    a.add_argument("--language", default=None, metavar="HF_DIR", help="LlamaForCausalLM or Qwen2ForCausalLM folder")
    a.add_argument(
        "--audio",
        default=None,
        metavar="HF_DIR",
        help="WhisperModel or WhisperForConditionalGeneration folder: its encoder becomes the `audio` module (optional)",
    )
    a.add_argument(
        "--projector", default=None, metavar="FILE", help="LLaVA multi_modal_projector safetensors (optional)"
    )
    a.add_argument("--seq-length", type=int, default=None, help="training sequence length recorded with the model")
    a.add_argument(
        "--vision-feature-layer",
        type=int,
        default=-1,
        help="LLaVA's vision_feature_layer: -1 the last layer's output (default), -2 the one before "
        "(LLaVA-1.5); the tower keeps the layers up to it",
    )
    a.add_argument(
        "--hybrid-layer-pattern",
        default=None,
        metavar="PATTERN",
        help="build the language model as Megatron's HybridModel: '*-' per layer, '|' between pairs for pipeline stages",
    )
    a.add_argument(
        "--image-size",
        default=None,
        metavar="HxW",
        help="with a Qwen2.5-VL --model: the fixed image size training uses, in pixels (default 448x448)",
    )
    a.add_argument("--out", required=True, metavar="DIR", help="the checkpoint directory (new or empty)")
    b = actions.add_parser("checkpoint-to-hf", help="a checkpoint -> Hugging Face folders OUT/vision, OUT/language")
    b.add_argument("dir", help="a checkpoint directory (--save or convert --out)")
    b.add_argument("--out", required=True, metavar="OUT", help="output folder (new or empty)")
    b.add_argument(
        "--model", action="store_true", help="write one LlavaForConditionalGeneration folder instead of three parts"
    )
    b.add_argument(
        "--like",
        default=None,
        metavar="HF_DIR",
        help="with --model: the LLaVA folder whose config (image token id, ...) and processor files to carry",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.training.job import quiet_upstream_warnings

    quiet_upstream_warnings()

    if args.action == "hf-to-checkpoint":
        if args.seq_length is not None and args.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {args.seq_length}")
        if args.model is not None:
            if args.vision or args.language or args.projector or args.audio or args.vision_feature_layer != -1:
                raise ValueError(
                    "--model takes a whole LLaVA folder: --vision, --language, --projector and "
                    "--vision-feature-layer come from it (its config.json's vision_feature_layer)"
                )

            if qwen.is_qwen_vl(args.model):
                return _qwen_to_checkpoint(args)
            if args.image_size is not None:
                raise ValueError("--image-size goes with a Qwen2.5-VL --model folder")

            summary = hf_llava.llava_to_checkpoint(
                args.model, args.out, seq_length=args.seq_length, hybrid_layer_pattern=args.hybrid_layer_pattern
            )
        elif args.image_size is not None:
            raise ValueError("--image-size goes with a Qwen2.5-VL --model folder")
        elif not (args.vision and args.language):
            raise ValueError("give --model HF_DIR (a LLaVA folder) or both --vision HF_DIR and --language HF_DIR")
        else:
            summary = convert.hf_to_checkpoint(
                args.vision,
                args.language,
                args.out,
                projector=args.projector,
                seq_length=args.seq_length,
                feature_layer=args.vision_feature_layer,
                hybrid_layer_pattern=args.hybrid_layer_pattern,
                audio=args.audio,
            )
        spec = summary["model"]
        enc = spec.encoders[convert.VISION]
        print(f"checkpoint {summary['directory']} (iteration 0, weights only)")
        print(
            f"vision: {enc.kind.upper()} ViT {enc.num_layers} layers, hidden {enc.hidden_size}, {enc.num_attention_heads} heads, "
            f"patch {enc.patch_size}, {enc.tokens} image tokens, {enc.activation}; "
            f"{summary['tensors']['vision']} tensors (projector {summary['projector']})"
        )
        print(
            f"language: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads, "
            f"{spec.num_query_groups or spec.num_attention_heads} query groups, vocab {spec.vocab_size}, rope base "
            f"{spec.rotary_base:g}{f' (llama3 scaling x{spec.rope_scaling_factor:g})' if spec.rope_scaling else ''}, qkv bias {'on' if spec.add_qkv_bias else 'off'}, embeddings "
            f"{'untied' if spec.untie_embeddings_and_output_weights else 'tied'}; "
            f"{summary['tensors']['language']} tensors; seq length {spec.seq_length}"
        )
        audio = spec.encoders.get("audio")
        if audio is not None and audio.kind == "whisper":
            print(
                f"audio: Whisper encoder {audio.num_layers} layers, hidden {audio.hidden_size}, "
                f"{audio.num_attention_heads} heads, {audio.feature_dim // 2} mel bins, up to {audio.tokens} speech "
                f"tokens; {summary['tensors']['audio']} tensors (projector initialised)"
            )
        if "image_token_index" in summary:
            print(
                f"image token id {summary['image_token_index']} (the LLaVA config and processor files kept under hf/llava)"
            )
        print(
            f"train from it: megatron-hetero train --hetero-layout LAYOUT.yaml --load {args.out} "
            f"(no model flags: the checkpoint records the model)"
        )
        return 0

    if qwen.is_qwen_checkpoint(args.dir):
        if not args.model:
            raise ValueError("a Qwen2.5-VL checkpoint is written as one folder: give --model")
        print(f"qwen2.5-vl: {qwen.checkpoint_to_qwen(args.dir, args.out, like=args.like)}")
        return 0
    if args.model:
        print(f"llava: {hf_llava.checkpoint_to_llava(args.dir, args.out, like=args.like)}")
        return 0
    if args.like is not None:
        raise ValueError("--like goes with --model (one LLaVA folder)")

    written = checkpoint_to_hf(args.dir, args.out)
    for name, folder in written.items():
        print(f"{name}: {folder}")
    return 0


def _qwen_to_checkpoint(args: argparse.Namespace) -> int:
    """`hf-to-checkpoint --model` of a Qwen2.5-VL folder (`convert.hf_qwen_checkpoint`)."""

    if args.hybrid_layer_pattern is not None:
        raise ValueError("--hybrid-layer-pattern: a Qwen2.5-VL language model is a GPT decoder with M-RoPE")
    size = qwen.parse_image_size(args.image_size or "448x448")
    summary = qwen.qwen_to_checkpoint(args.model, args.out, size, seq_length=args.seq_length)
    spec = summary["model"]
    enc = spec.encoders["vision"]
    print(f"checkpoint {summary['directory']} (iteration 0, weights only)")
    print(
        f"vision: Qwen2.5-VL tower {enc.num_layers} blocks, hidden {enc.hidden_size}, {enc.num_attention_heads} heads, "
        f"patch {enc.patch_size}, full attention in {list(enc.fullatt_block_indexes)}; images {size[0]}x{size[1]}: "
        f"{enc.tokens} tokens ({enc.image_rows} rows); {summary['tensors']['vision']} tensors"
    )
    print(
        f"language: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads, "
        f"{spec.num_query_groups} query groups, vocab {spec.vocab_size}, M-RoPE sections {list(spec.mrope_section)} "
        f"base {spec.rotary_base:g}; {summary['tensors']['language']} tensors; seq length {spec.seq_length}"
    )
    print(f"image token id {summary['image_token_id']} (the config and processor files kept under hf/qwen2_5_vl)")
    print(
        f"train from it: megatron-hetero train --hetero-layout LAYOUT.yaml --load {args.out} "
        f"(no model flags: the checkpoint records the model)"
    )
    return 0
