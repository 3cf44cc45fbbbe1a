"""Chat templates without transformers (`data/chat_template.py`, `data/chat_tokens.py`), compared with
transformers' `apply_chat_template(tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`.

Three template styles written here (ChatML/Qwen2, Llama-3 headers, Mistral `[INST]` with
`raise_exception`), each with `{% generation %}` blocks so transformers can give its assistant mask, and
each also stripped of the tags, so our prefix-rendering method is compared with the same mask. A tiny
byte-level BPE with the templates' special tokens is trained here and saved as a Hugging Face
tokenizer folder (tokenizer.json + tokenizer_config.json); nothing is downloaded.
"""

from __future__ import annotations

import json
import re

import pytest

from megatron_hetero.data.chat_template import ChatTemplate, TemplateRaised, load_chat_template, normalize_messages
from megatron_hetero.data.chat_tokens import tokenize_conversation, train_sample
from megatron_hetero.data.samples import PLACEHOLDER_ID
from megatron_hetero.data.tokenizer import load_tokenizer

SPECIALS = [
    "<pad>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "<image>",
]

CHATML = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}\n"
    "{%- else %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = none %}"
    "{%- set loop_messages = messages %}{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}\n"
    "{%- if message['role'] == 'user' %}\n"
    "{%- if loop.first and system is not none %}{{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}\n"
    "{%- else %}\n"
    "{% generation %}{{- ' ' + message['content'] + eos_token }}{% endgeneration %}\n"
    "{%- endif %}\n"
    "{%- if loop.index0 > 50 %}{% break %}{% endif %}\n"
    "{%- endfor %}\n"
)

STYLES = {
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<pad>"}),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}),
}


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def S(text: str) -> dict:
    return {"role": "system", "content": text}


# (messages, image token counts); every one alternates user/assistant after an optional system turn
CONVERSATIONS = [
    ([U("What is three plus four?"), A("seven")], []),
    ([U("<image>\nWhat digit is this?"), A("seven")], [4]),
    ([S("You answer in words."), U("<image>\nWhat digit is this?"), A("It is a seven.")], [16]),
    (
        [
            U("<image>\nWhat digit is this?"),
            A("two"),
            U("What is it plus three?"),
            A("five"),
            U("Odd or even?"),
            A("odd"),
        ],
        [4],
    ),
    ([U("<image><image>\nWhat is the sum of the two digits?"), A("eleven (11)")], [4, 16]),
    ([U("Look: <image>"), A("a four"), U("And now <image> and <image>?"), A("a one and a nine")], [16, 4, 4]),
    ([S("Be brief."), U("Zähle: 数字 7 😀"), A("  sieben \n"), U("again"), A("7 😀")], []),
    ([U("<image>What digit?"), A(""), U("Please answer."), A("nine")], [1]),
]


def _strip_generation(t: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", t)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One Hugging Face tokenizer folder per style (the same trained tokenizer.json in each)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for conv, _ in CONVERSATIONS for m in conv] + ["system user assistant INST helpful"] * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = {}
    for style, (template, specials) in STYLES.items():
        for tagged in (True, False):
            d = tmp_path_factory.mktemp(f"{style}-{'gen' if tagged else 'plain'}")
            tok.save(str(d / "tokenizer.json"))
            cfg = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": template if tagged else _strip_generation(template),
                "model_max_length": 4096,
                **{k: _added(v) if k == "eos_token" else v for k, v in specials.items()},  # both forms
            }
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
            out[style, tagged] = d
    return out


def _added(content: str) -> dict:
    """A special token as tokenizer_config.json stores an AddedToken."""
    flags = dict(lstrip=False, rstrip=False, normalized=False, single_word=False, special=True)
    return {"__type": "AddedToken", "content": content, **flags}


def _expand(conv, image_tokens):
    """transformers' input: each <image> repeated by its image's token count (as LLaVA processors do)."""
    counts = iter(image_tokens)
    return [{**m, "content": re.sub("<image>", lambda _: "<image>" * next(counts), m["content"])} for m in conv]


