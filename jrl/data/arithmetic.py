"""Synthetic arithmetic prompts: difficulty set by a few knobs, data that never runs out.

Example `index` under `seed` is a pure function of (task knobs, seed, index): it is drawn from
numpy's PCG64 seeded with SeedSequence([seed, index]) and nothing else, so any data position can
be regenerated on resume or on another host without generating what came before.

Plain problems ("What is 3 + 4 * 2?") follow the usual precedence (* before + and -, then left to
right). Word problems are a short story told in order, so they are evaluated left to right.
The solution, used as an SFT target, writes one operation per line and ends in "#### <answer>":

    plain "What is 3 + 4 * 2?"   ->  "4*2=8\\n3+8=11\\n#### 11"
    word  "Tom has 3 apples. He buys 4 more. How many apples does Tom have now?"
                                   ->  "3+4=7\\n#### 7"
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jrl.data.examples import PromptExample

ALLOWED_OPERATORS = "+-*"

_NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Ivy")
_PRONOUNS = {
    "Tom": "He",
    "Sam": "He",
    "Leo": "He",
    "Ben": "He",
    "Mia": "She",
    "Ana": "She",
    "Zoe": "She",
    "Ivy": "She",
}
_ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "coins", "shells", "books")
# One phrase per operator; {pronoun} starts the sentence, {operand} is the number.
_WORD_STEPS = {
    "+": (
        "{pronoun} buys {operand} more.",
        "{pronoun} finds {operand} more.",
        "A friend gives {object} {operand} more.",
    ),
    "-": (
        "{pronoun} gives away {operand}.",
        "{pronoun} loses {operand}.",
        "{pronoun} sells {operand}.",
    ),
    "*": ("Then the number {pronoun_lower} has becomes {operand} times as large.",),
}
_OBJECT_PRONOUNS = {"He": "him", "She": "her"}


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Generator of arithmetic problems over non-negative integer operands.

    Attributes:
      num_terms: operands per problem, >= 2.
      max_operand: operands are drawn uniformly from [min_operand, max_operand].
      min_operand: >= 0 and <= max_operand.
      operators: the operators to draw from, a non-empty subset of "+-*" (each at most once).
      word_problems: wrap problems in short stories ("Tom has 3 apples. He buys 4 more. ...").
        In stories a subtraction never takes more than is there: its operand is capped at the
        running total, so answers stay >= 0 (plain problems may have negative answers).
    """

    num_terms: int = 2
    max_operand: int = 9
    operators: str = "+-"
    word_problems: bool = False
    min_operand: int = 0

    def __post_init__(self) -> None:
        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not is_int(self.num_terms) or self.num_terms < 2:
            raise ValueError(
                f"ArithmeticTask: num_terms={self.num_terms!r} is not allowed; "
                "it must be an int >= 2."
            )
        if not is_int(self.min_operand) or self.min_operand < 0:
            raise ValueError(
                f"ArithmeticTask: min_operand={self.min_operand!r} is not allowed; "
                "it must be an int >= 0."
            )
        if not is_int(self.max_operand) or self.max_operand < max(self.min_operand, 1):
            raise ValueError(
                f"ArithmeticTask: max_operand={self.max_operand!r} is not allowed; "
                "it must be an int >= 1 "
                f"and >= min_operand={self.min_operand}."
            )
        if (
            not isinstance(self.operators, str)
            or not self.operators
            or any(op not in ALLOWED_OPERATORS for op in self.operators)
            or len(set(self.operators)) != len(self.operators)
        ):
            raise ValueError(
                f"ArithmeticTask: operators={self.operators!r} is not allowed; "
                "it must be a non-empty "
                f"string of distinct characters from {ALLOWED_OPERATORS!r}."
            )
        if not isinstance(self.word_problems, bool):
            raise ValueError(
                f"ArithmeticTask: word_problems={self.word_problems!r} is not allowed; "
                "it must be a bool."
            )

    def example(self, index: int, *, seed: int) -> PromptExample:
        """Example number `index` (>= 0) of the stream `seed` (>= 0)."""
        _check_nonnegative_int("seed", seed)
        _check_nonnegative_int("index", index)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, index])))
        operands = [
            int(x)
            for x in rng.integers(self.min_operand, self.max_operand + 1, size=self.num_terms)
        ]
        operators = [
            self.operators[int(i)]
            for i in rng.integers(0, len(self.operators), size=self.num_terms - 1)
        ]
        meta = {"task": "arithmetic", "seed": seed, "index": index}
        if self.word_problems:
            question, steps, answer = self._story(operands, operators, rng)
        else:
            expression = " ".join(_interleave(operands, operators))
            question = f"What is {expression}?"
            steps, answer = _evaluate_with_precedence(operands, operators)
            meta["expression"] = expression
        solution = "\n".join([*steps, f"#### {answer}"])
        return PromptExample(
            id=index, question=question, answer=str(answer), solution=solution, meta=meta
        )

    def generate(self, n: int, *, seed: int, start_index: int = 0) -> list[PromptExample]:
        """Examples start_index, ..., start_index + n - 1 of the stream `seed`."""
        _check_nonnegative_int("n", n)
        _check_nonnegative_int("start_index", start_index)
        return [self.example(index, seed=seed) for index in range(start_index, start_index + n)]

    def train_eval_split(
        self, num_train: int, num_eval: int, *, seed: int, max_draws_per_eval: int = 100
    ) -> tuple[list[PromptExample], list[PromptExample]]:
        """A training set and an evaluation set with no question in common.

        Train is indices [0, num_train) of stream `seed`. Eval takes indices num_train, num_train+1,
        ... of the same stream, skipping any question that is in train or already in eval (small
        tasks repeat questions often: 2 terms over 0..9 with "+-" have only 200). Eval example ids
        are their stream indices, so they stay unique across both sets.

        Raises:
          ValueError: fewer than num_eval unseen questions turned up in
            max_draws_per_eval * num_eval draws (the task's problem space is too small).
        """
        _check_nonnegative_int("num_train", num_train)
        _check_nonnegative_int("num_eval", num_eval)
        train = self.generate(num_train, seed=seed)
        seen = {example.question for example in train}
        evaluation: list[PromptExample] = []
        max_draws = max_draws_per_eval * num_eval
        index = num_train
        while len(evaluation) < num_eval:
            if index - num_train >= max_draws:
                raise ValueError(
                    f"ArithmeticTask.train_eval_split: found only {len(evaluation)} of "
                    f"num_eval={num_eval} questions unseen in training after {max_draws} draws; "
                    f"the task ({self}) has too few distinct problems. Raise max_operand or "
                    "num_terms, or lower num_train/num_eval."
                )
            example = self.example(index, seed=seed)
            if example.question not in seen:
                seen.add(example.question)
                evaluation.append(example)
            index += 1
        return train, evaluation

    def _story(
        self, operands: list[int], operators: list[str], rng: np.random.Generator
    ) -> tuple[str, list[str], int]:
        name = _NAMES[int(rng.integers(len(_NAMES)))]
        item = _ITEMS[int(rng.integers(len(_ITEMS)))]
        pronoun = _PRONOUNS[name]
        total = operands[0]
        sentences = [f"{name} has {total} {item}."]
        steps = []
        for operator, operand in zip(operators, operands[1:], strict=True):
            if operator == "-":
                operand = min(operand, total)
            templates = _WORD_STEPS[operator]
            template = templates[int(rng.integers(len(templates)))]
            sentences.append(
                template.format(
                    pronoun=pronoun,
                    pronoun_lower=pronoun.lower(),
                    object=_OBJECT_PRONOUNS[pronoun],
                    operand=operand,
                )
            )
            result = _apply(total, operator, operand)
            steps.append(f"{total}{operator}{operand}={result}")
            total = result
        sentences.append(f"How many {item} does {name} have now?")
        return " ".join(sentences), steps, total


def _check_nonnegative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(
            f"ArithmeticTask: {name}={value!r} is not allowed; it must be an int >= 0."
        )


def _interleave(operands: list[int], operators: list[str]) -> list[str]:
    tokens = [str(operands[0])]
    for operator, operand in zip(operators, operands[1:], strict=True):
        tokens += [operator, str(operand)]
    return tokens


def _apply(left: int, operator: str, right: int) -> int:
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    return left * right


def _evaluate_with_precedence(operands: list[int], operators: list[str]) -> tuple[list[str], int]:
    """(one line per operation, value) of `operands` joined by `operators`.

    * binds first, then + and - apply left to right.
    """
    steps = []
    values, pending = [operands[0]], []  # after the * pass: values[0] pending[0] values[1] ...
    for operator, operand in zip(operators, operands[1:], strict=True):
        if operator == "*":
            product = values[-1] * operand
            steps.append(f"{values[-1]}*{operand}={product}")
            values[-1] = product
        else:
            pending.append(operator)
            values.append(operand)
    total = values[0]
    for operator, operand in zip(pending, values[1:], strict=True):
        result = _apply(total, operator, operand)
        steps.append(f"{total}{operator}{operand}={result}")
        total = result
    return steps, total
