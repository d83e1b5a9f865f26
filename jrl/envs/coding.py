"""A coding-task environment: a small repository with a failing test; the model's code is written
into it and the tests run in the process sandbox; reward 1.0 when they pass.

    env = CodingEnv()                                   # ProcessSandbox, namespaces isolation
    example = coding_examples()[0]                      # example.answer == "add"
    env.reset(example)                                  # the task, the files, the tests
    env.step("```sh\\npython3 -m unittest\\n```")        # a shell tool call: the output
    env.step("```python\\ndef add(a, b):\\n    return a + b\\n```")
        -> StepResult(observation="", reward=1.0, done=True)

One task family ships (CODING_TASKS): implement add(a, b), and two off-by-one fixes. For a config:
env.name="jrl.envs.coding:CodingEnv" with prompts from coding_examples() (a file of records whose
answer is a task's name does too).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from typing import Mapping

from jrl.data import PromptExample
from jrl.envs.base import StepResult
from jrl.envs.calculator import error_step, truncate_observation
from jrl.envs.process_sandbox import ProcessLimits, ProcessResult, ProcessSandbox
from jrl.envs.python_env import last_code_block

# The opening fence of a shell block: ```sh, ```bash or ```shell, then the end of its line.
_SHELL_FENCE_OPEN = re.compile(r"```[ \t]*(?:sh|bash|shell)[ \t]*\r?\n")

# Runs every test_*.py of the repository; prints the verdict line with a fresh nonce only when all
# of them ran and passed, so code that exits early (sys.exit(0) at import) does not pass.
_TEST_RUNNER = """\
import sys, unittest
suite = unittest.defaultTestLoader.discover('.', pattern='test_*.py')
result = unittest.TextTestRunner(stream=sys.stdout, verbosity=1).run(suite)
if not (result.wasSuccessful() and result.testsRun > 0):
    sys.exit(1)
