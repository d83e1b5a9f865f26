"""Environments of multi-turn episodes: tools the model calls between its turns, and the grader of
its final answer.

    env = make_environment("calculator")      # a new instance per episode
    prompt_text = env.reset(example)          # example.answer == "9"
    env.step("Let me compute calc((1+2)*3)")  # StepResult(observation="9", tool_call=True)
    env.step("#### 9")                        # StepResult(observation="", reward=1.0, done=True)

calculator: `calc(<arithmetic>)` in a turn is a tool call. python: a ```python fenced block is a
tool call, run by the sandbox (jrl.envs.sandbox: an allow-listed AST interpreter, never exec).
A turn without a tool call is the final answer, graded by jrl.rewards.math_reward.

Real code runs in jrl.envs.process_sandbox (CPython or /bin/sh in a child process isolated by
Linux namespaces, bounded by rlimits and a wall clock): PythonEnv(sandbox="process") (for a config,
env.name="jrl.envs.python_env:process_python_env") and the coding tasks of jrl.envs.coding
(env.name="jrl.envs.coding:CodingEnv"). docs/sandbox.md has the design and the attack table.
"""

from __future__ import annotations

from jrl.envs.base import Environment, StepResult
from jrl.envs.calculator import CalculatorEnv
from jrl.envs.coding import CODING_TASKS, CodingEnv, CodingTask, coding_examples
from jrl.envs.process_sandbox import (
    ISOLATIONS,
    LIMITS_HIT,
    ProcessLimits,
    ProcessResult,
    ProcessSandbox,
    SandboxPool,
    SandboxUnavailable,
)
from jrl.envs.python_env import SANDBOXES, PythonEnv
from jrl.envs.sandbox import (
    ALLOWED_BUILTINS,
    SandboxError,
    SandboxLimitExceeded,
    SandboxLimits,
    SandboxOutput,
    SandboxRefused,
    evaluate_arithmetic,
    run_python,
)

ENVIRONMENTS = ("calculator", "python")

_ENVIRONMENT_CLASSES = {"calculator": CalculatorEnv, "python": PythonEnv}


def make_environment(name: str, **options) -> Environment:
    """A new environment of kind `name` (one of ENVIRONMENTS), built with `options` (its class's
    keyword arguments, e.g. reward_mode="hash")."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"make_environment: name={name!r} is not allowed; allowed names: "
                         f"{ENVIRONMENTS}.")
    return _ENVIRONMENT_CLASSES[name](**options)


__all__ = [
    "ALLOWED_BUILTINS",
    "CODING_TASKS",
    "ENVIRONMENTS",
    "ISOLATIONS",
    "LIMITS_HIT",
    "SANDBOXES",
    "CalculatorEnv",
    "CodingEnv",
    "CodingTask",
    "Environment",
    "ProcessLimits",
    "ProcessResult",
    "ProcessSandbox",
    "PythonEnv",
    "SandboxError",
    "SandboxLimitExceeded",
    "SandboxLimits",
    "SandboxOutput",
    "SandboxPool",
    "SandboxRefused",
    "SandboxUnavailable",
    "StepResult",
    "coding_examples",
    "evaluate_arithmetic",
    "make_environment",
    "run_python",
]
