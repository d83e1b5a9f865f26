"""Held-out accuracy of the current weights: greedy and sampled, verifier and format-free."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jrl.data import PromptExample
from jrl.metrics import names
from jrl.rewards import extract_last_number, numbers_equal
from jrl.sampling import Sample, Sampler

EVAL_REQUEST_BASE = 10**9     # eval prompt ids: far from any training prompt id


def evaluate(params: Any, examples: list[PromptExample], *, render: Callable,
             decode: Callable[[Sample], str], reward_fn: Callable, version: int,
             greedy: Sampler | None = None, sampled: Sampler | None = None) -> dict:
    """eval/accuracy_greedy (with `greedy`), eval/accuracy_sampled (with `sampled`, one sample
    per prompt), each also format-free (*_last_number: the response's last number equals the
    answer), and eval/accuracy (greedy if run, else sampled). {} without examples.

    A response is correct when reward_fn(text, example) has .correct true, or returns a number
    > 0.
    """
    if not examples:
        return {}
    requests = [(EVAL_REQUEST_BASE + i, render(e)) for i, e in enumerate(examples)]
    runs = [(name, sampler) for name, sampler in ((names.EVAL_ACCURACY_GREEDY, greedy),
                                                  (names.EVAL_ACCURACY_SAMPLED, sampled))
            if sampler is not None]
    out = {}
    for name, sampler in runs:
        samples = sampler.generate(params, requests, version=version, group_size=1)
        correct, last_number = [], []
        for sample, example in zip(samples, examples):
            text = decode(sample)
            result = reward_fn(text, example)
            correct.append(bool(result.correct) if hasattr(result, "correct")
                           else float(result) > 0)
            # Format-free: the response's last number, wherever it stands, so a gain that is
            # only the answer format shows as a gap between the two figures.
            last_number.append(numbers_equal(extract_last_number(text), example.answer))
        out[name] = float(np.mean(correct))
        out[name + "_last_number"] = float(np.mean(last_number))
    if out:
        out[names.EVAL_ACCURACY] = out.get(names.EVAL_ACCURACY_GREEDY,
                                           out.get(names.EVAL_ACCURACY_SAMPLED))
    return out
