"""The Python environment: a ```python fenced block in a model turn is a tool call, run in a
sandbox: sandbox="ast" (the default, no dependencies), jrl.envs.sandbox.run_python, an allow-listed
interpreter, never exec; sandbox="process", jrl.envs.process_sandbox, real CPython in an isolated
child process."""

from __future__ import annotations

import re
import textwrap

from jrl.data import PromptExample
from jrl.envs.base import StepResult
from jrl.envs.calculator import (
    check_environment_options,
    error_step,
    final_answer_step,
    solution_calculations,
    truncate_observation,
)
from jrl.envs.process_sandbox import ProcessLimits, ProcessSandbox
from jrl.envs.sandbox import SandboxError, SandboxLimits, run_python

SANDBOXES = ("ast", "process")

# The opening fence of a code block: ```python, ```python3 or ```py, then the end of its line.
_CODE_FENCE_OPEN = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n")
_CODE_FENCE_CLOSE = "```"


def last_code_block(text: str, fence: re.Pattern = _CODE_FENCE_OPEN) -> str | None:
    """The code of the last ```python (or ```py) block in `text`; None if there is none. `fence`:
    another language's opening fence (a pattern matching it up to the end of its line).

    Blocks are read in order, each from its opening fence to the next ``` fence; a block still
    open at the end of the text (a turn that stopped at the sampler's stop token before closing
    it) runs to the end of the text.
    """
    blocks = []
    position = 0
    while (opening := fence.search(text, position)) is not None:
        closing = text.find(_CODE_FENCE_CLOSE, opening.end())
        if closing < 0:
            blocks.append(text[opening.end():])
            break
        blocks.append(text[opening.end():closing])
        position = closing + len(_CODE_FENCE_CLOSE)
    return blocks[-1] if blocks else None


class PythonEnv:
    """A Python tool for math problems: the model writes code, the sandbox runs it.

    A turn with a ```python (or ```py) block is a tool call: the LAST block is run with
    jrl.envs.sandbox.run_python (sandbox="ast") or ProcessSandbox.run_python (sandbox="process":
    real CPython, imports allowed, in a child process isolated as docs/sandbox.md says), in a fresh
    namespace (nothing carries over between calls). The observation is what the code printed, then
    the repr of its final bare expression if it has one (not None), on its own line, as a REPL would
    show it; cut to max_observation_chars ending in "..." when longer. An error (invalid syntax, a
    refused construct, an error of the program, a limit) gives "error: <reason>" with
    tool_error=True; the episode goes on. A turn without a block is the final answer: reward =
    math_reward(turn, example, mode=reward_mode).reward, done=True. With sandbox="process", an error
    is the last line of stderr ("ZeroDivisionError: division by zero") or the limit's message.

    Args:
      reward_mode: how the final answer is found; one of jrl.rewards.EXTRACT_MODES.
      limits: the AST sandbox's SandboxLimits (sandbox="ast").
      max_observation_chars: longest observation.
      sandbox: one of SANDBOXES.
      process_limits, isolation: the process sandbox's ProcessLimits and isolation (one of
        jrl.envs.process_sandbox.ISOLATIONS; "namespaces" raises SandboxUnavailable at
        construction where it cannot be set up). Keep process_limits.timeout_s below the
        driver's env.timeout_s.
    """

    def __init__(self, reward_mode: str = "auto", limits: SandboxLimits = SandboxLimits(),
                 max_observation_chars: int = 200, sandbox: str = "ast",
                 process_limits: ProcessLimits = ProcessLimits(), isolation: str = "namespaces"):
        check_environment_options("PythonEnv", reward_mode, max_observation_chars, limits)
        if sandbox not in SANDBOXES:
            raise ValueError(f"PythonEnv: sandbox={sandbox!r} is not allowed; allowed: "
                             f"{SANDBOXES}.")
        self.reward_mode = reward_mode
        self.limits = limits
        self.max_observation_chars = max_observation_chars
        self.sandbox = sandbox
        self._process = (ProcessSandbox(process_limits, isolation) if sandbox == "process"
                         else None)
        self._example: PromptExample | None = None

    def reset(self, example: PromptExample) -> str:
        self._example = example
        return example.question

    def demonstration(self, example: PromptExample) -> list[str]:
        """The model turns of a correct tool-using episode, for a supervised warm start: one
        block printing each calculation of the worked solution, then its "#### N" line
        ("347+589=936\n#### 936" -> ["```python\nprint(347+589)\n```", "#### 936"])."""
        calculations, final = solution_calculations(example)
        return [f"```python\nprint({expression})\n```" for expression in calculations] + [final]

    def step(self, action: str) -> StepResult:
        if self._example is None:
            raise RuntimeError("PythonEnv.step() called before reset(example).")
        code = last_code_block(action)
        if code is None:
            return final_answer_step(action, self._example, self.reward_mode)
        # Dedent: a block inside an indented list item is still valid code.
        code = textwrap.dedent(code)
        if self._process is not None:
            return self._process_step(code)
        try:
            result = run_python(code, self.limits)
        except SandboxError as error:
            return error_step(str(error), self.max_observation_chars)
        lines = [result.output.rstrip("\n")] if result.output else []
        if result.output_truncated:
            lines[-1] += "..."
        if result.value_repr is not None:
            lines.append(result.value_repr)
        observation = truncate_observation("\n".join(lines), self.max_observation_chars)
        return StepResult(observation=observation, tool_call=True)

    def _process_step(self, code: str) -> StepResult:
        result = self._process.run_python(code)
        if not result.ok:
            return error_step(result.error_line(), self.max_observation_chars)
        text = result.stdout.rstrip("\n")
        if result.stdout_truncated:
            text += "..."
        return StepResult(observation=truncate_observation(text, self.max_observation_chars),
                          tool_call=True)


def process_python_env() -> PythonEnv:
    """The Python tool on real CPython in the process sandbox (namespaces isolation, default
    limits), for a config: env.name="jrl.envs.python_env:process_python_env"."""
    return PythonEnv(sandbox="process")
