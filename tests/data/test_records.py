"""Prompts from any jsonl or parquet file (jrl.data.records): a field mapping, GSM8K's answer
format, an adapter, and one error line naming the file and line or row for each bad input."""

import json

import pytest

from jrl.data import DataFormatError, GSM8K_FIELDS, PromptExample, RecordFields, load_prompt_file

MATH = [{"problem": "What is 1/2 + 1/4?", "solution": "3/4", "level": 2},
        {"problem": "2 * 21 = ?", "solution": 42, "level": 1}]


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def test_a_field_mapping_reads_other_names_and_keeps_the_record(tmp_path):
    path = _jsonl(tmp_path / "math.jsonl", MATH)
    first, second = load_prompt_file(path, RecordFields(prompt="problem", answer="solution"))
    assert (first.id, first.question, first.answer) == (0, "What is 1/2 + 1/4?", "3/4")
    assert second.answer == "42"                   # a JSON number, as JSON writes it
    assert first.solution is None                  # no solution field named
    assert second.meta["record"]["level"] == 1 and second.meta["where"] == f"{path}:2"


def test_a_parquet_file_reads_as_the_same_examples(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet
    path = tmp_path / "math.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(
        [{**r, "solution": str(r["solution"])} for r in MATH]), path)
    fields = RecordFields(prompt="problem", answer="solution")
    examples = load_prompt_file(path, fields)
    assert [(e.question, e.answer) for e in examples] == [("What is 1/2 + 1/4?", "3/4"),
                                                          ("2 * 21 = ?", "42")]
    assert examples[1].meta["where"] == f"{path} row 2"
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match=r"bad\.parquet: not a readable parquet file"):
        load_prompt_file(bad, fields)


def test_gsm8k_is_a_preset_of_the_mapping_and_a_solution_field_wins(tmp_path):
    record = {"question": "q", "answer": "2 + 2 = <<2+2=4>>4\n#### 4", "worked": "by hand"}
    path = _jsonl(tmp_path / "g.jsonl", [record])
    (example,) = load_prompt_file(path, GSM8K_FIELDS)
    assert (example.answer, example.solution) == ("4", "2 + 2 = 4\n#### 4")
    own = RecordFields(solution="worked", answer_format="gsm8k")
    assert load_prompt_file(path, own)[0].solution == "by hand"


def test_an_adapter_reads_what_a_mapping_cannot_and_may_leave_records_out(tmp_path):
    path = _jsonl(tmp_path / "pairs.jsonl", [{"q": ["1", "+", "2"], "a": 3},
                                             {"q": ["skip"], "a": 0},
                                             {"q": ["4", "-", "1"], "a": 3}])
    logged = []

    def adapter(record):
        if record["q"] == ["skip"]:
            return None
        return {"question": " ".join(record["q"]), "answer": record["a"]}

    examples = load_prompt_file(path, adapter=adapter, log=logged.append)
    assert [(e.id, e.question, e.answer) for e in examples] == [(0, "1 + 2", "3"),
                                                                (1, "4 - 1", "3")]
    assert logged == [f"data: the record adapter left out 1 records of {path}"]
    made = load_prompt_file(path, adapter=lambda r: PromptExample(id=-1, question="x",
                                                                  answer="y"))
    assert made[2].id == 2 and made[2].meta["where"] == f"{path}:3"


@pytest.mark.parametrize("adapter, message", [
    (lambda r: ["question"], "returned a list; it must return a dict with 'question'"),
    (lambda r: {"question": "q", "answer": "a", "hint": "h"}, "the keys \\['hint'\\]"),
    (lambda r: {"question": "q"}, "missing field 'answer'"),
    (lambda r: r["nope"], "KeyError: 'nope'"),
    (lambda r: None, "no records \\(the record adapter left out all 1\\)"),
])
def test_an_adapter_failure_names_the_file_and_line(tmp_path, adapter, message):
    path = _jsonl(tmp_path / "one.jsonl", [{"q": "1"}])
    with pytest.raises(DataFormatError, match=message) as caught:
        load_prompt_file(path, adapter=adapter)
    assert str(caught.value).startswith(str(path))


@pytest.mark.parametrize("line, message", [
    ('{"problem": "p"}', "missing field 'solution' \\(the answer; found fields: \\['problem'\\]\\)"),
    ('{"problem": "  ", "solution": "1"}', "field 'problem' is empty"),
    ('{"problem": ["p"], "solution": "1"}', "field 'problem' must be text or a number, got list"),
    ('{"problem": "p", "solution": true}', "field 'solution' must be text or a number"),
    ('"just text"', "expected a JSON object, got str"),
    ("{oops", "invalid JSON"),
])
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, line, message):
    path = _jsonl(tmp_path / "bad.jsonl", [MATH[0], "", line])
    with pytest.raises(DataFormatError, match=message) as caught:
        load_prompt_file(path, RecordFields(prompt="problem", answer="solution"))
    assert str(caught.value).startswith(f"{path}:3: ")      # line 2 is blank


def test_missing_empty_and_unknown_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(DataFormatError, match="no records"):
        load_prompt_file(_jsonl(tmp_path / "empty.jsonl", [""]))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="a record file is .jsonl or .parquet"):
        load_prompt_file(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="answer_format='latex': allowed are"):
        RecordFields(answer_format="latex")
