"""GSM8K prompt sources: the jsonl release files, and the optional tensorflow-datasets copy.

GSM8K (Cobbe et al. 2021, arXiv:2110.14168) stores each problem as {"question": ..., "answer": ...}
where `answer` is the worked solution, with calculator annotations such as "<<48/2=24>>", and ends
in a line "#### 72".
"""

from __future__ import annotations

import os
import re
from typing import Any

from jrl.data.examples import PromptExample
from jrl.data.numbers import normalize_number

_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")
ANSWER_MARKER = "####"


class DataFormatError(ValueError):
    """A record of a data file is malformed; the message names the file and line."""


def strip_calculator_annotations(text: str) -> str:
    """Removes GSM8K's calculator annotations: "48/2 = <<48/2=24>>24" -> "48/2 = 24"."""
    return _CALCULATOR_ANNOTATION.sub("", text)


def parse_gsm8k_answer(answer_text: str) -> tuple[str, str]:
    """Splits a GSM8K answer field into (worked reasoning, canonical final answer).

    "Natalia sold ...\\n#### 72" -> ("Natalia sold ...", "72"); "#### 1,234" -> (..., "1234").
    Raises ValueError (without file context; loaders add it) if there is no "####" or what follows
    the last one is not a single number.
    """
    position = answer_text.rfind(ANSWER_MARKER)
    if position < 0:
        raise ValueError(f"the answer has no {ANSWER_MARKER!r} line: {answer_text[-80:]!r}")
    final_text = answer_text[position + len(ANSWER_MARKER) :].strip()
    final = normalize_number(final_text)
    if final is None:
        raise ValueError(
            f"the text after {ANSWER_MARKER!r} is {final_text!r}, which is not a number "
            "(allowed: an integer or decimal, optionally with sign, '$' and thousands commas)"
        )
    return answer_text[:position].rstrip(), final


def gsm8k_record_to_example(
    record: Any,
    *,
    example_id: int,
    strip_annotations: bool = True,
    meta: dict[str, Any] | None = None,
) -> PromptExample:
    """A GSM8K record (dict with str "question" and "answer") -> PromptExample; ValueError if bad.

    The solution is the reasoning (annotations stripped if asked) followed by "\\n#### <answer>"
    with the answer in canonical form, so SFT teaches exactly the format the verifier reads.
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for field in ("question", "answer"):
        if field not in record:
            raise ValueError(f"missing field {field!r} (found fields: {sorted(record)})")
        if not isinstance(record[field], str):
            raise ValueError(
                f"field {field!r} must be a string, got {type(record[field]).__name__}"
            )
    question = record["question"].strip()
    if not question:
        raise ValueError("field 'question' is empty")
    reasoning, final = parse_gsm8k_answer(record["answer"])
    if strip_annotations:
        reasoning = strip_calculator_annotations(reasoning)
    solution = f"{reasoning}\n{ANSWER_MARKER} {final}" if reasoning else f"{ANSWER_MARKER} {final}"
    return PromptExample(
        id=example_id, question=question, answer=final, solution=solution, meta=dict(meta or {})
    )


def load_tfds_gsm8k(
    split: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    strip_annotations: bool = True,
) -> list[PromptExample]:
    """Reads GSM8K from a prepared tensorflow-datasets copy (builder "gsm8k"); never downloads.

    Args:
      split: a tfds split such as "train", "test" or "train[:100]".
      data_dir: tfds data directory; None uses tfds's default (~/tensorflow_datasets).

    Raises:
      ImportError: tensorflow-datasets is not installed (the message says how to install it and
        prepare the data).
      DataFormatError: a record is malformed (names the split and record index).
    """
    try:
        import tensorflow_datasets as tfds  # optional dependency, imported only on use
    except ImportError as error:
        raise ImportError(
            "load_tfds_gsm8k needs tensorflow-datasets, which is not installed. Install it with "
            "`pip install tensorflow-datasets tensorflow`, prepare the data once with "
            '`tfds build gsm8k` (or `python -c "import tensorflow_datasets as tfds; '
            "tfds.builder('gsm8k').download_and_prepare()\"`), or use load_gsm8k_jsonl on GSM8K's "
            "train.jsonl / test.jsonl instead."
        ) from error
    dataset = tfds.load(
        "gsm8k",
        split=split,
        data_dir=None if data_dir is None else os.fspath(data_dir),
        download=False,
    )
    examples = []
    for index, record in enumerate(tfds.as_numpy(dataset)):
        try:
            decoded = {
                key: value.decode("utf-8") if isinstance(value, bytes) else value
                for key, value in dict(record).items()
            }
            examples.append(
                gsm8k_record_to_example(
                    decoded,
                    example_id=index,
                    strip_annotations=strip_annotations,
                    meta={"source": "tfds:gsm8k", "split": split, "index": index},
                )
            )
        except ValueError as error:
            raise DataFormatError(f"tfds gsm8k split {split!r}, record {index}: {error}") from None
    return examples
