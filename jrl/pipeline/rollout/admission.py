"""Streaming rollout with admission control: the request source the samplers pull from.

Groups (G samples of one prompt) are admitted in order, each for a target RL step b. A group for
step b may start only once the published policy version is at least b * U - k (U optimizer
updates per step, k = max_staleness): step b is consumed at version b * U, so every token it
holds is at most k versions old, and nothing has to be dropped (AReaL's capacity rule, applied in
order). Within that bound the samplers never idle: while the long tail of step b finishes, free
slots already generate step b + 1 if the version allows it. With k = 0 this is exactly the
synchronous loop.

Batches are assembled in admission order: step b's batch is its own groups (plus dynamic
sampling's replacements), so a batch's contents do not depend on which sample finished first,
and they are emitted in step order. A group is scored (the task's rewards, shaping, spread) in
numpy by the sampler thread that finished it, outside the admission lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from jrl.data import PromptExample, PromptStream
from jrl.metrics import names
from jrl.pipeline.rollout.group_stats import overlong_penalty, reward_spread
from jrl.pipeline.rollout.batch import RolloutBatch, RolloutOptions
from jrl.pipeline.rollout.task import Task
from jrl.sampling import FINISH_LENGTH, Sample
from jrl.sampling.speculative import speculative_metrics


@dataclasses.dataclass
class _Group:
    prompt_id: int
    example: PromptExample
    samples: dict = dataclasses.field(default_factory=dict)   # sample_index -> Sample
    # Set by _score_group once all samples are in (numpy, outside the lock).
    task_rewards: np.ndarray | None = None     # [G] float32
    shaped_rewards: np.ndarray | None = None   # [G] float32: task + overlong penalty
    lengths: np.ndarray | None = None          # [G] int32 model tokens
    reward_errors: int = 0
    first_reward_error: str | None = None
    reward_parts: dict | None = None           # {name: [G] float32}: a reward_fn's named parts
    useful: bool = True
    all_correct: bool = False
    all_wrong: bool = False


@dataclasses.dataclass
class _StepAssembly:
    """The groups admitted for one RL step, in admission order."""

    rl_step: int
    groups: list = dataclasses.field(default_factory=list)
    rounds: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)
    finished_groups: int = 0
    data_state: dict = dataclasses.field(default_factory=dict)   # stream state after its prompts


class AdmissionQueue:
    """Thread-safe request source for Sampler.serve and assembler of RolloutBatches.

    pop(version) -> (prompt_id, sample_index, tokens, max_new_tokens) or None (nothing admissible
    now); `version` is the policy version of the weights the caller will generate with: the
    staleness bound is checked against it, not against the latest published version, since a
    sampler may still hold older weights when it takes a request.
    on_sample(sample) records a finished sample; when a step's batch is complete it is handed,
    in step order, to `emit(batch)` (which may block on a bounded queue).
    task renders prompts and scores groups (jrl.pipeline.rollout.task); options: the batch shape and
    the staleness bound (jrl.pipeline.rollout.batch.RolloutOptions).
    """

    def __init__(self, *, first_step: int, last_step: int, stream: PromptStream, task: Task,
                 options: RolloutOptions, emit: Callable[[RolloutBatch], None]):
        self._lock = threading.Lock()
        # Held while finished batches are taken and emitted, so that they leave in step order.
        self._emit_lock = threading.Lock()
        self._stream = stream
        self._task = task
        self._options = options
        self._spec = options.spec
        self._emit = emit
        # With a sharded stream (PromptStream.shard(i, n)), shard i's j-th prompt of a draw of m
        # gets the id the unsharded stream would give it: global position + i * m + j.
        self._shard_index = options.shard_index
        self._last_step = last_step
        self._pending: collections.deque = collections.deque()
        self._steps: dict[int, _StepAssembly] = {}
        self._admitting = first_step       # lowest step still admitting its first round
        self._next_emit = first_step
        self._group_of: dict[int, tuple[int, _Group]] = {}   # prompt_id -> (step, group)

    # ------------------------------------------------------------------------------------------
    def example_of(self, prompt_id: int) -> PromptExample:
        """The example of a request still in flight (a multi-turn episode's environment is
        reset on it)."""
        with self._lock:
            return self._group_of[prompt_id][1].example

    def done(self) -> bool:
        with self._lock:
            return self._next_emit >= self._last_step

    def pop(self, version: int):
        with self._lock:
            request = self._pop_pending(version)
            if request is None:
                self._admit_locked(version)
                request = self._pop_pending(version)
            return request

    def _pop_pending(self, version: int):
        for i, (required, request) in enumerate(self._pending):
            if version >= required:
                del self._pending[i]
                return request
        return None

    def _admit_locked(self, version: int) -> None:
        """Admits the next group if a step needs one and `version` satisfies the bound."""
        # Replacement rounds of steps already started (dynamic sampling) come first: their
        # admission condition held when they started and versions only grow.
        for step in sorted(self._steps):
            assembly = self._steps[step]
            if assembly.rounds and self._needs_round(assembly):
                self._start_round(assembly)
                return
        step = self._admitting
        if step >= self._last_step:
            return
        if version < self._options.first_version(step):
            return
        assembly = self._steps.setdefault(step, _StepAssembly(step))
        self._start_round(assembly)
        self._admitting += 1

    def _needs_round(self, assembly: _StepAssembly) -> bool:
        """All admitted groups finished, too few useful ones, rounds left."""
        spec = self._spec
        if assembly.finished_groups < len(assembly.groups):
            return False
        if not spec.dynamic_sampling or assembly.rounds >= spec.max_rounds:
            return False
        return self._useful_count(assembly) < spec.prompts_per_step

    def _useful_count(self, assembly: _StepAssembly) -> int:
        return sum(1 for g in assembly.groups if g.useful)

    def _start_round(self, assembly: _StepAssembly) -> None:
        missing = self._spec.prompts_per_step - (
            self._useful_count(assembly) if assembly.rounds else 0)
        assembly.rounds += 1
        first_id = self._stream.examples_consumed + self._shard_index * missing
        examples = self._stream.next_batch(missing)
        for i, example in enumerate(examples):
            prompt_id = first_id + i
            group = _Group(prompt_id, example)
            assembly.groups.append(group)
            self._group_of[prompt_id] = (assembly.rl_step, group)
            tokens = np.asarray(self._task.render(example), np.int32)
            required = self._options.first_version(assembly.rl_step)
            for sample_index in range(self._spec.group_size):
                self._pending.append((required, (prompt_id, sample_index, tokens,
                                                 self._spec.max_new_tokens)))
        assembly.data_state = self._stream.state_dict()

    # ------------------------------------------------------------------------------------------
    def on_sample(self, sample: Sample) -> None:
        with self._lock:
            step, group = self._group_of[sample.prompt_id]
            group.samples[sample.sample_index] = sample
            if len(group.samples) < self._spec.group_size:
                return
            del self._group_of[sample.prompt_id]
        self._score_group(group)            # reward calls and statistics: outside the lock
        with self._emit_lock:
            with self._lock:
                self._steps[step].finished_groups += 1
                ready = []
                while self._next_emit in self._steps and \
                        self._complete(self._steps[self._next_emit]):
                    ready.append(self._steps.pop(self._next_emit))
                    self._next_emit += 1
            # Finished assemblies belong to this thread now: numpy work without the lock.
            for assembly in ready:
                self._emit(self._finalize(assembly))

    def _score_group(self, group: _Group) -> None:
        """A finished group's task rewards (the task's reward function, or the episodes'
        rewards), their spread and the overlong shaping, in numpy."""
        spec = self._spec
        samples = [group.samples[i] for i in range(spec.group_size)]
        score = self._task.score_group(samples, group.example)
        group.task_rewards = score.rewards
        group.reward_errors, group.first_reward_error = score.reward_errors, score.first_error
        group.reward_parts = score.parts or {}
        group.useful, group.all_correct, group.all_wrong = reward_spread(score.rewards)
        # Lengths count model tokens: observations are the environment's, not the policy's.
        group.lengths = np.array([s.num_model_tokens for s in samples], np.int32)
        group.shaped_rewards = score.rewards
        if spec.overlong_buffer > 0:
            group.shaped_rewards = score.rewards + overlong_penalty(
                group.lengths, max_len=spec.max_new_tokens, buffer_len=spec.overlong_buffer,
                factor=spec.overlong_factor)

    def _complete(self, assembly: _StepAssembly) -> bool:
        if assembly.finished_groups < len(assembly.groups):
            return False
        return not self._needs_round(assembly)

    def _finalize(self, assembly: _StepAssembly) -> RolloutBatch:
        """The step's batch from its scored groups (kept: the useful ones with dynamic
        sampling, at most prompts_per_step) and its rollout/* metrics over every group seen."""
        spec = self._spec
        group_size = spec.group_size
        kept = [g for g in assembly.groups if g.useful or not spec.dynamic_sampling]
        kept = kept[:spec.prompts_per_step]
        groups = assembly.groups
        samples = [[g.samples[i] for i in range(group_size)] for g in groups]
        lengths = np.concatenate([g.lengths for g in groups])
        episodes = [s.episode for group in samples for s in group if s.episode is not None]
        observation_tokens = sum(s.length - s.num_model_tokens for group in samples
                                 for s in group)
        first_error = next((g.first_reward_error for g in groups if g.first_reward_error), None)
        metrics = {
            names.ROLLOUT_REWARD_MEAN: float(np.concatenate([g.task_rewards
                                                             for g in groups]).mean()),
            names.ROLLOUT_RESPONSE_LEN_MEAN: float(lengths.mean()),
            names.ROLLOUT_TRUNCATED_FRAC: float(np.mean([s.finish_reason == FINISH_LENGTH
                                                         for group in samples for s in group])),
            names.ROLLOUT_ZERO_STD_GROUPS_ALL_CORRECT: sum(g.all_correct for g in groups),
            names.ROLLOUT_ZERO_STD_GROUPS_ALL_WRONG: sum(g.all_wrong for g in groups),
            names.ROLLOUT_REWARD_ERRORS: sum(g.reward_errors for g in groups),
            names.ROLLOUT_SAMPLING_ROUNDS: assembly.rounds,
            names.ROLLOUT_GROUPS_KEPT: len(kept),
            names.TIME_ROLLOUT_S: time.perf_counter() - assembly.started,
        }
        metrics.update(reward_part_metrics([g.reward_parts for g in groups], group_size))
        # rollout/spec_*: over every sample seen, as the length and reward means are.
        metrics.update(speculative_metrics([s for group in samples for s in group]))
        if episodes:
            metrics.update(episode_metrics(episodes))
            response_tokens = int(lengths.sum()) + observation_tokens
            metrics[names.ROLLOUT_OBSERVATION_TOKEN_FRAC] = (observation_tokens
                                                             / max(response_tokens, 1))
        rewards = (np.concatenate([g.shaped_rewards for g in kept]) if kept
                   else np.zeros((0,), np.float32))
        return RolloutBatch(rl_step=assembly.rl_step,
                            samples=[g.samples[i] for g in kept for i in range(group_size)],
                            examples=[g.example for g in kept for _ in range(group_size)],
                            rewards=rewards, group_size=group_size,
                            data_state=assembly.data_state, metrics=metrics,
                            first_reward_error=first_error)


def reward_part_metrics(parts: list[dict], group_size: int) -> dict:
    """rollout/reward_part/<name>: the mean of each named reward part over the rows that
    returned it (parts: one {name: [G] float32, NaN where missing} per group)."""
    out = {}
    for name in sorted({name for group in parts for name in group}):
        values = np.concatenate([group.get(name, np.full([group_size], np.nan, np.float32))
                                 for group in parts])
        if np.isfinite(values).any():
            out[names.reward_part(name)] = float(np.nanmean(values))
    return out


def episode_metrics(records: list) -> dict:
    """rollout/* of multi-turn episodes from their EpisodeRecords (jrl.pipeline.rollout.episodes)."""
    return {
        names.ROLLOUT_TURNS_MEAN: float(np.mean([r.turns for r in records])),
        names.ROLLOUT_TOOL_CALLS_MEAN: float(np.mean([r.tool_calls for r in records])),
        names.ROLLOUT_TOOL_ERRORS: int(sum(r.tool_errors for r in records)),
        names.ROLLOUT_TOOL_TIMEOUTS: int(sum(r.tool_timeouts for r in records)),
        names.ROLLOUT_TURN_BUDGET_FRAC: float(np.mean([r.turn_budget_hit for r in records])),
    }
