"""The prompt record every data source produces."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt with its reference answer.

    Attributes:
      id: index of the example within its source (line order for jsonl, index for synthetic tasks).
      question: the problem text, without any prompt template.
      answer: the reference final answer in canonical number form (jrl.data.numbers), e.g. "18",
        "-3", "3.5"; this is what verifiers compare against.
      solution: a full worked solution ending in "#### <answer>" (the SFT warm-start target), or
        None when the source has none.
      meta: source-specific details (split, line number, generator seed and index, ...).
    """

    id: int
    question: str
    answer: str
    solution: str | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


def with_wrong_final_answers(examples: list[PromptExample], fraction: float, *,
                             seed: int) -> list[PromptExample]:
    """A copy of `examples` in which a `fraction` of the worked solutions end in a wrong answer.

    For each example, independently with probability `fraction` (a draw from numpy's PCG64 seeded
    with (seed, example.id), so the choice does not depend on list order), the solution's final
    "#### N" line becomes "#### N+1" (the worked steps above it are kept). Only `solution` (the
    warm-start target) changes; `answer`, which rewards and evaluation use, stays true. A warm start
    on such data gives a policy with a systematic bad habit that only the reward can remove: the
    setting in which RL, not supervised data, does the lifting. Examples without a solution, or
    whose answer is not an integer, are kept as they are.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"with_wrong_final_answers: fraction={fraction!r} must be in [0, 1]")
    out = []
    for example in examples:
        solution = example.solution
        head, marker, tail = (solution or "").rpartition("#### ")
        draw = np.random.default_rng([seed, example.id]).random()
        if marker and tail.strip().lstrip("-").isdigit() and draw < fraction:
            example = dataclasses.replace(example, solution=f"{head}#### {int(tail) + 1}")
        out.append(example)
    return out
