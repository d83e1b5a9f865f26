"""The warm start builds every row once before training: a solution the tokenizer cannot
encode is refused naming its file and line, and rows cut at the row length are counted and said
(refused when no solution token fits), since a cut row never trains its final answer or end of
sequence."""

import json
import re

import jax
import pytest

from jrl.data import PromptTemplate, load_gsm8k_jsonl
from jrl.models import init_params
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.rollout.task import Task
from jrl.pipeline.loop.warm_start import warm_start
from tests.pipeline.tiny import tiny_config

TASK = Task(CharTokenizer(), PromptTemplate(user_format="{question}\n"))


def _examples(tmp_path, solutions):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": "What is 2 + 3?", "answer": solution})
                            + "\n" for solution in solutions))
    return str(path), load_gsm8k_jsonl(str(path))


def _warm_start(examples, seq_len, log):
    config = tiny_config("train.sft_steps=1", "train.sft_wrong_answer_frac=0")
    params = init_params(config.model.arch, jax.random.key(0))
    return warm_start(params, config, config.model.arch, examples, task=TASK, seq_len=seq_len,
                      device=jax.devices()[0], log=log)


def test_a_solution_character_the_tokenizer_lacks_names_the_file_and_line(tmp_path):
    path, examples = _examples(tmp_path, ["2+3=5\n#### 5", "2×3=6\n#### 6"])
    with pytest.raises(ValueError, match=re.escape(f"warm start, {path}:2: CharTokenizer: "
                                                   "character '×'")):
        _warm_start(examples, seq_len=64, log=lambda line: None)


def test_rows_longer_than_the_row_length_are_counted_in_the_log(tmp_path):
    # Row = prompt "What is 2 + 3?\n" (15 tokens) + solution + end of sequence: "2+3=5\n#### 5"
    # (12 tokens) makes 28 <= 30; the long solution (12 + 12 tokens) makes 40 > 30.
    _, examples = _examples(tmp_path, ["2+3=5\n#### 5", "2+3=5\n" * 3 + "#### 5"])
    lines = []
    _warm_start(examples, seq_len=30, log=lines.append)
    assert ("warm start: 1 of 2 prompt + solution rows are longer than the row of 30 tokens "
            "(rollout.max_prompt_len + sampling.max_new_tokens) and are cut there: their final "
            "answer and end of sequence are not trained") in lines


def test_a_warm_start_where_no_solution_token_fits_is_refused(tmp_path):
    # The prompt alone (15 tokens) fills a 14-token row: no solution token would be trained.
    _, examples = _examples(tmp_path, ["2+3=5\n#### 5", "2+3=5\n#### 5"])
    with pytest.raises(ValueError, match=r"warm start: no solution token of the 2 examples fits "
                                         r"the row of 14 tokens .*raise "
                                         r"sampling.max_new_tokens"):
        _warm_start(examples, seq_len=14, log=lambda line: None)
