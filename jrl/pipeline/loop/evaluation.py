"""Held-out accuracy of the current weights: greedy and sampled, verifier and format-free."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jrl.data import PromptExample
from jrl.metrics import names
from jrl.stop_request import check_stop
from jrl.pipeline.rollout.task import Task
from jrl.rewards import extract_last_number, numbers_equal
from jrl.sampling import Sample, Sampler

EVAL_REQUEST_BASE = 10**9     # eval prompt ids: far from any training prompt id


def evaluate(params: Any, examples: list[PromptExample], *, task: Task, version: int,
             greedy: Sampler | None = None, sampled: Sampler | None = None) -> dict:
    """eval/accuracy_greedy (with `greedy`), eval/accuracy_sampled (with `sampled`, one sample
    per prompt), each also format-free (*_last_number: the response's last number equals the
    answer), eval/accuracy (greedy if run, else sampled) and eval/reward_errors. {} without
    examples.

    The task's reward function runs under its error policy (Task.rewards): a call that raises
    or returns a non-number counts as wrong and in eval/reward_errors, unless the task raises
    reward errors. A response is correct when the RewardResult says so, or, for a plain float
    reward, when it is > 0.

    A multi-turn task's episodes are graded by their environment (correct when the episode's
    reward is > 0; the format-free figure reads the model's tokens only, never an
    observation), plus eval/tool_calls_mean.

    A stop request (jrl.stop_request) is checked between the samplers' device calls.
    """
    if not examples:
        return {}
    requests = [(EVAL_REQUEST_BASE + i, task.render(e)) for i, e in enumerate(examples)]
    runs = [(name, sampler) for name, sampler in ((names.EVAL_ACCURACY_GREEDY, greedy),
                                                  (names.EVAL_ACCURACY_SAMPLED, sampled))
            if sampler is not None]
    out: dict = {}
    errors = 0
    tool_calls = {}
    for name, sampler in runs:
        if not task.multi_turn:
            samples = sampler.generate(params, requests, version=version, group_size=1,
                                       poll_weights=_check_stop_between_calls)
            texts = [task.decode(sample) for sample in samples]
            rewards, info = task.rewards(texts, examples, token_ids=task.ids_for(samples))
            correct = info["correct"]
            if correct is None:     # plain float rewards: failed calls are 0, so not > 0
                correct = np.asarray(rewards) > 0
            errors += int(info["reward_errors"])
        else:
            driver = task.episode_driver(lambda prompt_id: examples[prompt_id - EVAL_REQUEST_BASE])
            try:
                samples = [driver.finish(s) for s in sampler.generate(
                    params, requests, version=version, group_size=1, on_turn=driver.on_turn,
                    poll_weights=_check_stop_between_calls)]
            finally:
                driver.close()
            texts = [task.decode(model_tokens_only(s)) for s in samples]
            correct = np.asarray([s.episode.reward > 0 for s in samples])
            tool_calls[name] = float(np.mean([s.episode.tool_calls for s in samples]))
        out[name] = float(np.mean(correct))
        # Format-free: the response's last number, wherever it stands, so a gain that is only
        # the answer format shows as a gap between the two figures.
        out[name + "_last_number"] = float(np.mean(
            [numbers_equal(extract_last_number(text), example.answer)
             for text, example in zip(texts, examples)]))
    if runs:
        out[names.EVAL_ACCURACY] = out.get(names.EVAL_ACCURACY_GREEDY,
                                           out.get(names.EVAL_ACCURACY_SAMPLED))
        out[names.EVAL_REWARD_ERRORS] = errors
        if tool_calls:
            out[names.EVAL_TOOL_CALLS_MEAN] = tool_calls.get(names.EVAL_ACCURACY_GREEDY,
                                                             tool_calls.get(
                                                                 names.EVAL_ACCURACY_SAMPLED))
    return out


def _check_stop_between_calls() -> None:
    """A sampler's poll_weights hook that swaps no weights: it is the eval's stop check point."""
    check_stop()


def model_tokens_only(sample: Sample) -> Sample:
    """The sample with its observation tokens left out (for grading what the model wrote)."""
    mask = sample.model_token_mask()
    return dataclasses.replace(sample, tokens=sample.tokens[mask], model_mask=None,
                               behavior_logp=sample.behavior_logp[mask],
                               logit_floor=sample.logit_floor[mask],
                               versions=sample.versions[mask], entropy=None)
