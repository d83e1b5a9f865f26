"""A user's own reward (jrl.rewards.custom): token ids where the function takes them, named
parts summed with weights, and every failure a counted reward error naming what was wrong."""

import numpy as np
import pytest

from jrl.data import PromptExample
from jrl.rewards import RewardResult, safe_rewards
from jrl.rewards.custom import (CustomReward, NamedRewards, accepts_token_ids,
                                check_reward_signature, parse_weights)

EXAMPLE = PromptExample(id=3, question="1+1", answer="2")


def test_token_ids_reach_a_function_that_takes_them_and_not_one_that_does_not():
    seen = []

    def three(response, example, token_ids):
        seen.append(token_ids)
        return float(len(token_ids))

    def two(response, example):
        return 0.5

    assert accepts_token_ids(three) and not accepts_token_ids(two)
    assert accepts_token_ids(lambda response, example, **kw: 0.0)
    rewards, _ = safe_rewards(CustomReward(three), ["a", "bc"], [EXAMPLE] * 2,
                              token_ids=[[5], [6, 7]])
    assert rewards.tolist() == [1.0, 2.0] and seen == [[5], [6, 7]]
    rewards, _ = safe_rewards(CustomReward(two), ["a"], [EXAMPLE], token_ids=[[5]])
    assert rewards.tolist() == [0.5]


def test_named_parts_are_summed_with_their_weights_and_reported():
    def graded(response, example):
        return {"correct": float(response == example.answer), "format": 0.5}

    reward = CustomReward(graded, {"format": 0.2})
    # "2": correct 1 (weight 1, not listed) + format 0.5 * 0.2 = 1.1; "3": 0 + 0.1 = 0.1.
    value = reward("2", EXAMPLE)
    assert isinstance(value, NamedRewards) and value.parts == {"correct": 1.0, "format": 0.5}
    rewards, info = safe_rewards(reward, ["2", "3"], [EXAMPLE] * 2)
    assert rewards.tolist() == pytest.approx([1.1, 0.1])
    assert info["parts"]["correct"].tolist() == [1.0, 0.0]
    assert info["parts"]["format"].tolist() == [0.5, 0.5]


def test_a_bad_return_is_a_counted_error_that_says_what_was_wrong():
    def parts_by_length(response, example):
        return {"short": 1.0} if len(response) < 3 else {"long": "yes"}

    reward = CustomReward(parts_by_length)
    rewards, info = safe_rewards(reward, ["ab", "abcd"], [EXAMPLE] * 2)
    assert rewards.tolist() == [1.0, 0.0] and info["reward_errors"] == 1
    assert "part 'long': 'yes'" in info["first_error"]
    # The failed row's parts are missing (NaN), not zero.
    assert np.isnan(info["parts"]["short"][1])

    misspelt = CustomReward(lambda response, example: {"correct": 1.0}, {"corect": 2.0},
                            weights_key="rollout.reward_weights")
    _, info = safe_rewards(misspelt, ["x"], [EXAMPLE])
    assert info["reward_errors"] == 1
    assert "rollout.reward_weights names ['corect'], which the reward function did not return " \
           "(it returned ['correct'])" in info["first_error"]
    weighted_float = CustomReward(lambda response, example: 1.0, {"correct": 2.0})
    _, info = safe_rewards(weighted_float, ["x"], [EXAMPLE])
    assert "weighs named parts: return a dict" in info["first_error"]


def test_a_float_or_reward_result_passes_through_unchanged():
    result = RewardResult(reward=1.0, correct=True, extracted="2", format_ok=True)
    reward = CustomReward(lambda response, example: result)
    rewards, info = safe_rewards(reward, ["2"], [EXAMPLE])
    assert rewards.tolist() == [1.0] and info["correct"].tolist() == [True]
    assert info["parts"] == {}


def test_a_function_that_cannot_take_response_and_example_is_refused_at_setup():
    with pytest.raises(ValueError, match=r"rollout\.reward_fn: one\(response\) cannot be called "
                                         r"as fn\(response, example"):
        def one(response):
            return 0.0
        check_reward_signature("rollout.reward_fn", one)
    with pytest.raises(ValueError, match="names a int, not a function"):
        CustomReward(3, key="rollout.reward_fn")


@pytest.mark.parametrize("text", ["correct", "correct=", "=1", "correct=yes", "a=inf",
                                  "a=nan"])
def test_weights_are_name_equals_a_finite_number(text):
    with pytest.raises(ValueError, match=r"rollout\.reward_weights=.* is not name=weight"):
        parse_weights("rollout.reward_weights", text)


def test_weights_parse_and_a_name_given_twice_is_refused():
    assert parse_weights("w", "") == {}
    assert parse_weights("w", " correct=1, format=0.1 ") == {"correct": 1.0, "format": 0.1}
    with pytest.raises(ValueError, match="'a' is given twice"):
        parse_weights("w", "a=1,a=2")
