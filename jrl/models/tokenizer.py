"""Tokenizers: HF `tokenizers` wrappers with chat templates and stop tokens, and a char tokenizer.

Every tokenizer here follows the `Tokenizer` protocol: `encode(text, add_bos=False)` never adds
special tokens unless asked (what the caller sees is what the model gets), `decode(ids)`, the
bos / eos / pad ids and `stop_ids` (tokens that end a sampled response).

Chat templates are rendered by jrl.data.templates (ChatML natively, any other with jinja2).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import tokenizers

from jrl.data.templates import (IM_END, parse_chatml_template, render_jinja_template,
                                validate_messages)

END_OF_TEXT = "<|endoftext|>"

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, data pipeline and demo need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    @property
    def special_token_texts(self) -> tuple[str, ...]: ...

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


# ------------------------------------------------------------------------------------------------
# HF tokenizers


@dataclasses.dataclass
class HFTokenizer:
    """A `tokenizers.Tokenizer` with its special tokens, chat template and stop tokens.

    Fields:
      backend: the tokenizers object (tokenizer.json).
      bos_token / eos_token / pad_token: token strings (None when the tokenizer has none).
      chat_template: the jinja chat template, or None.
      add_bos: whether raw text for this model conventionally starts with BOS (informational;
        `encode` adds it only when asked).
      extra_stop_ids: stop tokens beyond eos / <|im_end|> (e.g. the model config's eos ids).
    """

    backend: tokenizers.Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    add_bos: bool = False
    extra_stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for field in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = getattr(self, field)
            if token is not None and self.backend.token_to_id(token) is None:
                raise ValueError(f"tokenizer: {field}={token!r} is not in the vocabulary")
        self._chatml = (parse_chatml_template(self.chat_template)
                        if self.chat_template is not None else None)

    # --- ids -----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_id(self) -> int:
        """The pad token's id; falls back to eos only because padding positions are masked
        out everywhere in jrl (masks are explicit), so the value never reaches the model."""
        pad = self._id(self.pad_token)
        if pad is None:
            pad = self.eos_id
        if pad is None:
            raise ValueError("tokenizer has neither pad_token nor eos_token; set pad_token")
        return pad

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """eos, <|im_end|> for ChatML templates, and extra_stop_ids; sorted, unique."""
        ids = set(self.extra_stop_ids)
        if self.eos_id is not None:
            ids.add(self.eos_id)
        if self.chat_template is not None and IM_END in self.chat_template:
            im_end = self._id(IM_END)
            if im_end is None:
                raise ValueError(f"chat template uses {IM_END} but it is not in the vocabulary")
            ids.add(im_end)
        return tuple(sorted(ids))

    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """The text of every special token (<|im_start|>, <|im_end|>, ...): written in text,
        each encodes to its single id, so text from outside (a tool's output) must not carry
        them into a conversation."""
        return tuple(token.content for token in self.backend.get_added_tokens_decoder().values()
                     if token.special)

    def with_stop_ids(self, ids: Sequence[int]) -> "HFTokenizer":
        extra = tuple(sorted(set(self.extra_stop_ids) | {int(i) for i in ids}))
        return dataclasses.replace(self, extra_stop_ids=extra)

    # --- text ----------------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to
        their single ids. BOS is prepended only when add_bos=True."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("encode(add_bos=True): this tokenizer has no bos_token")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # --- chat ----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = False,
                            **template_kwargs: Any) -> str:
        """The prompt text for a conversation [{"role", "content"}, ...]. template_kwargs are
        the template's own variables (transformers' chat_template_kwargs, e.g.
        enable_thinking=False for Qwen3); one the template never reads is refused, so a typo
        is not silently ignored."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json "
                             "'chat_template', chat_template.jinja or GGUF "
                             "tokenizer.chat_template)")
        validate_messages(messages)
        unread = sorted(k for k in template_kwargs if k not in self.chat_template)
        if unread:
            raise ValueError(f"chat template variables {unread}: this tokenizer's chat template "
                             "never reads them (check data.chat_template_kwargs)")
        if self._chatml is not None and not template_kwargs:
            return self._chatml.render(messages, add_generation_prompt=add_generation_prompt)
        return render_jinja_template(self.chat_template, messages,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "", **template_kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs))

    # --- files ---------------------------------------------------------------------------------
    def hf_files(self, *, model_max_length: int | None = None) -> dict[str, str]:
        """tokenizer.json and tokenizer_config.json contents that transformers can load."""
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        return {TOKENIZER_FILE: self.backend.to_str(),
                TOKENIZER_CONFIG_FILE: json.dumps(config, indent=2, ensure_ascii=False)}

    def save(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        for name, contents in self.hf_files().items():
            with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
                handle.write(contents)


def _token_string(value: Any, field: str) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: {field}={value!r} must be a string or an object "
                     "with 'content'")


