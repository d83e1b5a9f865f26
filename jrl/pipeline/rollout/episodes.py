"""Multi-turn episodes: the driver between the sampler and an environment.

    driver = EpisodeDriver(make_env, example_of=..., encode=..., decode=..., options=...)
    sampler.serve(..., on_turn=driver.on_turn, on_sample=lambda s: sink(driver.finish(s)))

When a sample's model turn ends at a stop token, the sampler pauses its slot and calls
`on_turn(partial)`. The driver decodes the turn's text and runs `env.step(text)` on a host thread
(other slots keep decoding), with a per-call timeout and a budget of model turns. The step's
observation, put in `observation_format` and tokenized, is what the sampler appends to the slot's
KV cache before the model's next turn. Failures never end a run: an exception in `step` or a call
past its timeout becomes an error observation ("error: ...") and is counted; an exception in
`reset` ends that episode with reward 0. The episode's reward is the sum of its steps' rewards;
`finish(sample)` attaches the EpisodeRecord (turns, tool calls, errors, timeouts, reward).

A step that times out keeps running on its daemon thread (Python cannot stop a thread); the
episode goes on without it and the next step is a new call on the same environment, so an
environment whose steps share mutable state should guard it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import numbers
import threading
from typing import Callable, Sequence

import numpy as np

from jrl.data import PromptExample
from jrl.envs import Environment, StepResult
from jrl.sampling import Sample

ERROR_CHARS = 120    # an error observation quotes at most this much of the exception text
MAX_TIMEOUT_S = 86400.0   # threading's join() overflows on larger (or infinite) waits


@dataclasses.dataclass(frozen=True)
class EpisodeOptions:
    """max_turns: model turns per episode; a turn past it is not answered (the episode ends).
    timeout_s: per environment call. max_observation_tokens: an observation is cut to this many
    tokens (counted in EpisodeRecord.observations_cut). observation_format: a str.format string
    with the field {observation}, the text appended after the model's stop token (for a chat
    model, the tool message's markup and the next assistant header)."""

    max_turns: int = 4
    timeout_s: float = 5.0
    max_observation_tokens: int = 16
    observation_format: str = "{observation}"

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"env.max_turns={self.max_turns!r}: must be an int >= 1")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"env.timeout_s={self.timeout_s!r}: must be in (0, "
                             f"{MAX_TIMEOUT_S:g}] seconds")
        if not isinstance(self.max_observation_tokens, int) or self.max_observation_tokens < 1:
            raise ValueError(f"env.max_observation_tokens={self.max_observation_tokens!r}: must "
                             "be an int >= 1")
        try:
            self.observation_format.format(observation="")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"env.observation_format={self.observation_format!r}: must be a "
                             "str.format string whose only field is {observation} "
                             f"({type(error).__name__}: {error})") from None


@dataclasses.dataclass
class EpisodeRecord:
    """What happened in one episode (attached to its Sample as `episode`).

    turns: model turns taken; tool_calls, tool_errors, tool_timeouts: environment steps that ran
    a tool / failed (the environment said so, or step raised) / passed the timeout; reward: sum
    of step rewards; done: the environment ended the episode (False: turn budget, token limit,
    or a failed reset); turn_budget_hit: the last turn was cut by max_turns; observations_cut:
    observations longer than max_observation_tokens; special_texts_removed: special-token text
    (e.g. "<|im_end|>") taken out of observations, so that a tool cannot end a message or
    start another role's; first_error: the first failure's text.
    """

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    reward: float = 0.0
    done: bool = False
    turn_budget_hit: bool = False
    observations_cut: int = 0
    special_texts_removed: int = 0
    first_error: str | None = None


class _Episode:
    def __init__(self):
        self.env: Environment | None = None   # made and reset at the episode's first turn
        self.record = EpisodeRecord()
        self.last_error = ""       # the observation of the latest failed call
        self.seen_length = 0       # response length at the latest turn handed to step


