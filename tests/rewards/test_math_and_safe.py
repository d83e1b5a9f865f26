import functools

import numpy as np
import pytest

from jrl.data import PromptExample
from jrl.rewards import RewardFunctionError, RewardResult, math_reward, safe_rewards

EXAMPLE = PromptExample(id=3, question="Natalia sold clips ...", answer="72")
GSM8K_RESPONSE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


def test_correct_gsm8k_response():
    result = math_reward(GSM8K_RESPONSE, EXAMPLE)
    assert result == RewardResult(reward=1.0, correct=True, extracted="72", format_ok=True)


def test_wrong_and_malformed_answers_get_zero():
    assert math_reward("#### 71", EXAMPLE).reward == 0.0
    for response in ["#### ", "#### abc", "no number at all", ""]:
        result = math_reward(response, EXAMPLE)
        assert result.reward == 0.0 and not result.correct and result.extracted is None


def test_equivalent_number_forms_are_correct():
    decimal_example = PromptExample(id=0, question="q", answer="3.5")
    assert math_reward("#### 3.50", decimal_example).correct
    assert math_reward("#### $3.50.", decimal_example).correct
    negative_example = PromptExample(id=0, question="q", answer="-1234")
    assert math_reward("The answer is -1,234.", negative_example).correct
    assert math_reward("so \\boxed{-1234}", negative_example).correct


def test_format_reward_and_penalty():
    # Correct but not in "####" form: 1 (correct) - 0.5 (penalty) = 0.5.
    result = math_reward("The answer is 72.", EXAMPLE, format_penalty=0.5)
    assert result.correct and not result.format_ok and result.reward == 0.5
    # Wrong but in "####" form: 0 + 0.1 = 0.1.
    result = math_reward("#### 70", EXAMPLE, format_reward=0.1)
    assert not result.correct and result.format_ok and result.reward == pytest.approx(0.1)
    # format_mode="boxed": only a boxed answer counts as formatted.
    assert not math_reward("#### 72", EXAMPLE, format_mode="boxed").format_ok


def test_mode_restricts_extraction():
    assert not math_reward("The answer is 72.", EXAMPLE, mode="hash").correct


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "x"}, "mode='x'"),
        ({"format_mode": "auto"}, "format_mode='auto'"),
        ({"format_reward": -1.0}, "format_reward=-1.0"),
        ({"format_penalty": float("nan")}, "format_penalty=nan"),
    ],
)
def test_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        math_reward("#### 72", EXAMPLE, **kwargs)


def test_non_numeric_reference_is_a_data_error():
    with pytest.raises(ValueError, match="id=9 has answer='seven'"):
        math_reward("#### 7", PromptExample(id=9, question="q", answer="seven"))


def test_safe_rewards_collects_results():
    examples = [EXAMPLE, EXAMPLE, PromptExample(id=4, question="q", answer="5")]
    rewards, info = safe_rewards(math_reward, ["#### 72", "#### 1", "\\boxed{5}"], examples)
    np.testing.assert_array_equal(rewards, np.array([1.0, 0.0, 1.0], np.float32))
    assert rewards.dtype == np.float32
    assert info["reward_errors"] == 0 and info["first_error"] is None
    np.testing.assert_array_equal(info["correct"], [True, False, True])
    np.testing.assert_array_equal(info["format_ok"], [True, True, False])
    assert info["extracted"] == ["72", "1", "5"]


def failing_on_boom(response, example):
    if "boom" in response:
        raise RuntimeError("verifier crashed")
    return 1.0


def test_raising_reward_function_is_counted_not_fatal():
    responses = ["fine", "boom", "fine", "boom"]
    examples = [PromptExample(id=i, question="q", answer="1") for i in range(4)]
    rewards, info = safe_rewards(failing_on_boom, responses, examples)
    np.testing.assert_array_equal(rewards, [1.0, 0.0, 1.0, 0.0])
    assert info["reward_errors"] == 2
    assert info["error_indices"] == [1, 3]
    assert info["first_error"] == "index 1 (example id 1): RuntimeError: verifier crashed"
    assert info["correct"] is None  # a float-returning function does not report correctness


def test_raise_errors_stops_at_the_first_failure():
    examples = [PromptExample(id=i, question="q", answer="1") for i in range(2)]
    with pytest.raises(RewardFunctionError, match="index 1 \\(example id 1\\)") as caught:
        safe_rewards(failing_on_boom, ["fine", "boom"], examples, raise_errors=True)
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), "1.0", None, 1e30, -2e6])
def test_unusable_return_values_are_errors(bad_value):
    rewards, info = safe_rewards(lambda response, example: bad_value, ["a"], [EXAMPLE])
    assert rewards[0] == 0.0 and info["reward_errors"] == 1


def test_partial_options_and_length_mismatch():
    strict = functools.partial(math_reward, mode="hash", format_penalty=1.0)
    rewards, _ = safe_rewards(strict, ["The answer is 72"], [EXAMPLE])
    assert rewards[0] == -1.0  # not correct in hash mode (0) minus the format penalty (1)
    with pytest.raises(ValueError, match="2 responses and 1 examples"):
        safe_rewards(math_reward, ["a", "b"], [EXAMPLE])
