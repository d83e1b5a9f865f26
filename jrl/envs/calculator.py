"""The calculator environment: `calc(<arithmetic>)` in a model turn is a tool call."""

from __future__ import annotations

import math

from jrl.data import PromptExample
from jrl.envs.base import StepResult
from jrl.envs.sandbox import SandboxError, SandboxLimits, evaluate_arithmetic
from jrl.rewards import EXTRACT_MODES, math_reward

CALL_OPENER = "calc("

# A float at most this large in magnitude that is a whole number is shown as one: every integer
# below 2**53 is exactly representable, so its digits are exact too.
_EXACT_FLOAT_INTEGER = 2**53


def format_number(value: int | float) -> str:
    """The text of a calculator result.

    An int is its decimal digits. A float that is a whole number below 2**53 in magnitude is shown
    as an int (6/3 -> "2", 2.5*2 -> "5"); any other float as repr, the shortest text that reads
    back to the same float (7/2 -> "3.5", 1/3 -> "0.3333333333333333", 2**60/3 ->
    "3.843071682022823e+17").

    Raises:
      ValueError: the value is inf or nan.
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"the result is not a finite number ({value!r})")
        if value.is_integer() and abs(value) < _EXACT_FLOAT_INTEGER:
            return str(int(value))
        return repr(value)
    return str(value)


def check_environment_options(owner: str, reward_mode: str, max_observation_chars: int,
                              limits: SandboxLimits) -> None:
    """Raises ValueError naming the bad option of an environment (`owner` is its class name)."""
    if reward_mode not in EXTRACT_MODES:
        raise ValueError(f"{owner}: reward_mode={reward_mode!r} is not allowed; allowed: "
                         f"{EXTRACT_MODES}.")
    if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int) \
            or max_observation_chars < 4:
        raise ValueError(f"{owner}: max_observation_chars={max_observation_chars!r} is not "
                         "allowed; it must be an int >= 4 (room for a truncation '...').")
    if not isinstance(limits, SandboxLimits):
        raise ValueError(f"{owner}: limits={limits!r} is not allowed; it must be a "
                         "jrl.envs.SandboxLimits.")


def truncate_observation(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, the last three of them "..." when cut."""
    return text if len(text) <= max_chars else text[:max_chars - 3] + "..."


def error_step(reason: str, max_chars: int) -> StepResult:
    """The step of a failed tool call: the model observes "error: <reason>"; the episode goes
    on."""
    return StepResult(observation=truncate_observation(f"error: {reason}", max_chars),
                      tool_call=True, tool_error=True)


def final_answer_step(action: str, example: PromptExample, reward_mode: str) -> StepResult:
    """The step of a turn without a tool call: the final answer, graded; the episode ends.

        reward = math_reward(action, example, mode=reward_mode).reward
    """
    reward = math_reward(action, example, mode=reward_mode).reward
    return StepResult(observation="", reward=reward, done=True)


def solution_calculations(example: PromptExample) -> tuple[list[str], str]:
    """The calculations of a worked solution and its final line: each line "<expression>=<value>"
    before the "#### N" line is one calculation ("347+589=936\n#### 936" -> (["347+589"],
    "#### 936")). ValueError when the example has no such solution (a demonstration needs one)."""
    lines = (example.solution or "").strip().splitlines()
    if not lines or not lines[-1].startswith("#### "):
        raise ValueError(f"example {example.id} has no worked solution ending in '#### N' to "
                         "demonstrate the tool with")
    calculations = [line.split("=")[0].strip() for line in lines[:-1] if "=" in line]
    if not calculations:
        raise ValueError(f"example {example.id}: its solution has no '<expression>=<value>' "
                         "line to demonstrate the tool with")
    return calculations, lines[-1]


def _balanced_argument(text: str, start: int) -> str | None:
    """The text from `start` up to the ")" that closes the "(" just before `start` (parentheses
    in between balanced); None if it is never closed."""
    depth = 1
    for position in range(start, len(text)):
        character = text[position]
        if character == "(":
            depth += 1
        elif character == ")":
            depth -= 1
            if depth == 0:
                return text[start:position]
    return None


class CalculatorEnv:
    """A calculator tool for arithmetic word problems.

    A turn containing "calc(" is a tool call: the LAST "calc(" and the text up to its balanced
    closing parenthesis is evaluated with jrl.envs.sandbox.evaluate_arithmetic (numbers,
    + - * / // % **, parentheses), and the observation is the result as format_number writes it:
    "calc((1+2)*3)" -> "9", "calc(7/2)" -> "3.5". An unbalanced call, a refused or invalid
    expression, an arithmetic error, a limit, a non-finite result, or a result longer than
    max_observation_chars gives the observation "error: <reason>" with tool_error=True; the
    episode goes on. A turn without "calc(" is the final answer:
    reward = math_reward(turn, example, mode=reward_mode).reward, done=True.

    Args:
      reward_mode: how the final answer is found; one of jrl.rewards.EXTRACT_MODES.
      max_observation_chars: longest observation; an error is cut to it with "...".
      limits: the evaluator's SandboxLimits.
    """

    def __init__(self, reward_mode: str = "auto", max_observation_chars: int = 64,
                 limits: SandboxLimits = SandboxLimits()):
        check_environment_options("CalculatorEnv", reward_mode, max_observation_chars, limits)
        self.reward_mode = reward_mode
        self.max_observation_chars = max_observation_chars
        self.limits = limits
        self._example: PromptExample | None = None

    def reset(self, example: PromptExample) -> str:
        self._example = example
        return example.question

    def demonstration(self, example: PromptExample) -> list[str]:
        """The model turns of a correct tool-using episode, for a supervised warm start: one
        "calc(<expression>)" per calculation line of the worked solution, then its "#### N"
        line ("347+589=936\n#### 936" -> ["calc(347+589)", "#### 936"])."""
        calculations, final = solution_calculations(example)
        return [f"calc({expression})" for expression in calculations] + [final]

    def step(self, action: str) -> StepResult:
        if self._example is None:
            raise RuntimeError("CalculatorEnv.step() called before reset(example).")
        start = action.rfind(CALL_OPENER)
        if start < 0:
            return final_answer_step(action, self._example, self.reward_mode)
        expression = _balanced_argument(action, start + len(CALL_OPENER))
        if expression is None:
            return error_step("unbalanced parentheses: the last calc( is never closed",
                              self.max_observation_chars)
        try:
            text = format_number(evaluate_arithmetic(expression, self.limits))
        except (SandboxError, ValueError) as error:  # SandboxError is a ValueError too
            return error_step(str(error), self.max_observation_chars)
        if len(text) > self.max_observation_chars:
            # A cut number would read as a different number; say so instead.
            return error_step(f"the result has {len(text)} characters, more than "
                              f"{self.max_observation_chars}", self.max_observation_chars)
        return StepResult(observation=text, tool_call=True)
