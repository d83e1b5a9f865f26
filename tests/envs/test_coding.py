"""jrl.envs.coding: the coding tasks, graded by their tests in the process sandbox, with
hand-written correct and incorrect responses."""

import pytest

from jrl.data import PromptExample
from jrl.envs import CODING_TASKS, CodingEnv, CodingTask, ProcessLimits, StepResult, coding_examples
from jrl.plugins import load_plugin
from tests.envs.sandbox_isolations import BOTH, needs_namespaces

EXAMPLES = {example.answer: example for example in coding_examples()}

WRONG = {
    "add": "def add(a, b):\n    return a - b\n",
    "inclusive_range": "def inclusive_range(start, stop):\n"
                       "    return list(range(start, stop + 2))\n",
    "sum_to": "def sum_to(n):\n    return n * (n - 1) // 2\n",     # the same bug, in closed form
}


def _env(isolation: str, task: str, **options) -> CodingEnv:
    env = CodingEnv(isolation=isolation, **options)
    assert env.reset(EXAMPLES[task]) == EXAMPLES[task].question
    return env


def _python(code: str) -> str:
    return f"Here is the file:\n```python\n{code}```\n"


def test_the_task_family():
    assert list(CODING_TASKS) == ["add", "inclusive_range", "sum_to"]
    examples = coding_examples()
    assert [e.id for e in examples] == [0, 1, 2]
    prompt = EXAMPLES["add"].question
    assert prompt.startswith("Implement add(a, b) in calc.py so that the tests in test_calc.py "
                             "pass. Reply with the complete new content of calc.py")
    assert "test_calc.py:\n```python\nimport unittest" in prompt
    assert "calc.py:\n```python\ndef add(a, b):" in prompt
    with pytest.raises(ValueError, match="target='test_x.py' must be one of its files and not a "
                                         "test file"):
        CodingTask("x", "x", {"test_x.py": ""}, "test_x.py", "")


@pytest.mark.parametrize("isolation", BOTH)
@pytest.mark.parametrize("task", list(CODING_TASKS))
def test_correct_response_passes_and_incorrect_ones_fail(isolation, task):
    env = _env(isolation, task)
    correct = env.demonstration(EXAMPLES[task])
    assert correct == [f"```python\n{CODING_TASKS[task].solution}```"]
    assert env.step(correct[0]) == StepResult(observation="", reward=1.0, done=True)
    assert "OK" in env.last_result.stdout
    for code in (WRONG[task], CODING_TASKS[task].files[CODING_TASKS[task].target]):
        env = _env(isolation, task)
        assert env.step(_python(code)) == StepResult(observation="", reward=0.0, done=True)
        assert "FAILED" in env.last_result.stdout


@pytest.mark.parametrize("code", [
    "def add(a, b) return a + b\n",                                   # a syntax error
    "import sys\nsys.exit(0)\n",                                      # exits before the tests
    "import os\nos._exit(0)\n",                                       # ... without cleanup
    "def add(a, b):\n    while True:\n        pass\n",                # never returns
])
def test_broken_or_evasive_responses_get_no_reward(code):
    env = _env("rlimits", "add", limits=ProcessLimits(timeout_s=2.0, cpu_s=1))
    assert env.step(_python(code)).reward == 0.0


def test_shell_tool_calls_see_the_repository():
    env = _env("rlimits", "add")
    result = env.step("Let me look.\n```sh\nls; python3 -I -S -m unittest -q 2>&1 | tail -1\n```")
    assert result == StepResult(observation="calc.py\ntest_calc.py\nFAILED (errors=3)",
                                tool_call=True)
    failing = env.step("```bash\ncat nothing.txt\n```")
    assert failing.observation == ("cat: nothing.txt: No such file or directory\n"
                                   "exit status 1") and not failing.tool_error
    # The shell's files are a fresh copy each time; the submission still grades.
    assert env.step("```sh\necho 'def add(a, b): return 0' > calc.py\n```").tool_call
    assert env.step(env.demonstration(EXAMPLES["add"])[0]).reward == 1.0


def test_shell_limits_are_tool_errors():
    env = _env("rlimits", "add", limits=ProcessLimits(timeout_s=1.0))
    result = env.step("```sh\nsleep 60\n```")
    assert result == StepResult(observation="error: the wall-clock limit of 1.0 s was hit "
                                            "(ProcessLimits.timeout_s)",
                                tool_call=True, tool_error=True)


def test_a_turn_without_code_ends_with_no_reward():
    assert _env("rlimits", "add").step("I give up.") == StepResult(observation="", reward=0.0,
                                                                   done=True)


def test_errors_of_use():
    env = CodingEnv(isolation="rlimits")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("```python\n1\n```")
    with pytest.raises(ValueError, match="example 5 names the task 'nope'; known tasks: "
                                         r"\['add', 'inclusive_range', 'sum_to'\]"):
        env.reset(PromptExample(id=5, question="?", answer="nope"))
    with pytest.raises(ValueError, match="max_observation_chars=2 is not allowed"):
        CodingEnv(isolation="rlimits", max_observation_chars=2)


@needs_namespaces
def test_the_config_factory_is_the_class():
    env = load_plugin("env.name", "jrl.envs.coding:CodingEnv")()
    assert env.sandbox.isolation == "namespaces"
    env.reset(EXAMPLES["sum_to"])
    assert env.step(env.demonstration(EXAMPLES["sum_to"])[0]).reward == 1.0
