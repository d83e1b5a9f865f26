"""Fakes for the unit tests of the pipeline's parts: a task, hand-built samples and a sampler
that needs no model, so that a test of admission, the rollout worker or RLStep checks the
part's own rules in milliseconds."""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from jrl.data import PromptExample, PromptStream
from jrl.losses import RewardShaping
from jrl.pipeline.rollout.batch import RolloutOptions, RolloutSpec
from jrl.pipeline.rollout.task import GroupScore
from jrl.sampling import FINISH_LENGTH, FINISH_STOP, Sample


def examples(count: int) -> list[PromptExample]:
    """Examples whose id is their position: with an unshuffled stream, prompt id p of the
    first epoch is example p."""
    return [PromptExample(id=i, question=f"q{i}", answer=str(i)) for i in range(count)]


def stream(count: int = 32, **keywords) -> PromptStream:
    return PromptStream(examples(count), seed=0, shuffle=False, **keywords)


def options(prompts: int = 2, group_size: int = 2, max_new_tokens: int = 8, *,
            shaping: RewardShaping = RewardShaping(), max_rounds: int = 1,
            **keywords) -> RolloutOptions:
    return RolloutOptions(RolloutSpec(prompts, group_size, max_new_tokens, shaping,
                                      max_rounds=max_rounds), **keywords)


def sample(prompt_id: int, sample_index: int, length: int = 3, *, finish: str = FINISH_STOP,
           versions: list[int] | None = None, prompt: np.ndarray | None = None) -> Sample:
    """A finished response of `length` tokens, token t = 10 + sample_index + t, p_b -0.5 each,
    every token of version 0 unless `versions` says otherwise, after `prompt` (default the
    FakeTask's rendering, [1, 3 + prompt_id])."""
    versions = [0] * length if versions is None else versions
    prompt = np.array([1, 3 + prompt_id], np.int32) if prompt is None else prompt
    return Sample(prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=prompt,
                  tokens=np.arange(10 + sample_index, 10 + sample_index + length,
                                   dtype=np.int32),
                  behavior_logp=np.full(length, -0.5, np.float32),
                  logit_floor=np.full(length, -np.inf, np.float32),
                  versions=np.asarray(versions, np.int32), entropy=None, finish_reason=finish)


class FakeTask:
    """The parts of jrl.pipeline.Task that admission and the worker use. render: [1, 3 + id];
    score_group: reward(sample, example) per sample (default: the sample index's parity, so
    every group of two or more has a spread), with `errors[prompt_id]` failed calls."""

    def __init__(self, reward: Callable[[Sample, PromptExample], float] | None = None,
                 errors: dict[int, tuple[int, str]] | None = None):
        self.reward = reward or (lambda s, example: float(s.sample_index % 2))
        self.errors = errors or {}
        self.scored: list[int] = []        # prompt ids in the order their groups were scored
        self._lock = threading.Lock()

    def render(self, example: PromptExample) -> list[int]:
        return [1, 3 + example.id]

    def score_group(self, samples, example) -> GroupScore:
        with self._lock:
            self.scored.append(samples[0].prompt_id)
        errors, first = self.errors.get(samples[0].prompt_id, (0, None))
        return GroupScore(np.array([self.reward(s, example) for s in samples], np.float32),
                          errors, first)

    def episode_driver(self, example_of):
        return None


class FakeSampler:
    """Sampler.serve's contract without a model. Each loop (one "device call") polls the
    weights, fills free slots from next_request, then appends one token to every live request,
    tagged with the version in use, and hands finished samples to on_sample. A response has
    min(`length`, max_new_tokens) tokens (as `sample` builds them): finish "length" when that
    is max_new_tokens.

    Records what happened, for tests that must see it: `taken` (prompt_id, sample_index,
    version) per request taken, `finished` (prompt_id, sample_index) once on_sample returned,
    `params_seen` (prompt_id, params) of every token, `swaps` the versions swapped in,
    `empty_polls` how often next_request gave nothing while no slot was busy, `ended` once
    serve left (by return or exception), `threads` the ids of the threads serve ran in.
    between_calls(live) runs at the top of each loop,
    before the weights are polled (a test may block in it); live: [(prompt_id, sample_index,
    tokens so far)]. crash: raised by serve at once.
    """

    def __init__(self, *, num_slots: int = 4, length: int = 3,
                 between_calls: Callable[[list], None] | None = None,
                 crash: BaseException | None = None):
        self.num_slots, self.length = num_slots, length
        self.between_calls, self.crash = between_calls, crash
        self.idle_s = 0.0
        self.taken: list[tuple[int, int, int]] = []
        self.finished: list[tuple[int, int]] = []
        self.ended = False
        self.threads: set[int] = set()
        self.params_seen: list = []
        self.swaps: list[int] = []
        self.precompiled: list = []
        self.empty_polls = 0
        self.serve_calls = 0

    def precompile(self, params) -> None:
        self.precompiled.append(params)

    def serve(self, params, *, next_request, on_sample, version: int = 0, poll_weights=None,
              keep_alive=None, idle_wait_s: float = 0.001, on_turn=None) -> None:
        self.serve_calls += 1
        self.threads.add(threading.get_ident())
        try:
            self._serve(params, next_request, on_sample, version, poll_weights, keep_alive,
                        idle_wait_s)
        finally:
            self.ended = True

    def _serve(self, params, next_request, on_sample, version, poll_weights, keep_alive,
               idle_wait_s) -> None:
        if self.crash is not None:
            raise self.crash
        live: list[dict] = []
        while True:
            if self.between_calls is not None:
                self.between_calls([(r["prompt_id"], r["sample_index"], len(r["versions"]))
                                    for r in live])
            if poll_weights is not None:
                update = poll_weights()
                if update is not None:
                    params, version = update
                    self.swaps.append(version)
            while len(live) < self.num_slots:
                request = next_request()
                if request is None:
                    break
                prompt_id, sample_index, prompt, max_new = request
                self.taken.append((prompt_id, sample_index, version))
                live.append(dict(prompt_id=prompt_id, sample_index=sample_index,
                                 prompt=np.asarray(prompt, np.int32), max_new=max_new,
                                 versions=[]))
            if not live:
                if keep_alive is None or not keep_alive():
                    return
                self.empty_polls += 1
                self.idle_s += idle_wait_s
                time.sleep(idle_wait_s)
                continue
            for request in live:
                request["versions"].append(version)
                self.params_seen.append((request["prompt_id"], params))
            for request in [r for r in live if len(r["versions"]) >= self._limit(r)]:
                live.remove(request)
                on_sample(self._sample(request))
                self.finished.append((request["prompt_id"], request["sample_index"]))

    def _limit(self, request: dict) -> int:
        return min(self.length, request["max_new"])

    def _sample(self, request: dict) -> Sample:
        length = len(request["versions"])
        return sample(request["prompt_id"], request["sample_index"], length,
                      finish=FINISH_LENGTH if length == request["max_new"] else FINISH_STOP,
                      versions=request["versions"], prompt=request["prompt"])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Waits until condition() holds (a failure names `what` after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)
