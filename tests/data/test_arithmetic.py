import pytest

from jrl.data import ArithmeticTask
from jrl.rewards import extract_answer, numbers_in_text


def test_deterministic_and_resumable_by_index():
    task = ArithmeticTask(num_terms=3, max_operand=20, operators="+-*")
    first = task.generate(10, seed=7)
    assert first == task.generate(10, seed=7)
    assert first[4:] == task.generate(6, seed=7, start_index=4)
    assert task.example(9, seed=7) == first[9]
    assert first != task.generate(10, seed=8)
    assert [e.id for e in first] == list(range(10))


def test_plain_problems_follow_precedence():
    task = ArithmeticTask(num_terms=4, max_operand=9, operators="+-*")
    for example in task.generate(200, seed=0):
        expression = example.meta["expression"]  # e.g. "3 + 4 * 2"
        tokens = expression.split()
        # Independent check: fold products first, then sum signed terms.
        terms, sign, product = [], 1, int(tokens[0])
        for operator, operand in zip(tokens[1::2], tokens[2::2], strict=True):
            if operator == "*":
                product *= int(operand)
            else:
                terms.append(sign * product)
                sign, product = (1 if operator == "+" else -1), int(operand)
        terms.append(sign * product)
        assert example.answer == str(sum(terms))
        assert example.question == f"What is {expression}?"
        assert example.solution.endswith(f"#### {example.answer}")
        assert extract_answer(example.solution, mode="hash") == example.answer


def test_solution_format():
    task = ArithmeticTask(num_terms=3, operators="*")
    example = task.example(0, seed=0)
    a, b, c = (int(x) for x in example.meta["expression"].split(" * "))
    assert example.solution == f"{a}*{b}={a * b}\n{a * b}*{c}={a * b * c}\n#### {a * b * c}"


def test_word_problems_are_sequential_and_nonnegative():
    task = ArithmeticTask(num_terms=3, max_operand=9, operators="+-", word_problems=True)
    for example in task.generate(100, seed=1):
        assert example.question.endswith("have now?")
        assert int(example.answer) >= 0
        # Every step line "a+b=c" is arithmetic that holds.
        for line in example.solution.split("\n")[:-1]:
            left, result = line.split("=")
            a, b = numbers_in_text(left.replace("+", " + ").replace("-", " - "))
            assert int(result) == (int(a) + int(b) if "+" in left else int(a) - int(b))
        assert example.solution.endswith(f"#### {example.answer}")


def test_train_eval_split_has_no_shared_question():
    task = ArithmeticTask(num_terms=2, max_operand=9, operators="+")  # only 100 distinct questions
    train, evaluation = task.train_eval_split(50, 20, seed=0)
    assert len(train) == 50 and len(evaluation) == 20
    assert not {e.question for e in train} & {e.question for e in evaluation}
    assert len({e.question for e in evaluation}) == 20
    assert not {e.id for e in train} & {e.id for e in evaluation}
    assert (train, evaluation) == task.train_eval_split(50, 20, seed=0)
    with pytest.raises(ValueError, match="too few distinct problems"):
        task.train_eval_split(500, 100, seed=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_terms": 1}, "num_terms=1"),
        ({"max_operand": 0}, "max_operand=0"),
        ({"operators": "+/"}, "operators='\\+/'"),
        ({"operators": ""}, "operators=''"),
        ({"operators": "++"}, "operators='\\+\\+'"),
        ({"min_operand": -1}, "min_operand=-1"),
        ({"min_operand": 5, "max_operand": 3}, "max_operand=3"),
    ],
)
def test_bad_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


def test_bad_seed_and_index():
    with pytest.raises(ValueError, match="seed=-1"):
        ArithmeticTask().generate(1, seed=-1)
    with pytest.raises(ValueError, match="start_index=-2"):
        ArithmeticTask().generate(1, seed=0, start_index=-2)
