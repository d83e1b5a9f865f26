"""Prompt sources (any jsonl or parquet file through a field mapping, GSM8K, optional tfds,
synthetic arithmetic), templates, streams, grouping.

Plain Python + numpy; imports nothing jax-heavy. Reference answers are kept in the canonical number
form of jrl.data.numbers, the module that the verifiers use, so data and grading agree.
"""

from jrl.data.arithmetic import ALLOWED_OPERATORS, ArithmeticTask
from jrl.data.examples import PromptExample, with_wrong_final_answers
from jrl.data.grouping import group_ids, repeat_for_groups
from jrl.data.gsm8k import (
    DataFormatError,
    gsm8k_record_to_example,
    load_tfds_gsm8k,
    parse_gsm8k_answer,
    strip_calculator_annotations,
)
from jrl.data.records import (
    ANSWER_FORMATS,
    GSM8K_FIELDS,
    RecordFields,
    load_gsm8k_jsonl,
    load_prompt_file,
)
from jrl.data.stream import PromptStream
from jrl.data.templates import (
    DEFAULT_CHAT_FORMAT,
    DEFAULT_PLAIN_FORMAT,
    TEMPLATE_KINDS,
    PromptTemplate,
    encode_prompt,
)

__all__ = [
    "ALLOWED_OPERATORS",
    "ANSWER_FORMATS",
    "GSM8K_FIELDS",
    "RecordFields",
    "load_prompt_file",
    "ArithmeticTask",
    "DEFAULT_CHAT_FORMAT",
    "DEFAULT_PLAIN_FORMAT",
    "DataFormatError",
    "PromptExample",
    "PromptStream",
    "PromptTemplate",
    "TEMPLATE_KINDS",
    "encode_prompt",
    "group_ids",
    "gsm8k_record_to_example",
    "load_gsm8k_jsonl",
    "load_tfds_gsm8k",
    "parse_gsm8k_answer",
    "repeat_for_groups",
    "strip_calculator_annotations",
    "with_wrong_final_answers",
]
