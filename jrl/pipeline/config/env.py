"""The env section of a run config: multi-turn episodes with a tool environment."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jrl.checks import check_choice, check_positive
from jrl.envs import ENVIRONMENTS, SANDBOXES, Environment, make_environment
from jrl.pipeline.rollout.episodes import EpisodeOptions
from jrl.plugins import is_plugin_spec, load_plugin


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Multi-turn episodes with a tool environment (jrl.envs, driven by jrl.pipeline.rollout.episodes).

    name: "none" (single-turn: the verifier grades each response), one of jrl.envs'
    ENVIRONMENTS ("calculator": the model may write calc(expr); "python": a fenced python block
    run in the sandbox), or "package.module:factory", your own: factory() -> a new Environment
    per episode (jrl.envs.Environment). The episode's reward is the environment's (its final answer is graded
    with rollout.reward_mode). max_turns, timeout_s, max_observation_tokens, observation_format:
    see EpisodeOptions. threads: host threads for environment calls. sandbox (env.name="python"):
    "ast" (the default: the allow-listed interpreter, no dependency) or "process" (real CPython
    in a child process with its own namespaces and rlimits, jrl.envs.process_sandbox; Linux
    with unprivileged user namespaces, refused at setup where they are unavailable).
    sampling.max_new_tokens
    bounds the whole response, observations included (algorithm.overlong_buffer's penalty counts
    model tokens against it, so an episode cut at the limit may be penalised less).
    """

    name: str = "none"
    max_turns: int = 4
    timeout_s: float = 5.0
    max_observation_tokens: int = 16
    observation_format: str = "{observation}"
    threads: int = 8
    sandbox: str = "ast"

    def __post_init__(self):
        if not (self.name in ("none",) + ENVIRONMENTS or is_plugin_spec(self.name)):
            raise ValueError(f"env.name={self.name!r}: allowed values are "
                             f"{['none', *ENVIRONMENTS]}, 'package.module:factory' or "
                             "'path/to/file.py:factory'")
        check_positive("env.threads", self.threads)
        check_choice("env.sandbox", self.sandbox, SANDBOXES)
        if self.sandbox != "ast" and self.name != "python":
            raise ValueError(f"env.sandbox={self.sandbox!r} runs the python tool's code: it "
                             f"needs env.name='python' (got {self.name!r})")
        self.episode_options()   # validates the rest, naming the field

    @property
    def multi_turn(self) -> bool:
        return self.name != "none"

    def episode_options(self) -> EpisodeOptions:
        return EpisodeOptions(max_turns=self.max_turns, timeout_s=self.timeout_s,
                              max_observation_tokens=self.max_observation_tokens,
                              observation_format=self.observation_format)

    def environment_factory(self, reward_mode: str) -> Callable[[], Environment]:
        """make_env() -> a new Environment per episode: a built-in (its final answer graded
        with `reward_mode`, rollout.reward_mode; the python tool in env.sandbox) or
        "package.module:factory" (imported now, so that a typo is a setup error)."""
        if self.name in ENVIRONMENTS:
            options = dict(reward_mode=reward_mode)
            if self.name == "python":
                options["sandbox"] = self.sandbox
            return functools.partial(make_environment, self.name, **options)
        factory = load_plugin("env.name", self.name)
        if not callable(factory):
            raise ValueError(f"env.name={self.name!r} is a {type(factory).__name__}, not a "
                             "callable that makes an Environment")
        return factory