def test_same_ids_and_masks_as_transformers(folders):
    """Every conversation x style x span method: our ids and mask equal transformers'."""
    transformers = pytest.importorskip("transformers")
    compared = 0
    hf_of = {k: transformers.AutoTokenizer.from_pretrained(str(f)) for k, f in folders.items()}
    for (style, tagged), folder in folders.items():
        hf, hf_tagged = hf_of[style, tagged], hf_of[style, True]
        tok = load_tokenizer(str(folder / "tokenizer.json"))
        template = load_chat_template(folder)
        image_id = tok.tokenizer.token_to_id("<image>")
        for conv, images in CONVERSATIONS:
            ours = tokenize_conversation(conv, images, tok, template)
            assert ours.method == ("generation" if tagged else "prefix")
            ref = hf_tagged.apply_chat_template(
                _expand(conv, images), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            assert template.render(normalize_messages(conv)) == hf.apply_chat_template(conv, tokenize=False)
            assert ours.ids == list(ref["input_ids"]), (style, tagged, conv)
            assert ours.mask == list(ref["assistant_masks"]), (style, tagged, conv)
            assert [ours.ids[s : s + n] for s, n in ours.image_spans] == [[image_id] * n for n in images]
            assert sum(ours.mask) > 0
            compared += 1
    assert compared == len(CONVERSATIONS) * len(STYLES) * 2
    print(f"{compared} conversations: token ids and masks identical to transformers")


def test_generation_prompt_matches_transformers(folders):
    transformers = pytest.importorskip("transformers")
    for style in ("chatml", "llama3"):
        folder = folders[style, False]
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
        tok, template = load_tokenizer(str(folder / "tokenizer.json")), load_chat_template(folder)
        conv = [U("<image>\nWhat digit is this?"), A("two"), U("And plus one?")]
        ours = tokenize_conversation(conv, [4], tok, template, add_generation_prompt=True)
        ref = hf.apply_chat_template(_expand(conv, [4]), tokenize=True, add_generation_prompt=True, return_dict=True)
        assert ours.ids == list(ref["input_ids"])
        assert ours.text.endswith("assistant\n" if style == "chatml" else "<|end_header_id|>\n\n")


def test_mask_covers_the_answer_and_end_of_turn_only(folders):
    folder = folders["chatml", False]
    tok, template = load_tokenizer(str(folder / "tokenizer.json")), load_chat_template(folder)
    ct = tokenize_conversation([U("<image> digit?"), A("seven"), U("plus one?"), A("eight")], [4], tok, template)
    masked = [t for t, m in zip(ct.ids, ct.mask) if m]
    assert tok.tokenizer.decode(masked, skip_special_tokens=False) == "seven<|im_end|>eight<|im_end|>"
    assert [ct.text[a:b] for a, b in ct.char_spans] == ["seven<|im_end|>", "eight<|im_end|>"]
    s = train_sample(ct, seq_length=64, pad_id=tok.pad_id)
    assert s["tokens"].shape == s["labels"].shape == s["loss_mask"].shape == (64,)
    assert s["loss_mask"].sum() == sum(ct.mask) and not (s["loss_mask"].bool() & s["image_mask"]).any()
    assert int(s["image_mask"].sum()) == 4
    assert (s["labels"][s["loss_mask"].bool()] == torch_tensor(masked)).all()
    start = ct.image_spans[0][0]
    short = train_sample(ct, seq_length=start + 2, pad_id=tok.pad_id)  # cuts the image: dropped whole
    assert not short["image_mask"].any() and (short["tokens"][start:] == tok.pad_id).all()
    whole = train_sample(ct, seq_length=start + 4, pad_id=tok.pad_id)
    assert int(whole["image_mask"].sum()) == 4 and whole["tokens"].shape == (start + 4,)


def torch_tensor(x):
    import torch

    return torch.tensor(x)


def test_placeholder_without_image_token_in_the_tokenizer():
    """The shipped tokenizer has <image> = PLACEHOLDER_ID; a tokenizer without <image> is given one."""
    from megatron_hetero.data.tokenizer import CaptionTokenizer, train_caption_bpe
    from tokenizers import Tokenizer

    shipped = load_tokenizer()
    t = ChatTemplate(_strip_generation(CHATML), {"eos_token": "<|im_end|>"})
    ct = tokenize_conversation([U("<image> what?"), A("a handwritten seven")], [3], shipped, t)
    assert ct.ids[ct.image_spans[0][0] :][:3] == [PLACEHOLDER_ID] * 3
    plain = Tokenizer.from_str(train_caption_bpe(["a handwritten seven"]).to_str())
    plain_tok = CaptionTokenizer(plain, bos_id=2, eos_id=3, pad_id=1, name="plain")
    ct2 = tokenize_conversation([U("x <image> y"), A("seven")], [5], plain_tok, t)
    assert ct2.image_spans[0][1] == 5 and "<image>" in ct2.text


@pytest.mark.parametrize(
    "conv, images, match",
    [
        ([{"role": "robot", "content": "hi"}, A("x")], [], "unknown role 'robot'"),
        ([U("<image> and <image>"), A("x")], [4], "2 <image> marker.s. but 1 image"),
        ([U("hi"), A("x")], [4], "0 <image> marker.s. but 1 image"),
        ([U("hi"), A("<image>")], [4], "images belong in user turns"),
        ([U("<image>"), A("x")], [0], "token count must be >= 1"),
        ([], [], "empty conversation"),
        ([{"role": "user", "content": ["x"]}], [], "content must be a string"),
    ],
)
def test_bad_conversations_are_value_errors(conv, images, match):
    tok = load_tokenizer()
    t = ChatTemplate(CHATML, {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match=match):
        tokenize_conversation(conv, images, tok, t)


def test_template_errors_are_value_errors(tmp_path):
    tok = load_tokenizer()
    mistral = ChatTemplate(MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"}, "mistral")
    with pytest.raises(TemplateRaised, match="roles must alternate"):
        tokenize_conversation([U("a"), U("b"), A("c")], [], tok, mistral)
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        ChatTemplate("{% for %}").render([U("a")])
    with pytest.raises(ValueError, match="no chat_template"):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
        load_chat_template(tmp_path)
    with pytest.raises(ValueError, match="uses eos_token but the config defines none"):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": MISTRAL, "bos_token": "<s>"}))
        load_chat_template(tmp_path)
    # a template that renders earlier turns differently once later turns exist: prefix method refused
    unstable = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if loop.last else '...' }}\n{% endfor %}",
        {},
        "unstable",
    )
    with pytest.raises(ValueError, match="cannot find assistant turn 1"):
        tokenize_conversation([U("a"), A("b"), U("c")], [], tok, unstable)


def test_llava_roles_and_template_list():
    msgs = normalize_messages([{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "yo"}])
    assert msgs == [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "yo"}]
    from megatron_hetero.data.chat_template import template_from_config

    t = template_from_config(
        {
            "chat_template": [
                {"name": "tool_use", "template": "x"},
                {"name": "default", "template": "{{ bos_token }}y"},
            ],
            "bos_token": {"content": "<s>"},
        }
    )
    assert t.render(msgs) == "<s>y"
