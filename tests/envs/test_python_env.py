import pytest

from jrl.data import PromptExample
from jrl.envs import PythonEnv, SandboxLimits, StepResult, make_environment
from jrl.envs.python_env import last_code_block

EXAMPLE = PromptExample(id=0, question="What is 3 + 4?", answer="7")


def _env(**options) -> PythonEnv:
    env = PythonEnv(**options)
    assert env.reset(EXAMPLE) == "What is 3 + 4?"
    return env


def _block(code: str, language: str = "python") -> str:
    return f"Let me compute.\n```{language}\n{code}\n```\n"


@pytest.mark.parametrize("action, observation", [
    (_block("print(3 + 4)"), "7"),
    (_block("print(3 + 4)", "py"), "7"),
    (_block("x = 3\nx * 2"), "6"),                                       # final expression's repr
    (_block("print('a')\n[1, 2]"), "a\n[1, 2]"),                         # output, then the value
    (_block("'text'"), "'text'"),                                         # a repr, as a REPL shows
    (_block("x = 1"), ""),                                                # nothing to show
    (_block("print(1)") + "then\n" + _block("print(2)"), "2"),           # the last block runs
    ("Code:\n```python\nprint(5 * 5)\n", "25"),                           # still open at the end
    ("1. Compute:\n    ```python\n    total = 0\n    for i in range(5):\n        total += i\n"
     "    print(total)\n    ```", "10"),                                   # indented: 0+1+2+3+4
])
def test_tool_calls(action, observation):
    assert _env().step(action) == StepResult(observation=observation, tool_call=True)


@pytest.mark.parametrize("code, reason", [
    ("import os", "error: import is not allowed"),
    ("open('/etc/passwd').read()", "error: attribute access is not allowed"),
    ("().__class__.__bases__", "error: attribute access is not allowed"),
    ("print(1 / 0)", "error: ZeroDivisionError: division by zero"),
    ("print(y)", "error: NameError: name 'y' is not defined"),
    ("while True:\n    pass", "error: step limit exceeded"),
    ("print(9**9**9)", "error: an integer would have 387420489 bits"),
    ("if True\n    print(1)", "error: invalid syntax at line 1"),
])
def test_tool_errors_are_observed(code, reason):
    # The step limit, not the 1 s wall clock, must stop the loop even on a loaded machine.
    result = _env(limits=SandboxLimits(timeout_s=60.0)).step(_block(code))
    assert result.observation.startswith(reason), result.observation
    assert result.tool_call and result.tool_error and not result.done


def test_observation_is_cut_to_max_observation_chars():
    result = _env().step(_block("print('x' * 500)"))
    assert result.observation == "x" * 197 + "..."  # 200 characters in all
    short = _env(max_observation_chars=10).step(_block("print(12345678901234)"))
    assert short.observation == "1234567..."


def test_sandbox_output_truncation_is_marked():
    env = _env(limits=SandboxLimits(max_output_chars=4))
    assert env.step(_block("print(123456)")).observation == "1234..."


def test_each_call_starts_without_variables():
    env = _env()
    assert env.step(_block("x = 41\nx + 1")).observation == "42"
    assert env.step(_block("x")).observation.startswith("error: NameError")


def test_limits_are_used():
    env = _env(limits=SandboxLimits(max_steps=50))
    result = env.step(_block("for i in range(100):\n    pass"))
    assert result.tool_error and "more than 50 steps" in result.observation


def test_final_answer_is_graded():
    assert _env().step("The answer is 7.") == StepResult(observation="", reward=1.0, done=True)
    assert _env().step("The answer is 8.") == StepResult(observation="", reward=0.0, done=True)
    # A fence of another language is not a tool call.
    assert _env().step("```text\n7\n```").done


def test_options_are_validated():
    with pytest.raises(ValueError, match="PythonEnv: reward_mode='nope' is not allowed"):
        PythonEnv(reward_mode="nope")
    with pytest.raises(ValueError, match="max_observation_chars=3"):
        PythonEnv(max_observation_chars=3)
    with pytest.raises(RuntimeError, match="before reset"):
        PythonEnv().step("#### 7")


def test_make_environment():
    env = make_environment("python", max_observation_chars=50)
    assert isinstance(env, PythonEnv) and env.max_observation_chars == 50


def test_last_code_block():
    assert last_code_block("no code") is None
    assert last_code_block("```python\na\n```\n```py\nb\n```") == "b\n"
    assert last_code_block("```python\na\n```\n```\nplain\n```") == "a\n"  # plain fence: no
    assert last_code_block("```python3\nc") == "c"


def test_demonstration_prints_each_calculation_in_a_code_block():
    from jrl.pipeline.rollout.episodes import demonstrate
    example = PromptExample(id=3, question="What is 347 + 589?", answer="936",
                            solution="347+589=936\n#### 936")
    actions = PythonEnv().demonstration(example)
    assert actions == ["```python\nprint(347+589)\n```", "#### 936"]
    # The block's printed output is the observation: 347 + 589 = 936.
    transcript = demonstrate(PythonEnv(), example, actions)
    assert transcript[1][0] == "observation" and transcript[1][1].strip() == "936"
