"""The prompt record every data source produces."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt with its reference answer.

    Attributes:
      id: index of the example within its source (line order for jsonl, index for synthetic tasks).
      question: the problem text, without any prompt template.
      answer: the reference final answer in canonical number form (jrl.rewards.numbers), e.g. "18",
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
