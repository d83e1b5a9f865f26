"""Checks of a run's prompts at load, before any model work: every prompt is tokenised, and one
longer than rollout.max_prompt_len is refused naming its file and line (or its example index)
or left out with a count (data.too_long); duplicate questions and eval / train overlap are
reported once, with counts."""

from __future__ import annotations

import collections
from typing import Callable, Sequence

from jrl.data import PromptExample


def describe_example(example: PromptExample, index: int) -> str:
    """Where an example came from: "FILE:LINE" (or "FILE row N") for a file's record, else its
    index and id."""
    meta = example.meta or {}
    if meta.get("where"):
        return meta["where"]
    return f"example index {index} (id {example.id!r})"


def fit_prompts(examples: Sequence[PromptExample], render: Callable[[PromptExample], list],
                *, max_prompt_len: int, too_long: str, split: str, env_name: str = "none"
                ) -> tuple[list[PromptExample], int]:
    """(the examples whose rendered prompt fits max_prompt_len tokens, how many were left out).

    render(example) -> prompt token ids (Task.render: in multi-turn runs the environment's first
    observation). too_long="error": ValueError naming the first prompt too long (file and line,
    or example index), its length and the limit; "skip": such examples are left out."""
    kept, skipped = [], 0
    source = f"env.name={env_name!r}: the first observation (the prompt)" \
        if env_name != "none" else "the prompt"
    for index, example in enumerate(examples):
        try:
            length = len(render(example))
        except ValueError as error:
            # A character the tokenizer lacks, a template field missing: say where.
            raise ValueError(f"{split} data, {describe_example(example, index)}: "
                             f"{error}") from error
        except Exception as error:  # noqa: BLE001 - a user environment's reset may raise anything
            raise ValueError(f"{split} data, {describe_example(example, index)}: rendering "
                             f"{source} failed: {type(error).__name__}: {error}") from error
        if length <= max_prompt_len:
            kept.append(example)
            continue
        if too_long == "skip":
            skipped += 1
            continue
        raise ValueError(f"{split} data, {describe_example(example, index)}: {source} has "
                         f"{length} tokens, more than rollout.max_prompt_len={max_prompt_len}; "
                         "raise rollout.max_prompt_len or set data.too_long='skip' to leave "
                         "such prompts out")
    return kept, skipped


def hygiene_warnings(train: Sequence[PromptExample], evals: Sequence[PromptExample]
                     ) -> list[str]:
    """One warning line each for duplicate questions in train and for eval questions that are
    also train questions (compared by question text, surrounding whitespace ignored); [] when
    the data is clean."""
    warnings = []
    counts = collections.Counter(e.question.strip() for e in train)
    repeats = sum(n - 1 for n in counts.values() if n > 1)
    if repeats:
        first = next(i for i, e in enumerate(train) if counts[e.question.strip()] > 1)
        warnings.append(f"warning: data: {repeats} of {len(train)} train examples repeat a "
                        f"question ({len(counts)} distinct); e.g. "
                        f"{describe_example(train[first], first)}")
    overlap = [i for i, e in enumerate(evals) if e.question.strip() in counts]
    if overlap:
        warnings.append(f"warning: data: {len(overlap)} of {len(evals)} eval questions are also "
                        "train questions (same text), so eval accuracy partly measures "
                        f"memorisation; e.g. {describe_example(evals[overlap[0]], overlap[0])}")
    return warnings
