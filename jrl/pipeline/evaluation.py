"""Held-out accuracy of the current weights: greedy and sampled, verifier and format-free."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jrl.data import PromptExample
from jrl.metrics import names
from jrl.rewards import extract_last_number, numbers_equal, safe_rewards
from jrl.sampling import Sample, Sampler

EVAL_REQUEST_BASE = 10**9     # eval prompt ids: far from any training prompt id


def evaluate(params: Any, examples: list[PromptExample], *, render: Callable,
             decode: Callable[[Sample], str], reward_fn: Callable, version: int,
             greedy: Sampler | None = None, sampled: Sampler | None = None,
             raise_reward_errors: bool = False) -> dict:
    """eval/accuracy_greedy (with `greedy`), eval/accuracy_sampled (with `sampled`, one sample
    per prompt), each also format-free (*_last_number: the response's last number equals the
    answer), eval/accuracy (greedy if run, else sampled) and eval/reward_errors. {} without
    examples.

    The reward function runs under the rollout's guard (jrl.rewards.safe_rewards): a call that
    raises or returns a non-number counts as wrong and in eval/reward_errors, unless
    raise_reward_errors. A response is correct when the RewardResult says so, or, for a plain
    float reward, when it is > 0.
    """
    if not examples:
        return {}
    requests = [(EVAL_REQUEST_BASE + i, render(e)) for i, e in enumerate(examples)]
    runs = [(name, sampler) for name, sampler in ((names.EVAL_ACCURACY_GREEDY, greedy),
                                                  (names.EVAL_ACCURACY_SAMPLED, sampled))
            if sampler is not None]
    out: dict = {}
    errors = 0
    for name, sampler in runs:
        samples = sampler.generate(params, requests, version=version, group_size=1)
        texts = [decode(sample) for sample in samples]
        rewards, info = safe_rewards(reward_fn, texts, examples, raise_errors=raise_reward_errors)
        correct = info["correct"]
        if correct is None:     # plain float rewards: failed calls are 0, so not > 0
            correct = np.asarray(rewards) > 0
        out[name] = float(np.mean(correct))
        # Format-free: the response's last number, wherever it stands, so a gain that is only
        # the answer format shows as a gap between the two figures.
        out[name + "_last_number"] = float(np.mean(
            [numbers_equal(extract_last_number(text), example.answer)
             for text, example in zip(texts, examples)]))
        errors += int(info["reward_errors"])
    if runs:
        out[names.EVAL_ACCURACY] = out.get(names.EVAL_ACCURACY_GREEDY,
                                           out.get(names.EVAL_ACCURACY_SAMPLED))
        out[names.EVAL_REWARD_ERRORS] = errors
    return out
