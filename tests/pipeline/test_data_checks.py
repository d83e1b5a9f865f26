"""Prompts are tokenised at load: one longer than rollout.max_prompt_len is refused naming its
file and line (or example index) and its length, or left out with a count (data.too_long)."""

import json
import re

import pytest

from jrl.data import PromptExample, PromptTemplate, load_gsm8k_jsonl
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.setup.data_checks import fit_prompts
from jrl.pipeline.setup.parts import build_parts
from jrl.pipeline.rollout.task import Task
from tests.pipeline.tiny import tiny_config

TASK = Task(CharTokenizer(), PromptTemplate(user_format="{question}"))


def render(example):
    return TASK.render(example)


def write_jsonl(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n"
                            for q in questions))
    return str(path)


def test_a_long_prompt_in_a_file_is_refused_naming_the_file_line_and_length(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ["short", "x" * 38, "also short"])
    examples = load_gsm8k_jsonl(path)
    length = len(render(examples[1]))
    with pytest.raises(ValueError, match=re.escape(
            f"train data, {path}:2: the prompt has {length} tokens, more than "
            "rollout.max_prompt_len=24; raise rollout.max_prompt_len or set "
            "data.too_long='skip'")):
        fit_prompts(examples, render, max_prompt_len=24, too_long="error", split="train")


def test_skip_leaves_long_prompts_out_and_counts_them(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ["short", "x" * 38, "y" * 1000, "fine"])
    examples = load_gsm8k_jsonl(path)
    kept, skipped = fit_prompts(examples, render, max_prompt_len=24, too_long="skip",
                                split="train")
    assert [e.question for e in kept] == ["short", "fine"] and skipped == 2


def test_an_example_without_a_file_is_named_by_index_and_id():
    examples = [PromptExample(id=10, question="ok", answer="1"),
                PromptExample(id=11, question="z" * 50, answer="1")]
    with pytest.raises(ValueError, match=r"eval data, example index 1 \(id 11\): the prompt has"):
        fit_prompts(examples, render, max_prompt_len=24, too_long="error", split="eval")


def test_a_multi_turn_first_observation_names_the_environment():
    def failing_render(example):
        raise RuntimeError("no such tool")

    examples = [PromptExample(id=3, question="q", answer="1")]
    with pytest.raises(ValueError, match=r"env.name='calculator': the first observation \(the "
                                         r"prompt\) has \d+ tokens"):
        fit_prompts(examples, lambda e: [1] * 30, max_prompt_len=24, too_long="error",
                    split="train", env_name="calculator")
    with pytest.raises(ValueError, match=r"rendering env.name='my.env:make'.*RuntimeError: no "
                                         r"such tool"):
        fit_prompts(examples, failing_render, max_prompt_len=24, too_long="error",
                    split="train", env_name="my.env:make")


def test_a_run_refuses_long_prompts_when_its_parts_are_built():
    # tiny_config's arithmetic prompts: 16 characters, a char token each ("What is 8 - 6?\n").
    with pytest.raises(ValueError, match=r"train data, example index 0 \(id 0\): the prompt has "
                                         r"16 tokens, more than rollout.max_prompt_len=15"):
        build_parts(tiny_config("rollout.max_prompt_len=15"), log=lambda *_: None)
    with pytest.raises(ValueError, match="every train prompt is longer than rollout.max_prompt"):
        build_parts(tiny_config("rollout.max_prompt_len=15", "data.too_long=skip"),
                    log=lambda *_: None)


def test_skipped_prompts_are_counted_in_the_log():
    from jrl.pipeline.setup.data import checked_data
    examples = [PromptExample(id=i, question=q, answer="1")
                for i, q in enumerate(["short", "x" * 40, "fine"])]
    task = Task(CharTokenizer(), PromptTemplate(user_format="{question}"))
    lines = []
    train, evals = checked_data(tiny_config("data.too_long=skip"), task, examples,
                                 examples[:1], lines.append)
    assert [e.id for e in train] == [0, 2] and [e.id for e in evals] == [0]
    assert lines == ["data.too_long='skip': left out 1 of 3 train prompts longer than "
                     "rollout.max_prompt_len=24 tokens"]


