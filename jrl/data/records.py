"""Prompts from any record file: jsonl or parquet, read through a field mapping or an adapter.

    fields = RecordFields(prompt="problem", answer="solution_value")
    examples = load_prompt_file("train.jsonl", fields)            # list[PromptExample]
    examples = load_prompt_file("train.parquet", adapter=my_adapter)

A record becomes a PromptExample: question = record[fields.prompt], answer = record[
fields.answer] (text; a JSON number as it is written), solution = record[fields.solution]
when fields.solution is set (the warm start's target). answer_format "gsm8k" reads GSM8K's
answer field instead: "<worked solution>\\n#### N" gives answer N (canonical number form) and
the worked solution (calculator annotations removed). Every record's fields ride along in
meta["record"], so a reward function can read what the mapping did not use (test cases, units).

An adapter, adapter(record: dict) -> {"question", "answer"[, "solution"]} (or a PromptExample,
or None to leave the record out: counted, never silent), replaces the field mapping for formats
a mapping cannot express.

Errors are DataFormatError naming the file and line (jsonl) or row (parquet): not JSON, not an
object, a missing or empty field (listing the fields the record has), an adapter that raises
or returns something else, an empty file.

A path may be a URL (gs://, s3://, az://, hf://), read through etils.epath (jrl.paths).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Any, Callable, Iterator

from jrl import paths

from jrl.data.examples import PromptExample
from jrl.data.gsm8k import DataFormatError, parse_gsm8k_answer, strip_calculator_annotations

ANSWER_FORMATS = ("text", "gsm8k")
RECORD_FILE_SUFFIXES = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class RecordFields:
    """Which record fields hold the prompt, the reference answer and (optionally) a worked
    solution; answer_format: "text" (the field as it is) or "gsm8k" (see the module doc)."""

    prompt: str = "question"
    answer: str = "answer"
    solution: str = ""
    answer_format: str = "text"

    def __post_init__(self):
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format={self.answer_format!r}: allowed are "
                             f"{list(ANSWER_FORMATS)}")
        for name in ("prompt", "answer"):
            if not getattr(self, name):
                raise ValueError(f"the {name} field name is empty")


def read_records(path: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a .jsonl or .parquet file, where = "path:line" or
    "path row N" (1-based). Blank jsonl lines are skipped. DataFormatError for a line that is
    not UTF-8 or not JSON; ValueError for another suffix or parquet without pyarrow."""
    if path.endswith(".parquet"):
        yield from _parquet_records(path)
        return
    if not path.endswith(".jsonl"):
        raise ValueError(f"{path}: a record file is .jsonl or .parquet")
    with paths.open_file(path, "rb") as file:
        for line_number, raw in enumerate(file, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataFormatError(f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at "
                                      f"column {error.start + 1}); save the file as UTF-8"
                                      ) from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                raise DataFormatError(f"{where}: invalid JSON ({error.msg} at column "
                                      f"{error.colno})") from None


def _parquet_records(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ValueError(f"{path}: reading parquet needs pyarrow (pip install 'jrl[parquet]' or "
                         "pip install pyarrow)") from None
    try:
        if paths.is_url(path):
            with paths.open_file(path, "rb") as file:
                rows = parquet.read_table(file).to_pylist()
        else:
            rows = parquet.read_table(path).to_pylist()
    except Exception as error:  # noqa: BLE001 - pyarrow's many error types: one line each
        raise DataFormatError(f"{path}: not a readable parquet file ({type(error).__name__}: "
                              f"{error})") from None
    for row, record in enumerate(rows, start=1):
        yield f"{path} row {row}", record


def record_to_example(record: Any, fields: RecordFields, *, example_id: int,
                      meta: dict[str, Any] | None = None,
                      strip_annotations: bool = True) -> PromptExample:
    """One record through the field mapping; ValueError (no file context) when it cannot be.
    strip_annotations: remove GSM8K's "<<...>>" calculator annotations from a solution made
    from a gsm8k-format answer."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    values = {}
    for role in ("prompt", "answer", "solution"):
        name = getattr(fields, role)
        if not name:
            continue
        if name not in record:
            raise ValueError(f"missing field {name!r} (the {role}; found fields: "
                             f"{sorted(record)})")
        values[role] = _text(name, record[name])
    solution = values.get("solution")
    answer = values["answer"]
    if fields.answer_format == "gsm8k":
        reasoning, answer = parse_gsm8k_answer(answer)
        if solution is None:
            if strip_annotations:
                reasoning = strip_calculator_annotations(reasoning)
            solution = f"{reasoning}\n#### {answer}" if reasoning else f"#### {answer}"
    return PromptExample(id=example_id, question=values["prompt"], answer=answer,
                         solution=solution, meta={**(meta or {}), "record": record})


def _text(name: str, value: Any) -> str:
    """A field's value as stripped text: a string, or a number as JSON writes it."""
    if isinstance(value, str):
        text = value.strip()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        text = json.dumps(value)
    else:
        raise ValueError(f"field {name!r} must be text or a number, got "
                         f"{type(value).__name__} {value!r:.60}")
    if not text:
        raise ValueError(f"field {name!r} is empty")
    return text


def adapt_record(adapter: Callable[[dict], Any], record: Any, *, example_id: int,
                 meta: dict[str, Any]) -> PromptExample | None:
    """adapter(record) as a PromptExample (None: the adapter left the record out)."""
    made = adapter(record)
    if made is None or isinstance(made, PromptExample):
        return made if made is None else dataclasses.replace(
            made, id=example_id, meta={**meta, "record": record, **made.meta})
    if not isinstance(made, dict):
        raise ValueError(f"the record adapter returned a {type(made).__name__}; it must return "
                         "a dict with 'question' and 'answer' (and optionally 'solution'), a "
                         "PromptExample, or None to leave the record out")
    unknown = sorted(set(made) - {"question", "answer", "solution"})
    if unknown:
        raise ValueError(f"the record adapter returned the keys {unknown}; allowed are "
                         "'question', 'answer' and 'solution'")
    fields = RecordFields(prompt="question", answer="answer",
                          solution="solution" if made.get("solution") is not None else "")
    example = record_to_example(made, fields, example_id=example_id, meta=meta)
    return dataclasses.replace(example, meta={**meta, "record": record})


def load_prompt_file(path: str | os.PathLike[str], fields: RecordFields = RecordFields(), *,
                     adapter: Callable[[dict], Any] | None = None,
                     log: Callable[[str], None] | None = None, split_name: str | None = None,
                     strip_annotations: bool = True) -> list[PromptExample]:
    """The PromptExamples of a .jsonl or .parquet file, ids counting kept records from 0 in
    file order, meta = {"source": path, "where": "path:line" or "path row N", "split":
    split_name, "record": the record}. With an adapter, records it leaves out are counted in
    one `log` line. FileNotFoundError naming the path; DataFormatError naming the file and line
    or row; ValueError for an unknown suffix."""
    path = os.fspath(path)
    if not paths.isfile(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    examples: list[PromptExample] = []
    left_out = 0
    for where, record in read_records(path):
        meta = {"source": path, "where": where, "split": split_name}
        try:
            if adapter is None:
                example = record_to_example(record, fields, example_id=len(examples), meta=meta,
                                            strip_annotations=strip_annotations)
            else:
                example = adapt_record(adapter, record, example_id=len(examples), meta=meta)
        except DataFormatError:
            raise
        except Exception as error:  # noqa: BLE001 - an adapter's own failure, named by record
            raise DataFormatError(f"{where}: {type(error).__name__}: {error}"
                                  if adapter is not None and not isinstance(error, ValueError)
                                  else f"{where}: {error}") from None
        if example is None:
            left_out += 1
            continue
        examples.append(example)
    if left_out and log is not None:
        log(f"data: the record adapter left out {left_out} records of {path}")
    if not examples:
        raise DataFormatError(f"{path}: the file has no records"
                              + (f" (the record adapter left out all {left_out})"
                                 if left_out else ""))
    return examples


GSM8K_FIELDS = RecordFields(prompt="question", answer="answer", answer_format="gsm8k")


def load_gsm8k_jsonl(path: str | os.PathLike[str], *, split_name: str | None = None,
                     strip_annotations: bool = True) -> list[PromptExample]:
    """A GSM8K-format jsonl file (one {"question", "answer"} object per line, the answer ending
    in "#### N"): load_prompt_file with GSM8K_FIELDS. strip_annotations: remove "<<...>>"
    calculator annotations from the solution text (default True: a policy fine-tuned on them
    learns to emit calculator calls nothing executes). Raises as load_prompt_file."""
    return load_prompt_file(path, GSM8K_FIELDS, split_name=split_name,
                            strip_annotations=strip_annotations)
