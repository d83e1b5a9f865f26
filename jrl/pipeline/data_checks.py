"""Checks of a run's prompts at load, before any model work: every prompt is tokenised, and one
longer than rollout.max_prompt_len is refused naming its file and line (or its example index)
or left out with a count (data.too_long); duplicate questions and eval / train overlap are
reported once, with counts."""

from __future__ import annotations

from typing import Callable, Sequence

from jrl.data import PromptExample


def describe_example(example: PromptExample, index: int) -> str:
    """Where an example came from: "FILE:LINE" for a file's record, else its index and id."""
    meta = example.meta or {}
    if meta.get("source") and meta.get("line") is not None:
        return f"{meta['source']}:{meta['line']}"
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
        except ValueError:
            raise
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
