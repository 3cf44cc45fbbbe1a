"""Render a conversation with a Hugging Face chat template, as `transformers` renders it, without transformers.

A Hugging Face tokenizer folder carries its chat template in `tokenizer_config.json` (`chat_template`:
a Jinja string, or a list of `{name, template}` of which `default` is used) or in a `chat_template.jinja`
file beside it, and its special tokens (`bos_token`, `eos_token`, ...; a string or an AddedToken dict
`{"content": ...}`). `load_chat_template(PATH)` reads them; `ChatTemplate.render(messages)` renders
a list of `{role, content}` messages the way `transformers`' `apply_chat_template` does:

  * a Jinja2 sandboxed (immutable) environment with `trim_blocks` and `lstrip_blocks`, the
    `loopcontrols` extension (`{% break %}`, `{% continue %}`);
  * template variables `messages`, `add_generation_prompt`, every special token of the config by its
    name (`bos_token`, `eos_token`, `pad_token`, `unk_token`, ...), plus any keyword given to `render`;
  * globals `raise_exception(message)` (its message becomes a ValueError here) and
    `strftime_now(format)`, and a `tojson` filter that does not HTML-escape
    (`json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...)`);
  * the `{% generation %} ... {% endgeneration %}` block tag, which marks the text a model generates
    (the assistant's part).

Assistant spans (`ChatTemplate.assistant_spans`): the character ranges of the rendered text that
belong to assistant turns, found one of two ways (`method`):

  * `"generation"` (a template with `{% generation %}` tags): each generation block's output is the
    span. While rendering, the block wraps its output in two private-use characters (U+E000, U+E001)
    that are then removed and their positions recorded; a conversation containing either character is
    refused.
  * `"prefix"` (any other template): for the assistant message at index i, render messages[:i] with
    `add_generation_prompt=True` (text P) and messages[:i+1] without (text Q); the span is
    [len(P), len(Q.rstrip())): the assistant's content and whatever the template closes the turn
    with (the end-of-turn token), without the whitespace the template puts after it (ChatML's "\\n"
    after `<|im_end|>`, which the model never has to generate). P must be a prefix of Q and Q a prefix
    of the whole conversation's text; a template for which that does not hold (one that renders an
    earlier turn differently once later turns exist) is refused with a ValueError naming the turn.

Used by `data.chat_tokens` (conversation -> token ids + loss mask).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

ROLES = ("system", "user", "assistant")
#: LLaVA-style `{"from": ..., "value": ...}` role names and their chat-template role
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant"}
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
GEN_OPEN, GEN_CLOSE = "\ue000", "\ue001"  # private-use characters marking a generation block's output
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateRaised(ValueError):
    """The chat template called `raise_exception(message)` (e.g. roles that do not alternate)."""


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token {value!r}: expected a string or an AddedToken dict with 'content'")


def normalize_messages(conversation: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """`conversation` as a list of `{"role": R, "content": TEXT}` with R in system/user/assistant.

    Accepts `{role, content}` messages and LLaVA's `{from, value}` (from: human/gpt/system). ValueError
    for an empty conversation, an unknown role, or content that is not a string."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
        raise ValueError(f"a conversation is a list of messages, got {type(conversation).__name__}")
    if not conversation:
        raise ValueError("empty conversation: at least one message is needed")
    out = []
    for i, m in enumerate(conversation):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i}: expected a mapping with role and content, got {type(m).__name__}")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if not isinstance(role, str):
            raise ValueError(f"message {i}: no role (give 'role' or LLaVA's 'from')")
        role = ROLE_ALIASES.get(role.lower(), role.lower())
        if role not in ROLES:
            raise ValueError(
                f"message {i}: unknown role {m.get('role', m.get('from'))!r} "
                f"(known: {', '.join(ROLES)}; LLaVA's {', '.join(ROLE_ALIASES)})"
            )
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _environment(track_generation: bool):
    """A Jinja2 environment configured as described in the module docstring."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}BODY{% endgeneration %}`: BODY's output, between markers when tracking."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            text = caller()
            return f"{GEN_OPEN}{text}{GEN_CLOSE}" if track_generation else text

    def raise_exception(message: Any = "") -> None:
        raise TemplateRaised(str(message))

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template (Jinja source) and the special tokens it may refer to (`bos_token`, ...)."""

    source: str
    special_tokens: Mapping[str, Any] = field(default_factory=dict)
    name: str = "chat_template"
    # turn markers the template writes that a tokenizer lacking them is given as added special tokens
    # (`chat_tokens.marker_tokenizer`), so each is one token (the shipped ChatML's with the digits tokenizer)
    markers: tuple[str, ...] = ()

    @property
    def has_generation_tags(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    @property
    def bos_token(self) -> Optional[str]:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> Optional[str]:
        return self.special_tokens.get("eos_token")

    @cached_property
    def _compiled(self):
        return self._compile(False)

    @cached_property
    def _compiled_tracking(self):
        return self._compile(True)

    def _compile(self, track: bool):
        import jinja2

        try:
            return _environment(track).from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"{self.name}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None

    def _render(self, template, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, extra) -> str:
        import jinja2

        variables = {**self.special_tokens, **extra}
        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
        except TemplateRaised as exc:
            raise TemplateRaised(f"{self.name} refused the conversation: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ValueError(f"{self.name}: rendering failed ({type(exc).__name__}: {exc})") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **extra) -> str:
        """The text `transformers`' `apply_chat_template(messages, tokenize=False)` gives."""
        return self._render(self._compiled, messages, add_generation_prompt, extra)

    def generation_spans(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **extra
    ) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, [start, end) character ranges of the `{% generation %}` blocks' output)."""
        for i, m in enumerate(messages):
            c = m.get("content")
            if isinstance(c, str) and (GEN_OPEN in c or GEN_CLOSE in c):
                raise ValueError(f"message {i}: contains the private-use characters U+E000/U+E001")
        marked = self._render(self._compiled_tracking, messages, add_generation_prompt, extra)
        text: list[str] = []
        spans: list[tuple[int, int]] = []
        pos, start = 0, None
        for ch in marked:
            if ch == GEN_OPEN:
                if start is not None:
                    raise ValueError(f"{self.name}: nested {{% generation %}} blocks")
                start = pos
            elif ch == GEN_CLOSE:
                assert start is not None, "generation close without open"
                spans.append((start, pos))
                start = None
            else:
                text.append(ch)
                pos += 1
        return "".join(text), [s for s in spans if s[1] > s[0]]

    def prefix_spans(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **extra
    ) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, assistant character ranges) by rendering prefixes (module docstring)."""
        full = self.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, **extra)
            upto = self.render(messages[: i + 1], **extra)
            if not upto.startswith(before) or not full.startswith(upto):
                raise ValueError(
                    f"{self.name}: cannot find assistant turn {i} by rendering prefixes (the template renders "
                    f"a turn differently once later turns exist, or its generation prompt is not the start of "
                    f"the assistant turn); a template with {{% generation %}} tags would mark it"
                )
            end = max(len(before), len(upto.rstrip()))
            if end > len(before):
                spans.append((len(before), end))
        return full, spans

    def assistant_spans(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        method: str = "auto",
        add_generation_prompt: bool = False,
        **extra,
    ) -> tuple[str, list[tuple[int, int]], str]:
        """(rendered text, assistant character ranges, the method used): `method` "generation",
        "prefix", or "auto" (generation when the template has the tags, else prefix)."""
        if method == "auto":
            method = "generation" if self.has_generation_tags else "prefix"
        if method == "generation":
            if not self.has_generation_tags:
                raise ValueError(f"{self.name}: method 'generation' needs {{% generation %}} tags in the template")
            text, spans = self.generation_spans(messages, add_generation_prompt=add_generation_prompt, **extra)
        elif method == "prefix":
            text, spans = self.prefix_spans(messages, add_generation_prompt=add_generation_prompt, **extra)
        else:
            raise ValueError(f"unknown assistant span method {method!r} (auto, generation, prefix)")
        return text, spans, method


def template_from_config(
    config: Mapping[str, Any], *, source: Optional[str] = None, name: str = "tokenizer_config.json"
) -> ChatTemplate:
    """A `ChatTemplate` from a parsed tokenizer_config.json (`source` overrides its chat_template)."""
    if source is None:
        t = config.get("chat_template")
        if isinstance(t, list):
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, Mapping)}
            t = named.get("default")
            if t is None:
                raise ValueError(
                    f"{name}: chat_template is a list without a 'default' entry ({sorted(map(str, named))})"
                )
        if not isinstance(t, str) or not t:
            raise ValueError(f"{name}: no chat_template (and no chat_template.jinja beside it)")
        source = t
    special: dict[str, Any] = {}
    for k in SPECIAL_TOKEN_KEYS:
        v = _token_text(config.get(k))
        if v is not None:
            special[k] = v
    for k in ("bos_token", "eos_token"):
        if re.search(rf"\b{k}\b", source) and k not in special:
            raise ValueError(f"{name}: the chat template uses {k} but the config defines none")
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        special["additional_special_tokens"] = [_token_text(v) for v in extra]
    return ChatTemplate(source, special, name)


def load_chat_template(path: Union[str, Path]) -> ChatTemplate:
    """The chat template of a Hugging Face tokenizer folder (or its tokenizer_config.json file):
    `chat_template.jinja` when present, else the config's `chat_template`. ValueError when missing."""
    p = Path(path)
    cfg_file = p / "tokenizer_config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file}: no such file (a Hugging Face tokenizer_config.json)")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{cfg_file}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object")
    jinja_file = cfg_file.with_name("chat_template.jinja")
    source = jinja_file.read_text() if jinja_file.is_file() else None
    return template_from_config(config, source=source, name=str(jinja_file if source is not None else cfg_file))
