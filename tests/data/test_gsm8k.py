import json
import sys

import pytest

from jrl.data import DataFormatError, load_gsm8k_jsonl, load_tfds_gsm8k, parse_gsm8k_answer

NATALIA = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}
BIG = {"question": "How much?", "answer": "It costs <<1000+234=1234>>1,234 dollars.\n#### 1,234"}
NEGATIVE = {"question": "Temperature?", "answer": "It fell to -3.\n#### -3"}


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_loads_gsm8k_records(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl", [json.dumps(NATALIA), "", json.dumps(BIG), json.dumps(NEGATIVE)]
    )
    examples = load_gsm8k_jsonl(path, split_name="train")
    assert [e.id for e in examples] == [0, 1, 2]
    assert [e.answer for e in examples] == ["72", "1234", "-3"]
    assert examples[0].question == NATALIA["question"]
    assert examples[0].solution == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
    )
    assert examples[1].solution == "It costs 1,234 dollars.\n#### 1234"
    # Line 2 is blank; the record itself rides along for reward functions.
    assert examples[2].meta == {"source": str(path), "where": f"{path}:4", "split": "train",
                                "record": json.loads(path.read_text().splitlines()[3])}


def test_annotations_can_be_kept(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [json.dumps(NATALIA)])
    (example,) = load_gsm8k_jsonl(path, strip_annotations=False)
    assert "<<48/2=24>>" in example.solution


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"question": "q"}), "missing field 'answer'"),
        # A number is read as text, which GSM8K's format needs to end in "#### N".
        (json.dumps({"question": "q", "answer": 5}), "the answer has no '####' line: '5'"),
        (json.dumps({"question": "q", "answer": None}), "field 'answer' must be text or a num"),
        (json.dumps({"question": "q", "answer": "it is 5"}), "no '####' line"),
        (
            json.dumps({"question": "q", "answer": "#### "}),
            "text after '####' is '', which is not a number",
        ),
        (json.dumps({"question": "q", "answer": "#### abc"}), "'abc', which is not a number"),
        (json.dumps([1, 2]), "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(NATALIA), bad_line])
    with pytest.raises(DataFormatError, match=message) as caught:
        load_gsm8k_jsonl(path)
    assert str(caught.value).startswith(f"{path}:2: ")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_gsm8k_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataFormatError, match="no records"):
        load_gsm8k_jsonl(write_jsonl(tmp_path / "empty.jsonl", []))


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer("a\nb\n#### 3.50") == ("a\nb", "3.5")


def test_tfds_missing_gives_install_instructions(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # makes the import fail
    with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
        load_tfds_gsm8k("train")


def test_a_non_utf8_file_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = '{"question": "q", "answer": "#### 1"}\n'
    path.write_bytes(good.encode() + '{"question": "caf\xe9", "answer": "#### 2"}\n'
                     .encode("latin-1"))
    with pytest.raises(DataFormatError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column "
                                              r"18\); save the file as UTF-8"):
        load_gsm8k_jsonl(path)
