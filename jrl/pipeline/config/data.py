"""The data section of a run config: the prompt source, its record fields and the template."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jrl import paths
from jrl.checks import check_choice, check_int, check_positive, check_seed
from jrl.data.records import ANSWER_FORMATS, GSM8K_FIELDS, RECORD_FILE_SUFFIXES, RecordFields
from jrl.plugins import check_plugin_spec

DATA_SOURCES = ("arithmetic", "file", "gsm8k_jsonl", "tfds_gsm8k")
# DataSection's record-file options and their defaults (only data.source="file" reads them).
_RECORD_FIELD_DEFAULTS = (("prompt_field", "question"), ("answer_field", "answer"),
                          ("solution_field", ""), ("answer_format", "text"),
                          ("record_adapter", ""))
TEMPLATES = ("plain", "chat")
TOO_LONG_POLICIES = ("error", "skip")


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Prompt source and template. arithmetic: the built-in synthetic task (knobs below);
    file: your own .jsonl or .parquet files (path, eval_path; jrl.data.records), each record's
    prompt in prompt_field and reference answer in answer_field (solution_field: a worked
    solution for the warm start, "" none; answer_format "text" or "gsm8k": "... #### N"), or
    read by record_adapter, "package.module:function" or "path/to/file.py:function" taking the
    record dict and returning {"question", "answer"[, "solution"]} (or None to leave it out);
    gsm8k_jsonl: the preset of file for GSM8K's release files (question, answer, gsm8k
    format); tfds_gsm8k: the tensorflow-datasets copy, if installed and prepared. too_long: a prompt longer than
    rollout.max_prompt_len tokens is a load error naming it ("error") or is left out of the run,
    with a count in the log ("skip"). chat_template_kwargs (template="chat"): variables for the
    tokenizer's chat template as "name=value[,name=value]", values read as JSON where they parse
    (true, false, numbers) and as text otherwise, e.g. "enable_thinking=false" (Qwen3's
    non-thinking mode). seed: the data's randomness (the arithmetic task's problems, the train
    prompts' order, the warm start's draws); None (the default): the run's seed
    (RunConfig.seeds)."""

    source: str = "arithmetic"
    path: str | None = None
    eval_path: str | None = None
    num_terms: int = 2
    max_operand: int = 9
    operators: str = "+-"
    word_problems: bool = False
    train_size: int = 4096
    eval_size: int = 64
    template: str = "plain"
    user_format: str | None = None
    system: str | None = None
    chat_template_kwargs: str = ""
    seed: int | None = None
    too_long: str = "error"
    prompt_field: str = "question"
    answer_field: str = "answer"
    solution_field: str = ""
    answer_format: str = "text"
    record_adapter: str = ""

    def __post_init__(self):
        check_choice("data.source", self.source, DATA_SOURCES)
        check_choice("data.template", self.template, TEMPLATES)
        check_choice("data.too_long", self.too_long, TOO_LONG_POLICIES)
        check_int("data.num_terms", self.num_terms, low=1)
        check_int("data.max_operand", self.max_operand, low=0)
        if self.seed is not None:
            check_seed("data.seed", self.seed)
        if self.source in ("gsm8k_jsonl", "file") and not self.path:
            raise ValueError(f"data.path is required with data.source={self.source!r} (a local "
                             + ("GSM8K-format jsonl file)" if self.source == "gsm8k_jsonl"
                                else ".jsonl or .parquet file)"))
        check_choice("data.answer_format", self.answer_format, ANSWER_FORMATS)
        mapping = {name: getattr(self, name) for name, default in _RECORD_FIELD_DEFAULTS
                   if getattr(self, name) != default}
        if mapping and self.source != "file":
            raise ValueError(f"data.{next(iter(mapping))}={next(iter(mapping.values()))!r} "
                             "reads a record file: only used with data.source='file', not "
                             f"{self.source!r}")
        if self.record_adapter:
            check_plugin_spec("data.record_adapter", self.record_adapter)
            clash = [name for name in mapping if name != "record_adapter"]
            if clash:
                raise ValueError(f"data.{clash[0]} and data.record_adapter both say how a "
                                 "record is read: give one")
        for name in ("prompt_field", "answer_field"):
            if not getattr(self, name):
                raise ValueError(f"data.{name} is empty: name the record field")
        for name in ("path", "eval_path"):
            value = getattr(self, name)
            paths.check_scheme(f"data.{name}", value)     # the package: at run setup
            if self.source == "file" and value and not value.endswith(RECORD_FILE_SUFFIXES):
                raise ValueError(f"data.{name}={value!r}: data.source='file' reads "
                                 f"{' or '.join(RECORD_FILE_SUFFIXES)} files")
        check_positive("data.train_size", self.train_size)
        check_positive("data.eval_size", self.eval_size, allow_zero=True)
        if self.chat_template_kwargs and self.template != "chat":
            raise ValueError(f"data.chat_template_kwargs={self.chat_template_kwargs!r}: only "
                             f"used with data.template='chat', not {self.template!r}")
        self.template_variables()     # a malformed value is a load error

    def record_fields(self) -> RecordFields:
        """The field mapping of data.source="file" (GSM8K's for "gsm8k_jsonl")."""
        if self.source == "gsm8k_jsonl":
            return GSM8K_FIELDS
        return RecordFields(prompt=self.prompt_field, answer=self.answer_field,
                            solution=self.solution_field, answer_format=self.answer_format)

    def template_variables(self) -> tuple[tuple[str, Any], ...]:
        """chat_template_kwargs as ((name, value), ...)."""
        pairs = []
        for item in (part.strip() for part in self.chat_template_kwargs.split(",")):
            if not item:
                continue
            name, equals, text = (part.strip() for part in item.partition("="))
            if not equals or not name.isidentifier():
                raise ValueError(f"data.chat_template_kwargs={self.chat_template_kwargs!r}: "
                                 f"{item!r} is not name=value (e.g. enable_thinking=false)")
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            pairs.append((name, value))
        return tuple(pairs)