class EpisodeDriver:
    """Runs the environment side of multi-turn episodes for Sampler.serve (module docstring).

    make_env() -> a fresh Environment per episode. example_of(prompt_id) -> the PromptExample a
    request was made from. encode(text) -> token ids of an observation; decode(ids) -> the text of
    a model turn (stop token excluded). threads: host threads for environment calls.
    special_texts: the tokenizer's special-token texts, removed from every observation before
    it is put in observation_format (the format's own markup keeps them).
    """

    def __init__(self, make_env: Callable[[], Environment], *,
                 example_of: Callable[[int], PromptExample], encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], options: EpisodeOptions = EpisodeOptions(),
                 threads: int = 8, special_texts: Sequence[str] = ()):
        self.make_env = make_env
        self.example_of = example_of
        self.encode, self.decode = encode, decode
        self.options = options
        self.special_texts = tuple(text for text in special_texts if text)
        markup = len(encode_lossy(encode, options.observation_format.format(observation="")))
        if markup >= options.max_observation_tokens:
            raise ValueError(f"env.max_observation_tokens={options.max_observation_tokens} "
                             f"leaves no room for the observation: the markup of "
                             f"env.observation_format={options.observation_format!r} alone is "
                             f"{markup} tokens")
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="jrl-env")
        self._lock = threading.Lock()
        self._episodes: dict[tuple[int, int], _Episode] = {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------
    def on_turn(self, partial: Sample) -> concurrent.futures.Future:
        """The sampler's on_turn: a Future of the observation tokens to append, or of None
        when the episode ends."""
        return self._pool.submit(self._turn, partial)

    def finish(self, sample: Sample) -> Sample:
        """`sample` with its EpisodeRecord attached (an episode that never paused, i.e. ended
        at its token limit in its first turn, gets a record of one turn and reward 0)."""
        with self._lock:
            episode = self._episodes.pop((sample.prompt_id, sample.sample_index), None)
        if episode is None:
            return dataclasses.replace(sample, episode=EpisodeRecord(turns=1))
        if sample.length > episode.seen_length:
            episode.record.turns += 1   # a turn the token limit cut, never handed to step
        return dataclasses.replace(sample, episode=episode.record)

    # ------------------------------------------------------------------------------------------
    def _turn(self, partial: Sample) -> np.ndarray | None:
        key = (partial.prompt_id, partial.sample_index)
        with self._lock:
            episode = self._episodes.get(key)
            if episode is None:
                episode = self._episodes[key] = _Episode()
        try:
            return self._answer(episode, partial)
        except Exception as error:   # noqa: BLE001 - nothing an environment does may end the run
            # Anything that escaped the guarded calls (a make_env that raises, a tokenizer that
            # refuses the observation, a decode error) ends this episode, counted.
            episode.record.tool_errors += 1
            if episode.record.first_error is None:
                episode.record.first_error = f"error: {type(error).__name__}: {error}"[
                    :ERROR_CHARS]
            return None

    def _answer(self, episode: _Episode, partial: Sample) -> np.ndarray | None:
        record = episode.record
        record.turns += 1
        episode.seen_length = partial.length
        if episode.env is None and not self._start(episode, partial.prompt_id):
            return None
        action = self.decode(last_model_turn(partial))
        result = self._call(episode, lambda: episode.env.step(action), StepResult)
        if result is None:                      # failed or timed out: the error is observed
            observation = episode.last_error
        else:
            record.reward += result.reward
            record.tool_calls += int(result.tool_call)
            record.tool_errors += int(result.tool_error)
            if result.tool_error and record.first_error is None:
                record.first_error = result.observation[:ERROR_CHARS]
            if result.done:
                record.done = True
                return None
            observation = result.observation
        if record.turns >= self.options.max_turns:
            record.turn_budget_hit = True
            return None
        return self._observation_tokens(record, observation)

    def _start(self, episode: _Episode, prompt_id: int) -> bool:
        """Makes the episode's environment and resets it on the request's example; False when
        that failed (counted in the record; the episode ends with reward 0)."""
        example = self.example_of(prompt_id)

        def make_and_reset():
            env = self.make_env()
            env.reset(example)
            return env
        env = self._call(episode, make_and_reset, object)
        episode.env = env
        return env is not None

    def _call(self, episode: _Episode, call: Callable, expected: type):
        """call() on a daemon thread, waited for at most timeout_s. Returns its value, or None
        after an exception, a timeout or a value not of type `expected` (counted in the record;
        episode.last_error is the error observation)."""
        record = episode.record
        box: dict = {}

        def target():
            try:
                box["value"] = call()
            except BaseException as error:  # a user environment may raise anything
                box["error"] = error
        thread = threading.Thread(target=target, daemon=True, name="jrl-env-call")
        thread.start()
        thread.join(self.options.timeout_s)
        if thread.is_alive():
            record.tool_timeouts += 1
            message = f"error: the tool did not answer within {self.options.timeout_s:g}s"
        elif "error" in box:
            record.tool_errors += 1
            error = box["error"]
            message = f"error: {type(error).__name__}: {error}"[:ERROR_CHARS]
        else:
            value = box["value"]
            problem = _step_result_problem(value) if expected is StepResult else None
            if isinstance(value, expected) and problem is None:
                return value
            record.tool_errors += 1
            message = problem or (f"error: the environment returned {type(value).__name__}, "
                                  f"not {expected.__name__}")
        if record.first_error is None:
            record.first_error = message
        episode.last_error = message
        return None

    def _observation_tokens(self, record: EpisodeRecord, observation: str) -> np.ndarray:
        for text in self.special_texts:
            record.special_texts_removed += observation.count(text)
            observation = observation.replace(text, "")
        tokens, cut = observation_tokens(observation, encode=self.encode, options=self.options)
        record.observations_cut += int(cut)
        return np.asarray(tokens, np.int32)


def observation_tokens(observation: str, *, encode: Callable[[str], list[int]],
                       options: EpisodeOptions) -> tuple[list[int], bool]:
    """The tokens an observation appends: put in options.observation_format and encoded. One
    longer than options.max_observation_tokens has its observation text cut, never the
    format's markup around it (a chat model's end-of-message and next assistant header).
    Returns (tokens, whether it was cut)."""
    tokens = encode_lossy(encode, options.observation_format.format(observation=observation))
    limit = options.max_observation_tokens
    if len(tokens) <= limit:
        return tokens, False
    prefix, suffix = (encode_lossy(encode, part) for part in format_markup(options))
    room = max(0, limit - len(prefix) - len(suffix))
    return (prefix + encode_lossy(encode, observation)[:room] + suffix)[:limit], True


def format_markup(options: EpisodeOptions) -> tuple[str, str]:
    """The text of observation_format before and after its {observation} field."""
    marker = "\x00observation\x00"
    prefix, _, suffix = options.observation_format.format(observation=marker).partition(marker)
    return prefix, suffix


def _step_result_problem(value) -> str | None:
    """Why `value` is not a usable StepResult (None if it is): a non-finite or non-numeric
    reward would poison the group's advantages; a non-str observation cannot be tokenized."""
    if not isinstance(value, StepResult):
        return None
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or \
            not math.isfinite(reward):
        return f"error: the environment returned reward {reward!r}, not a finite number"
    if not isinstance(value.observation, str):
        return (f"error: the environment returned an observation of type "
                f"{type(value.observation).__name__}, not str")
    return None


def last_model_turn(sample: Sample) -> np.ndarray:
    """The tokens of the sample's latest model turn, its final stop token excluded: the model
    tokens after the last observation token."""
    mask = sample.model_token_mask()
    observation_at = np.flatnonzero(~mask)
    start = int(observation_at[-1]) + 1 if observation_at.size else 0
    end = sample.length - 1 if sample.finish_reason == "stop" else sample.length
    return sample.tokens[start:max(start, end)]


def encode_lossy(encode: Callable[[str], list[int]], text: str) -> list[int]:
    """encode(text); if the tokenizer refuses it (a character outside a char tokenizer's
    alphabet, say, in a tool's error message), the characters it refuses are left out. Text
    that is not valid Unicode (a lone surrogate a program printed) has those characters
    replaced by "?" first."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    try:
        return list(encode(text))
    except (ValueError, TypeError):
        out = []
        for char in text:
            try:
                out.extend(encode(char))
            except (ValueError, TypeError):
                continue
        return out


def demonstrate(env: Environment, example: PromptExample,
                actions: Sequence[str]) -> list[tuple[str, str]]:
    """A demonstration episode for a supervised warm start: `actions` (the model turns' texts)
    run through `env`. Returns the transcript [("model", a_1), ("observation", o_1), ...,
    ("model", a_n)]; ValueError unless the environment is done exactly at the last action."""
    env.reset(example)
    transcript = []
    for i, action in enumerate(actions):
        result = env.step(action)
        transcript.append(("model", action))
        last = i == len(actions) - 1
        if result.done != last:
            raise ValueError(f"demonstration of example {example.id}: the environment was "
                             f"{'done' if result.done else 'not done'} after action {i + 1} of "
                             f"{len(actions)} ({action!r})")
        if not last:
            transcript.append(("observation", result.observation))
    return transcript


def transcript_segments(transcript: Sequence[tuple[str, str]], *,
                        encode: Callable[[str], list[int]], stop_id: int,
                        options: EpisodeOptions) -> list[tuple[list[int], bool]]:
    """A transcript (demonstrate's) as the sampler would see it, in (token ids, trained)
    segments: each model turn ends in the stop token and is trained on; each observation is put
    in options.observation_format and cut as the driver cuts it, and is not."""
    segments = []
    for role, text in transcript:
        if role == "model":
            segments.append((list(encode(text)) + [stop_id], True))
        else:
            segments.append((observation_tokens(text, encode=encode, options=options)[0], False))
    return segments