print({verdict!r})
"""


@dataclasses.dataclass(frozen=True)
class CodingTask:
    """One coding task: a repository snapshot in which `target` must be rewritten so that the
    tests pass.

    name: the task's name (PromptExample.answer of its examples).
    instruction: what to do, in words.
    files: the repository, {relative path: text}, its test_*.py files included; they fail as
      given.
    target: the file the model's code replaces (not a test file).
    solution: a correct content of target (demonstrations and tests).
    """

    name: str
    instruction: str
    files: Mapping[str, str]
    target: str
    solution: str

    def __post_init__(self):
        if self.target not in self.files or self.target.split("/")[-1].startswith("test_"):
            raise ValueError(f"CodingTask {self.name!r}: target={self.target!r} must be one of "
                             "its files and not a test file.")

    def prompt(self) -> str:
        """The task as the model sees it: the instruction, then every file of the repository."""
        listing = "\n\n".join(f"{path}:\n```python\n{text.rstrip()}\n```"
                              for path, text in sorted(self.files.items()))
        return (f"{self.instruction} Reply with the complete new content of {self.target} in a "
                "```python block. Before that you may run shell commands in a ```sh block; "
                "each runs in a fresh copy of the repository.\n\n" + listing)


CODING_TASKS = {task.name: task for task in (
    CodingTask(
        name="add",
        instruction="Implement add(a, b) in calc.py so that the tests in test_calc.py pass.",
        files={
            "calc.py": 'def add(a, b):\n    """The sum of a and b."""\n'
                       "    raise NotImplementedError\n",
            "test_calc.py": "import unittest\n\nfrom calc import add\n\n\n"
                            "class TestAdd(unittest.TestCase):\n"
                            "    def test_integers(self):\n"
                            "        self.assertEqual(add(2, 3), 5)\n\n"
                            "    def test_negative(self):\n"
                            "        self.assertEqual(add(-4, 1), -3)\n\n"
                            "    def test_floats(self):\n"
                            "        self.assertEqual(add(0.5, 0.25), 0.75)\n",
        },
        target="calc.py",
        solution='def add(a, b):\n    """The sum of a and b."""\n    return a + b\n',
    ),
    CodingTask(
        name="inclusive_range",
        instruction="Fix the off-by-one error in ranges.py so that the tests in test_ranges.py "
                    "pass.",
        files={
            "ranges.py": "def inclusive_range(start, stop):\n"
                         '    """The integers from start to stop, both included."""\n'
                         "    return list(range(start, stop))\n",
            "test_ranges.py": "import unittest\n\nfrom ranges import inclusive_range\n\n\n"
                              "class TestInclusiveRange(unittest.TestCase):\n"
                              "    def test_both_ends(self):\n"
                              "        self.assertEqual(inclusive_range(1, 3), [1, 2, 3])\n\n"
                              "    def test_one(self):\n"
                              "        self.assertEqual(inclusive_range(5, 5), [5])\n\n"
                              "    def test_empty(self):\n"
                              "        self.assertEqual(inclusive_range(4, 3), [])\n",
        },
        target="ranges.py",
        solution="def inclusive_range(start, stop):\n"
                 '    """The integers from start to stop, both included."""\n'
                 "    return list(range(start, stop + 1))\n",
    ),
    CodingTask(
        name="sum_to",
        instruction="Fix the off-by-one error in series.py so that the tests in test_series.py "
                    "pass.",
        files={
            "series.py": "def sum_to(n):\n"
                         '    """1 + 2 + ... + n (0 for n < 1)."""\n'
                         "    return sum(range(n))\n",
            "test_series.py": "import unittest\n\nfrom series import sum_to\n\n\n"
                              "class TestSumTo(unittest.TestCase):\n"
                              "    def test_three(self):\n"
                              "        self.assertEqual(sum_to(3), 6)  # 1 + 2 + 3\n\n"
                              "    def test_one(self):\n"
                              "        self.assertEqual(sum_to(1), 1)\n\n"
                              "    def test_zero(self):\n"
                              "        self.assertEqual(sum_to(0), 0)\n",
        },
        target="series.py",
        solution="def sum_to(n):\n"
                 '    """1 + 2 + ... + n (0 for n < 1)."""\n'
                 "    return sum(range(n + 1))\n",
    ),
)}


def coding_examples() -> list[PromptExample]:
    """One prompt per task of CODING_TASKS, in order: question = the task's prompt, answer = its
    name, solution = a correct response (a ```python block with the task's solution)."""
    return [PromptExample(id=index, question=task.prompt(), answer=task.name,
                          solution=f"```python\n{task.solution}```",
                          meta={"coding_task": task.name})
            for index, task in enumerate(CODING_TASKS.values())]


class CodingEnv:
    """A coding task: the model may run shell commands, then submits a file; the tests grade it.

    reset(example) finds the task by example.answer (a name in `tasks`) and returns its prompt
    (the example's question). In a model turn:
      a ```python block (the last one) is the submission: it replaces the task's target file, the
        tests (every test_*.py) run in the process sandbox, reward = 1.0 if they all pass (and at
        least one ran) else 0.0, done=True;
      else a ```sh (```bash, ```shell) block is a shell tool call, run with /bin/sh in a fresh
        copy of the repository: the observation is its stdout and stderr (then "exit status N"
        when not 0), cut to max_observation_chars; a limit hit is a tool error;
      else (no block) the episode ends with reward 0.0.
    last_result holds the ProcessResult of the last run (the tests' output after a submission).

    The submitted code runs in the test runner's own process, so a response written to cheat
    (one that patches unittest, say) could pass; the sandbox contains it, it does not grade
    intent.

    Args:
      limits, isolation: the ProcessSandbox's (isolation="namespaces" raises SandboxUnavailable
        at construction where it cannot be set up).
      max_observation_chars: longest observation of a shell call.
      tasks: the task family, {name: CodingTask}.
    """

    def __init__(self, limits: ProcessLimits = ProcessLimits(), isolation: str = "namespaces",
                 max_observation_chars: int = 400,
                 tasks: Mapping[str, CodingTask] = CODING_TASKS):
        if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int) \
                or max_observation_chars < 4:
            raise ValueError(f"CodingEnv: max_observation_chars={max_observation_chars!r} is not "
                             "allowed; it must be an int >= 4 (room for a truncation '...').")
        self.sandbox = ProcessSandbox(limits, isolation)
        self.max_observation_chars = max_observation_chars
        self.tasks = dict(tasks)
        self.last_result: ProcessResult | None = None
        self._task: CodingTask | None = None

    def reset(self, example: PromptExample) -> str:
        if example.answer not in self.tasks:
            raise ValueError(f"CodingEnv: example {example.id} names the task "
                             f"{example.answer!r}; known tasks: {sorted(self.tasks)}.")
        self._task = self.tasks[example.answer]
        return example.question

    def demonstration(self, example: PromptExample) -> list[str]:
        """The model turns of a correct episode: the task's solution in a ```python block."""
        return [f"```python\n{self.tasks[example.answer].solution}```"]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("CodingEnv.step() called before reset(example).")
        code = last_code_block(action)
        if code is not None:
            return StepResult(observation="", reward=self.grade(code), done=True)
        command = last_code_block(action, _SHELL_FENCE_OPEN)
        if command is None:
            return StepResult(observation="", reward=0.0, done=True)
        result = self.last_result = self.sandbox.run_shell(command, self._task.files)
        if result.limit_hit is not None:
            return error_step(result.limit_message, self.max_observation_chars)
        text = result.stdout + result.stderr
        if result.exit_code != 0:
            text += f"exit status {result.exit_code}"
        return StepResult(observation=truncate_observation(text.rstrip("\n"),
                                                           self.max_observation_chars),
                          tool_call=True)

    def grade(self, code: str) -> float:
        """1.0 if the task's tests pass with `code` as its target file, else 0.0."""
        if self._task is None:
            raise RuntimeError("CodingEnv.grade() called before reset(example).")
        verdict = f"jrl-tests-passed-{secrets.token_hex(8)}"
        files = {**self._task.files, self._task.target: code}
        result = self.last_result = self.sandbox.run_python(
            _TEST_RUNNER.format(verdict=verdict), files)
        passed = result.ok and verdict in result.stdout.splitlines()
        return 1.0 if passed else 0.0
