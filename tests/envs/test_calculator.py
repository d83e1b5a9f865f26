import pytest

from jrl.data import PromptExample
from jrl.envs import CalculatorEnv, Environment, StepResult, make_environment
from jrl.envs.calculator import format_number

EXAMPLE = PromptExample(id=0, question="What is 3 + 4?", answer="7")


def _env(**options) -> CalculatorEnv:
    env = CalculatorEnv(**options)
    assert env.reset(EXAMPLE) == "What is 3 + 4?"
    return env


def test_is_an_environment():
    assert isinstance(make_environment("calculator"), CalculatorEnv)
    env: Environment = CalculatorEnv()  # satisfies the protocol (checked by type checkers)
    assert hasattr(env, "reset") and hasattr(env, "step")


@pytest.mark.parametrize("action, observation", [
    ("calc((1+2)*3)", "9"),                                 # 3 * 3
    ("calc(7/2)", "3.5"),
    ("calc(6/3)", "2"),                                     # 2.0 is a whole number: shown as 2
    ("calc(1/3)", "0.3333333333333333"),                    # repr: the shortest exact text
    ("calc(2**10)", "1024"),
    ("calc(-7 // 2)", "-4"),                                # floor of -3.5
    ("First 3 + 4: calc(3 + 4)", "7"),
    ("calc(1+1) and then calc((2+3)*(4-1)) please", "15"),  # the last call: 5 * 3
    ("calc( 12 * (3 + 4) )", "84"),                         # 12 * 7
])
def test_tool_calls(action, observation):
    assert _env().step(action) == StepResult(observation=observation, tool_call=True)


@pytest.mark.parametrize("action, reason", [
    ("calc(1/0)", "error: ZeroDivisionError: division by zero"),
    ("calc((1+2)", "error: unbalanced parentheses"),
    ("calc(x + 1)", "error: names are not allowed in arithmetic"),
    ("calc(__import__('os'))", "error: function calls are not allowed in arithmetic"),
    ("calc(9**9**9)", "error: an integer would have 387420489 bits"),  # 9 ** 9 = 387420489
    ("calc(2**1000)", "error: the result has 302 characters, more than 64"),
    ("calc(1e308 * 10)", "error: the result is not a finite number (inf)"),
    ("calc()", "error: invalid syntax: the expression is empty"),
    ("calc(1 +)", "error: invalid syntax at line 1"),
    ("calc(2 ^ 3)", "error: the ^ operator is not allowed"),
])
def test_tool_errors_are_observed(action, reason):
    result = _env().step(action)
    assert result.observation.startswith(reason), result.observation
    assert result.tool_call and result.tool_error and not result.done
    assert result.reward == 0.0


def test_error_observation_is_cut_to_max_observation_chars():
    result = _env(max_observation_chars=20).step("calc(x + 1)")
    assert result.observation == "error: names are ..."  # 17 characters + "..."
    assert len(result.observation) == 20


def test_final_answer_is_graded():
    right = _env().step("3 + 4 = 7, so the answer is 7.")
    assert right == StepResult(observation="", reward=1.0, done=True)
    wrong = _env().step("The answer is 8.")
    assert wrong == StepResult(observation="", reward=0.0, done=True)


def test_reward_mode_is_used():
    # "hash" needs "#### N": a bare number is not an answer in that format.
    assert _env(reward_mode="hash").step("The answer is 7").reward == 0.0
    assert _env(reward_mode="hash").step("#### 7").reward == 1.0


def test_episode():
    env = _env()
    assert env.step("Compute calc(3+4)").observation == "7"
    assert env.step("#### 7").reward == 1.0


@pytest.mark.parametrize("options, fragment", [
    ({"reward_mode": "bogus"}, "reward_mode='bogus' is not allowed; allowed:"),
    ({"max_observation_chars": 0}, "max_observation_chars=0"),
    ({"limits": {"max_steps": 10}}, "limits="),
])
def test_options_are_validated(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        CalculatorEnv(**options)


def test_step_before_reset_raises():
    with pytest.raises(RuntimeError, match="before reset"):
        CalculatorEnv().step("calc(1)")


def test_make_environment():
    env = make_environment("calculator", reward_mode="hash", max_observation_chars=32)
    assert (env.reward_mode, env.max_observation_chars) == ("hash", 32)
    with pytest.raises(ValueError, match=r"name='abacus' is not allowed; allowed names: "
                                         r"\('calculator', 'python'\)"):
        make_environment("abacus")


@pytest.mark.parametrize("value, text", [
    (9, "9"), (-4, "-4"), (2.0, "2"), (-0.0, "0"), (3.5, "3.5"),
    (0.1 + 0.2, "0.30000000000000004"),
    (2.0**53, "9007199254740992.0"),   # not below 2**53: shown as a float
    (1e20 / 3, "3.333333333333333e+19"),
])
def test_format_number(value, text):
    assert format_number(value) == text


def test_format_number_refuses_non_finite():
    with pytest.raises(ValueError, match="not a finite number"):
        format_number(float("nan"))


def test_demonstration_turns_each_solution_line_into_a_calculator_call():
    from jrl.pipeline.rollout.episodes import demonstrate
    example = PromptExample(id=3, question="What is 8 + 6 + 5?", answer="19",
                            solution="8+6=14\n14+5=19\n#### 19")
    env = CalculatorEnv()
    assert env.demonstration(example) == ["calc(8+6)", "calc(14+5)", "#### 19"]
    # Run through the environment: 8+6 -> "14", 14+5 -> "19", then the graded answer.
    assert demonstrate(CalculatorEnv(), example, env.demonstration(example)) == [
        ("model", "calc(8+6)"), ("observation", "14"), ("model", "calc(14+5)"),
        ("observation", "19"), ("model", "#### 19")]


def test_demonstration_needs_a_worked_solution():
    with pytest.raises(ValueError, match="no worked solution"):
        CalculatorEnv().demonstration(PromptExample(id=4, question="q", answer="1"))


def test_a_complex_result_is_an_error_observation():
    env = CalculatorEnv()
    env.reset(PromptExample(id=0, question="q", answer="1"))
    # (-1)**0.5 is 1j in Python: not a number the calculator shows.
    assert env.step("calc((-1)**0.5)").observation == "error: the result is not a real number"