def _chat_template_from_config(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        named = {item.get("name"): item.get("template") for item in value}
        if "default" not in named:
            raise ValueError(f"tokenizer_config.json: chat_template is a list without a "
                             f"'default' entry (names: {sorted(named)})")
        return named["default"]
    raise ValueError(f"tokenizer_config.json: chat_template has type {type(value).__name__}; "
                     "expected a string or a list of named templates")


def load_hf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """Loads a tokenizer from an HF directory (tokenizer.json [+ tokenizer_config.json,
    chat_template.jinja]) or a tokenizer.json file. (jrl.models.load_tokenizer also reads GGUF.)"""
    path = os.fspath(path)
    if os.path.isdir(path):
        directory, tokenizer_file = path, os.path.join(path, TOKENIZER_FILE)
    elif os.path.basename(path) == TOKENIZER_FILE or path.endswith(".json"):
        directory, tokenizer_file = os.path.dirname(path), path
    else:
        raise ValueError(f"load_tokenizer({path!r}): expected a directory with {TOKENIZER_FILE}, "
                         "a tokenizer.json file or a .gguf file")
    if not os.path.exists(tokenizer_file):
        raise FileNotFoundError(f"{directory}: no {TOKENIZER_FILE} (only fast tokenizers saved "
                                "as tokenizer.json are supported)")
    backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    config: dict = {}
    config_file = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if os.path.exists(config_file):
        with open(config_file, encoding="utf-8") as handle:
            config = json.load(handle)
    chat_template = _chat_template_from_config(config.get("chat_template"))
    template_file = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.exists(template_file):
        with open(template_file, encoding="utf-8") as handle:
            chat_template = handle.read()
    return HFTokenizer(
        backend=backend,
        bos_token=_token_string(config.get("bos_token"), "bos_token"),
        eos_token=_token_string(config.get("eos_token"), "eos_token"),
        pad_token=_token_string(config.get("pad_token"), "pad_token"),
        unk_token=_token_string(config.get("unk_token"), "unk_token"),
        chat_template=chat_template,
        add_bos=bool(config.get("add_bos_token", False)),
    )


# ------------------------------------------------------------------------------------------------
# Character-level tokenizer for synthetic tasks

DEFAULT_ALPHABET = "0123456789+-*/=()., ?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n#$%'!"
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>")


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """One id per character, for synthetic arithmetic tasks.

    Ids are deterministic: <pad>=0, <bos>=1, <eos>=2, then the alphabet's characters in order
    (so "0" is 3 with the default alphabet). Encoding a character outside the alphabet raises.
    """

    alphabet: str = DEFAULT_ALPHABET

    def __post_init__(self):
        duplicates = sorted({c for c in self.alphabet if self.alphabet.count(c) > 1})
        if duplicates:
            raise ValueError(f"CharTokenizer.alphabet has duplicate characters {duplicates}")
        if not self.alphabet:
            raise ValueError("CharTokenizer.alphabet must not be empty")
        object.__setattr__(self, "_ids", {c: i + len(CHAR_SPECIALS)
                                          for i, c in enumerate(self.alphabet)})

    @property
    def vocab_size(self) -> int:
        return len(CHAR_SPECIALS) + len(self.alphabet)

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.eos_id,)

    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """None: text never encodes to a special id here (each character is its own token)."""
        return ()

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for position, char in enumerate(text):
            token = self._ids.get(char)
            if token is None:
                raise ValueError(f"CharTokenizer: character {char!r} at position {position} of "
                                 f"{text!r} is not in the alphabet {self.alphabet!r}")
            ids.append(token)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        chars = []
        for token in ids:
            token = int(token)
            if 0 <= token < len(CHAR_SPECIALS):
                if not skip_special_tokens:
                    chars.append(CHAR_SPECIALS[token])
            elif len(CHAR_SPECIALS) <= token < self.vocab_size:
                chars.append(self.alphabet[token - len(CHAR_SPECIALS)])
            else:
                raise ValueError(f"CharTokenizer: id {token} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        return "".join(chars)
