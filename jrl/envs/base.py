"""The environment interface of multi-turn episodes, and the result of one step.

An episode alternates model turns and observations:

    prompt = render(env.reset(example))          # the first observation, as the prompt
    model turn 1 (ends at a stop token) -> env.step(turn_text) -> observation 1 appended
    model turn 2 ...                    -> env.step(turn_text) -> done: the episode ends

Each model turn ends at one of the sampler's stop tokens (for a chat model, the end of the
assistant message). The environment reads the turn's text (the stop token not included): a tool
call gets the tool's answer as the next observation; a turn without one is the final answer, graded
with done=True. The episode's reward is the sum of its steps' rewards. Running steps on host
threads with a per-call timeout, the step budget, and turning failures into observations is the
driver's job (jrl.pipeline.rollout.episodes); an environment only says what one step does.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jrl.data import PromptExample


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one environment step returns.

    observation: the text appended to the episode before the model's next turn ("" for nothing);
      ignored when done.
    reward: this step's reward (the episode's reward is the sum over its steps).
    done: the episode is over (the model gave its final answer, or the environment ended it).
    tool_call: this step ran a tool (counted in rollout/tool_calls_mean).
    tool_error: the tool failed on the model's input (bad expression, refused code, a limit);
      the observation says why, the episode goes on (counted in rollout/tool_errors).
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False


class Environment(Protocol):
    """One episode's state; a new instance per episode (see jrl.envs.make_environment).

    reset(example) -> the first observation (the text the prompt is rendered from). It must depend
      on the example only: the samples of a group share one prompt. It runs once per group to
      render that prompt (quickly: no timeout guards it there, and an exception stops the run)
      and again on each episode's own instance at its first turn (guarded by the driver).
    step(action) -> StepResult, where action is the text of the model's latest turn.
    """

    def reset(self, example: PromptExample) -> str: ...

    def step(self, action: str) -> StepResult: ...
