"""Templates, in one place: how a question becomes what the model reads.

- PromptTemplate: a question -> the prompt text ("plain") or chat messages ("chat").
- encode_prompt: a rendered prompt -> token ids, through the tokenizer's chat template for chat.
- Chat templates: messages -> text. A ChatML template (SmolLM2, Qwen2 without tools) is
  recognised exactly and rendered in plain Python (ChatMLTemplate); any other HF chat template is
  rendered with jinja2 the way transformers does (a clear error when jinja2 is not installed).
  jrl.models.tokenizer's HFTokenizer.apply_chat_template picks between them.

Plain text only: tokenizers are duck-typed (encode / encode_chat / bos_id), never imported.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from typing import Any, Mapping, Sequence

from jrl.data.examples import PromptExample

TEMPLATE_KINDS = ("plain", "chat")

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# The instruction names "####" because the default verifier (jrl.rewards.math_reward) reads it.
DEFAULT_PLAIN_FORMAT = (
    "Question: {question}\n"
    "Solve step by step, then give the final answer as a number after ####.\n"
    "Answer:"
)
DEFAULT_CHAT_FORMAT = (
    "{question}\nSolve step by step, then give the final answer as a number after ####."
)


# ------------------------------------------------------------------------------------------------
# Prompt templates: question -> prompt


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """How a question is put to the model.

    Attributes:
      kind: "plain" renders one string to tokenize as is; "chat" renders a message list
        [{"role": "system", ...}?, {"role": "user", "content": ...}] for a tokenizer's chat
        template (jrl.models) to turn into text.
      user_format: a str.format string whose only field is {question} (write literal braces as
        {{ and }}). None picks DEFAULT_PLAIN_FORMAT or DEFAULT_CHAT_FORMAT by kind.
      system: chat only: the system message, or None for no system message (the chat template may
        then add its own default). Must be None for kind="plain".
      chat_template_kwargs: chat only: ((name, value), ...) variables for the tokenizer's chat
        template (transformers' chat_template_kwargs), e.g. (("enable_thinking", False),).
    """

    kind: str = "plain"
    user_format: str | None = None
    system: str | None = None
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in TEMPLATE_KINDS:
            raise ValueError(
                f"PromptTemplate: kind={self.kind!r} is not allowed; "
                f"allowed kinds: {TEMPLATE_KINDS}."
            )
        if self.user_format is None:
            default = DEFAULT_PLAIN_FORMAT if self.kind == "plain" else DEFAULT_CHAT_FORMAT
            object.__setattr__(self, "user_format", default)
        if not isinstance(self.user_format, str):
            raise ValueError(
                f"PromptTemplate: user_format={self.user_format!r} is not allowed; "
                "it must be a str."
            )
        try:
            fields = [
                field
                for _, field, _, _ in string.Formatter().parse(self.user_format)
                if field is not None
            ]
        except ValueError as error:
            raise ValueError(
                f"PromptTemplate: user_format={self.user_format!r} is not a valid format string "
                f"({error}); "
                "write literal braces as {{ and }}."
            ) from None
        if fields != ["question"]:
            raise ValueError(
                f"PromptTemplate: user_format={self.user_format!r} has fields {fields}; it must "
                "contain the field {question} exactly once and no other field (write literal "
                "braces as {{ and }})."
            )
        if self.system is not None:
            if self.kind != "chat":
                raise ValueError(
                    f"PromptTemplate: system={self.system!r} is only used by kind='chat', "
                    f"not kind={self.kind!r}; "
                    "put plain-prompt instructions in user_format."
                )
            if not isinstance(self.system, str):
                raise ValueError(
                    f"PromptTemplate: system={self.system!r} is not allowed; "
                    "it must be a str or None."
                )

        reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
        for name, _ in self.chat_template_kwargs:
            if self.kind != "chat":
                raise ValueError(f"PromptTemplate: chat_template_kwargs are only used by "
                                 f"kind='chat', not kind={self.kind!r}")
            if not isinstance(name, str) or not name.isidentifier() or name in reserved:
                raise ValueError(f"PromptTemplate: chat_template_kwargs name {name!r} must be "
                                 f"an identifier other than {sorted(reserved)}")

    def render_question(self, question: str) -> str | list[dict[str, str]]:
        """The prompt for one question: a str ("plain") or a list of role/content messages."""
        user_text = self.user_format.format(question=question)
        if self.kind == "plain":
            return user_text
        messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        messages.append({"role": "user", "content": user_text})
        return messages

    def render(self, example: PromptExample) -> str | list[dict[str, str]]:
        """`render_question(example.question)`."""
        return self.render_question(example.question)

    def render_batch(self, examples: list[PromptExample]) -> list[str | list[dict[str, str]]]:
        """[B] prompts for [B] examples."""
        return [self.render(example) for example in examples]


# ------------------------------------------------------------------------------------------------
# Prompt -> token ids


def encode_prompt(template: PromptTemplate, tokenizer, example: PromptExample) -> list[int]:
    """The prompt's token ids: a chat prompt through the tokenizer's chat template (with the
    generation prompt), a plain one encoded as is (BOS first when the tokenizer has one)."""
    rendered = template.render(example)
    if template.kind == "chat":
        if not hasattr(tokenizer, "encode_chat"):
            raise ValueError("data.template='chat' needs a tokenizer with a chat template "
                             "(model.tokenizer='model'); the char tokenizer has none")
        return list(tokenizer.encode_chat(rendered, **dict(template.chat_template_kwargs)))
    bos = getattr(tokenizer, "bos_id", None)
    return list(tokenizer.encode(rendered, add_bos=bos is not None))


# ------------------------------------------------------------------------------------------------
# Chat templates: messages -> text


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Each message is a dict with string 'role' and 'content' (text only)."""
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(message).__name__}")
        content = message.get("content")
        if isinstance(content, (list, tuple)) or isinstance(content, Mapping):
            parts = content if isinstance(content, (list, tuple)) else [content]
            kinds = sorted({str(p.get("type")) for p in parts if isinstance(p, Mapping)})
            raise ValueError(f"messages[{i}]['content'] is a list of parts ({kinds}): jrl trains "
                             "text models only, so image, video and audio inputs are not "
                             "supported (a Qwen3.5 checkpoint's vision tower is not loaded); "
                             "give the content as one string")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got "
                                 f"{message.get(key)!r}")