def test_duplicate_questions_and_eval_train_overlap_are_one_warning_each(tmp_path):
    from jrl.pipeline.setup.data_checks import hygiene_warnings
    train = load_gsm8k_jsonl(write_jsonl(tmp_path / "train.jsonl", ["a", "b", "a", " a ", "c"]))
    evals = load_gsm8k_jsonl(write_jsonl(tmp_path / "test.jsonl", ["c", "d", "b"]))
    # "a" three times (after stripping): 2 repeats of 5 examples, 3 distinct questions.
    assert hygiene_warnings(train, evals) == [
        f"warning: data: 2 of 5 train examples repeat a question (3 distinct); e.g. "
        f"{tmp_path / 'train.jsonl'}:1",
        f"warning: data: 2 of 3 eval questions are also train questions (same text), so eval "
        f"accuracy partly measures memorisation; e.g. {tmp_path / 'test.jsonl'}:1"]
    assert hygiene_warnings(train[1:2], evals[1:2]) == []


def test_a_runs_data_files_get_the_hygiene_warnings_in_its_log():
    from jrl.pipeline.setup.data import checked_data
    examples = [PromptExample(id=i, question=q, answer="1") for i, q in enumerate("aab")]
    task = Task(CharTokenizer(), PromptTemplate(user_format="{question}"))
    lines = []
    checked_data(tiny_config("data.source=gsm8k_jsonl", "data.path=train.jsonl"), task,
                  examples, examples[2:], lines.append)
    assert [line.split(":")[:2] for line in lines] == [["warning", " data"]] * 2
    lines.clear()
    checked_data(tiny_config(), task, examples, examples[2:], lines.append)   # arithmetic
    assert lines == []


def test_a_cut_data_file_and_a_missing_eval_set_are_each_one_line(tmp_path):
    """A file longer than data.train_size was cut to its first records without a word, and a
    run with no data.eval_path measured no eval without a word."""
    from jrl.pipeline.setup.data import build_data
    train_path = write_jsonl(tmp_path / "train.jsonl", list("abcde"))
    eval_path = write_jsonl(tmp_path / "test.jsonl", list("xyz"))
    lines = []
    train, evals = build_data(tiny_config("data.source=gsm8k_jsonl", f"data.path={train_path}",
                                          "data.train_size=3"), lines.append)
    assert [e.question for e in train] == ["a", "b", "c"] and evals == []
    assert lines == [
        f"data: using the first 3 of 5 records of {train_path} (data.train_size; raise it to "
        "use more)",
        "data: no eval set (data.eval_path is empty): eval/* is not measured; set "
        "data.eval_path to a held-out file"]
    lines.clear()
    train, evals = build_data(tiny_config("data.source=gsm8k_jsonl", f"data.path={train_path}",
                                          f"data.eval_path={eval_path}", "data.train_size=5",
                                          "data.eval_size=2"), lines.append)
    assert len(train) == 5 and [e.question for e in evals] == ["x", "y"]
    assert lines == [f"data: using the first 2 of 3 records of {eval_path} (data.eval_size; "
                     "raise it to use more)"]


def test_a_gguf_source_pointed_at_a_directory_says_so(tmp_path):
    """It said the path "does not exist"; it exists, and is a directory."""
    from jrl.kernels.contract import NumericalContract
    from jrl.models.loading import load_weights
    with pytest.raises(ValueError, match=rf"model\.path='{re.escape(str(tmp_path))}' is a "
                                         r"directory; a GGUF model is one \.gguf file"):
        load_weights("model.path", "gguf", str(tmp_path), NumericalContract())


def test_a_character_the_tokenizer_lacks_is_refused_with_file_and_line(tmp_path):
    # Line 2's question holds "×", which the character tokenizer's alphabet does not.
    path = write_jsonl(tmp_path / "train.jsonl", ["What is 2 + 3?", "What is 4 × 5?"])
    with pytest.raises(ValueError, match=re.escape(f"train data, {path}:2: CharTokenizer: "
                                                   "character '×' at position 10")):
        fit_prompts(load_gsm8k_jsonl(path), render, max_prompt_len=24, too_long="error",
                    split="train")
