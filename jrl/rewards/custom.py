"""A user's own reward function, named in the config or given in code.

    def my_reward(response: str, example: PromptExample, token_ids: list[int]) -> float | dict

`response` is the decoded response text (stop ids dropped), `example` the prompt record
(jrl.data.PromptExample: id, question, answer, solution, meta with the source record's other
fields), `token_ids` the response's token ids (optional: a function with two parameters is
called with two). It returns a float, a RewardResult, or a dict of named rewards
{name: float}: the reward is then sum_name weight[name] * value[name] (weight 1 for a name the
weights do not list), and each name's mean is logged as rollout/reward_part/<name>.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple


class NamedRewards(NamedTuple):
    """A reward made of named parts: reward = sum_name weights[name] * parts[name]."""

    reward: float
    parts: dict[str, float]


def accepts_token_ids(fn: Callable) -> bool:
    """Whether fn can be called as fn(response, example, token_ids): a third positional
    parameter, a parameter named token_ids, or *args / **kwargs."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # builtins without a signature: two arguments
        return False
    positional = 0
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "token_ids":
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional += 1
    return positional >= 3


def check_reward_signature(key: str, fn: Any) -> None:
    """ValueError naming `key` unless fn is callable with (response, example) or (response,
    example, token_ids) positionally."""
    if not callable(fn):
        raise ValueError(f"{key}: names a {type(fn).__name__}, not a function "
                         "(response, example[, token_ids]) -> float | dict")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind("response", "example")
    except TypeError as two_error:
        try:
            signature.bind("response", "example", "token_ids")
            return
        except TypeError:
            error = two_error
        raise ValueError(f"{key}: {getattr(fn, '__name__', fn)!s}{signature} cannot be called "
                         f"as fn(response, example[, token_ids]) ({error})") from None


def parse_weights(key: str, text: str) -> dict[str, float]:
    """Reward-part weights written "name=weight[,name=weight]" ("" is none), e.g.
    "correct=1,format=0.1". ValueError naming `key` for an item that is not name=number, a
    weight that is not a finite number, or a name given twice."""
    weights: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, equals, value = (part.strip() for part in item.partition("="))
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not equals or not name or not math.isfinite(weight):
            raise ValueError(f"{key}={text!r}: {item!r} is not name=weight with a finite "
                             "number (e.g. correct=1,format=0.1)")
        if name in weights:
            raise ValueError(f"{key}={text!r}: {name!r} is given twice")
        weights[name] = weight
    return weights


class CustomReward:
    """fn wrapped as jrl's reward protocol: called with token_ids when fn takes them; a dict
    return becomes NamedRewards weighted by `weights`. A weight naming a part fn did not return
    is an error for that call (a misspelt weight would otherwise weigh nothing)."""

    def __init__(self, fn: Callable, weights: Mapping[str, float] | None = None, *,
                 key: str = "reward_fn", weights_key: str = "reward_weights"):
        check_reward_signature(key, fn)
        self.fn, self.weights = fn, dict(weights or {})
        self.key, self.weights_key = key, weights_key
        self.takes_token_ids = accepts_token_ids(fn)

    def __call__(self, response: str, example: Any, token_ids: Any = None) -> Any:
        if self.takes_token_ids:
            value = self.fn(response, example, [] if token_ids is None else list(token_ids))
        else:
            value = self.fn(response, example)
        if not isinstance(value, Mapping):
            if self.weights:
                raise ValueError(f"returned {type(value).__name__} {value!r}, but "
                                 f"{self.weights_key} weighs named parts: return a dict")
            return value
        parts = {}
        for name, part in value.items():
            if not isinstance(name, str) or isinstance(part, bool) \
                    or not isinstance(part, numbers.Real):
                raise ValueError(f"returned the part {name!r}: {part!r}; a dict must map names "
                                 "to numbers")
            parts[name] = float(part)
        unknown = sorted(set(self.weights) - set(parts))
        if unknown:
            raise ValueError(f"{self.weights_key} names {unknown}, which the reward function "
                             f"did not return (it returned {sorted(parts)})")
        return NamedRewards(sum(self.weights.get(n, 1.0) * v for n, v in parts.items()), parts)
