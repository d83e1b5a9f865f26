"""jrl.data.with_wrong_final_answers: the warm-start data of an imperfect base policy."""

import dataclasses

import pytest

from jrl.data import ArithmeticTask, PromptExample, with_wrong_final_answers
from jrl.pipeline.config import TrainSection


def _examples(count=400):
    return ArithmeticTask(num_terms=3, max_operand=9, operators="+").generate(count, seed=0)


def test_wrong_answer_is_answer_plus_one_and_only_the_solution_changes():
    original = _examples()
    changed = with_wrong_final_answers(original, 0.7, seed=2)
    flipped = 0
    for before, after in zip(original, changed):
        assert after.answer == before.answer and after.question == before.question
        head = before.solution.rpartition("#### ")[0]
        if after.solution != before.solution:
            flipped += 1
            # e.g. "8+6=14\n14+5=19\n#### 19" -> "8+6=14\n14+5=19\n#### 20": steps kept, 19 + 1.
            assert after.solution == f"{head}#### {int(before.answer) + 1}"
    # 400 independent draws at p = 0.7: mean 280, std sqrt(400 * 0.7 * 0.3) = 9.2; +-5 std.
    assert 234 <= flipped <= 326


def test_choice_depends_on_seed_and_id_not_on_order():
    original = _examples(50)
    forward = with_wrong_final_answers(original, 0.5, seed=3)
    backward = with_wrong_final_answers(original[::-1], 0.5, seed=3)[::-1]
    assert forward == backward
    assert with_wrong_final_answers(original, 0.5, seed=4) != forward


def test_edges_zero_one_and_examples_without_a_solution():
    original = _examples(20)
    assert with_wrong_final_answers(original, 0.0, seed=0) == original
    everything = with_wrong_final_answers(original, 1.0, seed=0)
    assert all(a.solution.endswith(f"#### {int(a.answer) + 1}") for a in everything)
    bare = PromptExample(id=0, question="q", answer="3", solution=None)
    assert with_wrong_final_answers([bare], 1.0, seed=0) == [bare]
    with pytest.raises(ValueError, match=r"fraction=1.5 must be in \[0, 1\]"):
        with_wrong_final_answers(original, 1.5, seed=0)
    with pytest.raises(ValueError, match="train.sft_wrong_answer_frac=-0.1"):
        TrainSection(sft_wrong_answer_frac=-0.1)
    section = dataclasses.replace(TrainSection(), sft_wrong_answer_frac=0.7)
    assert section.sft_wrong_answer_frac == 0.7