def _canonical_template(template: str) -> str:
    """Template text with whitespace inside {{ }} / {% %} removed outside string literals,
    string literals re-quoted with single quotes and their escapes resolved, so that formatting
    variants of one template compare equal."""
    out: list[str] = []
    i, n = 0, len(template)
    while i < n:
        opener = template[i:i + 2]
        if opener not in ("{{", "{%"):
            out.append(template[i])
            i += 1
            continue
        closer = "}}" if opener == "{{" else "%}"
        out.append(opener)
        i += 2
        while i < n and template[i:i + 2] != closer:
            char = template[i]
            if char in "'\"":
                quote, i = char, i + 1
                literal: list[str] = []
                while i < n and template[i] != quote:
                    if template[i] == "\\" and i + 1 < n:
                        escaped = template[i + 1]
                        literal.append({"n": "\n", "t": "\t"}.get(escaped, escaped))
                        i += 2
                    else:
                        literal.append(template[i])
                        i += 1
                i += 1
                text = "".join(literal)
                if "'" in text:  # not representable in the canonical form: keep it distinct
                    return "\x00" + template
                out.append("'" + text + "'")
            elif char.isspace():
                i += 1
            else:
                out.append(char)
                i += 1
        out.append(closer)
        i += 2
    return "".join(out)


_CHATML_PATTERN = re.compile(
    re.escape("{%formessageinmessages%}")
    + "(?:" + re.escape("{%ifloop.firstandmessages[0]['role']!='system'%}{{'<|im_start|>system\n")
    + "(?P<system>[^'<]*)" + re.escape("<|im_end|>\n'}}{%endif%}") + ")?"
    + re.escape("{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>'+'\n'}}"
                "{%endfor%}{%ifadd_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%}")
    + r"\Z")


@dataclasses.dataclass(frozen=True)
class ChatMLTemplate:
    """`<|im_start|>role\\ncontent<|im_end|>\\n` per message; default_system, when set, is
    inserted as a system message before a conversation that does not start with one."""

    default_system: str | None = None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = False) -> str:
        parts = []
        for i, message in enumerate(messages):
            if i == 0 and self.default_system is not None and message["role"] != "system":
                parts.append(f"{IM_START}system\n{self.default_system}{IM_END}\n")
            parts.append(f"{IM_START}{message['role']}\n{message['content']}{IM_END}\n")
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)


def parse_chatml_template(template: str) -> ChatMLTemplate | None:
    """The ChatMLTemplate equivalent to a jinja `template`, or None if it is not plain ChatML."""
    match = _CHATML_PATTERN.match(_canonical_template(template))
    if match is None:
        return None
    return ChatMLTemplate(default_system=match.group("system"))


def render_jinja_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = False, **variables: Any) -> str:
    """Renders an HF chat template with jinja2 the way transformers does (sandboxed,
    trim_blocks, lstrip_blocks, `raise_exception`, `tojson`)."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError("this chat template is not plain ChatML, so rendering it needs jinja2; "
                          "install it with `pip install jinja2`") from error

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
