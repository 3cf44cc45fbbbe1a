"""The chat template conversation training uses when the tokenizer brings none: ChatML.

ChatML is the turn format of Qwen2 (and Qwen2-VL, InternVL, many others): every message is

    <|im_start|>ROLE\\nCONTENT<|im_end|>\\n

and a generation prompt is `<|im_start|>assistant\\n`. The template below is written for this package
(it is not a copy of any model's file) and differs from Qwen2's own in two ways: it adds no default
system turn when the conversation has none (Qwen2 inserts "You are a helpful assistant."), and it
marks each assistant turn's content and its closing `<|im_end|>` with `{% generation %}` tags, so
`ChatTemplate.assistant_spans` finds the loss spans without rendering prefixes. The trailing "\\n"
after `<|im_end|>` is outside the generation block: the model never has to generate it.

`chat_template_for(tokenizer_model)`: the chat template of a `--tokenizer-model` tokenizer.json whose
folder has one (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`:
`chat_template.load_chat_template`), else `default_chat_template()`. A tokenizer without the ChatML
markers (the shipped digits tokenizer, `data.tokenizer`) is given both as added special tokens
(`ChatTemplate.markers`, `chat_tokens.marker_tokenizer`), as ChatML tokenizers have them: one token
each instead of about 8 bytes, so a digits conversation takes about half the sequence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megatron_hetero.data.chat_template import ChatTemplate, load_chat_template

START_OF_TURN, END_OF_TURN = "<|im_start|>", "<|im_end|>"

#: ChatML, with the assistant's part in {% generation %} blocks (module docstring)
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}\n"
    "{%- else %}\n"
    "{{- message['content'] + '<|im_end|>' }}\n"
    "{%- endif %}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def default_chat_template() -> ChatTemplate:
    """The shipped ChatML template (module docstring); its `eos_token` is the end-of-turn marker."""
    return ChatTemplate(
        CHATML_TEMPLATE,
        {"eos_token": END_OF_TURN},
        name="ChatML (megatron-hetero default)",
        markers=(START_OF_TURN, END_OF_TURN),
    )


def chat_template_for(tokenizer_model: Optional[str]) -> ChatTemplate:
    """The tokenizer's own chat template when its folder has one, else `default_chat_template()`.
    ValueError when the folder's template is there but broken (it is never silently replaced)."""
    if tokenizer_model:
        folder = Path(tokenizer_model).parent
        cfg = folder / "tokenizer_config.json"
        has = (folder / "chat_template.jinja").is_file()
        if cfg.is_file() and not has:
            try:
                has = "chat_template" in json.loads(cfg.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{cfg}: not JSON ({exc})") from None
        if has and cfg.is_file():
            return load_chat_template(cfg)
    return default_chat_template()
