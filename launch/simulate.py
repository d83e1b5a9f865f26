"""The real pipeline on simulated devices: every device call is a timed wait from a cost model.

    run = simulated_run(config, workdir, cost=CostModel(...), lengths=long_tail_lengths(64))
    run.run()

A simulated run is a Run whose sampler and trainer factories (jrl.pipeline.build_parts) give a
Sampler whose device side is SimulatedPrograms (jrl.sampling.programs.SlotPrograms) and a
SimulatedTrainer; everything else is the real part.

What stays real: the Run loop, the RolloutWorker's sampler threads, the admission queue (the
staleness bound, slot refill across steps), Sampler.serve's host loop (continuous batching,
weight polling and swaps, interruptible generation), version tags on every token, and
prepare_batch (staleness, drops, advantages). What is simulated: the sampler's prefill / decode /
KV refresh, the trainer's logprob scoring and update, and the weight copy. Each sleeps for the
time the cost model gives, so rollout and training really overlap in wall time as they would on
separate accelerators, however many CPU cores this machine has.

Response lengths come from `lengths(prompt_id, sample_index)`, not from a model; the sampled
tokens are zeros and their logprobs 0, so rewards and losses mean nothing: this measures
scheduling only.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import numpy as np

from jrl.pipeline import PreparedBatch, Published, Run, Trainer, prepare_batch
from jrl.pipeline.setup.samplers import build_sampler
from jrl.sampling import FINISH_LENGTH, Sample, Sampler
from jrl.sampling.programs import SlotPrograms
from jrl.train.state import TrainBatch


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per simulated device call.

    decode step of one sampler:  decode_step_s + decode_per_slot_s * active_slots
    prefill call:                prefill_call_s + prefill_per_token_s * prompt_tokens
    train on a batch:            train_step_s + train_per_token_s * response_tokens
                                 (scoring p_o / p_ref and the update together)
    weight sync:                 weight_bytes / sync_bytes_per_s
    """

    decode_step_s: float = 0.010
    decode_per_slot_s: float = 0.0002
    prefill_call_s: float = 0.004
    prefill_per_token_s: float = 0.00005
    train_step_s: float = 0.05
    train_per_token_s: float = 0.0003
    weight_bytes: float = 2e9
    sync_bytes_per_s: float = 1e11

    def decode_s(self, active_slots: int) -> float:
        return self.decode_step_s + self.decode_per_slot_s * active_slots

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_call_s + self.prefill_per_token_s * prompt_tokens

    def train_s(self, response_tokens: int) -> float:
        return self.train_step_s + self.train_per_token_s * response_tokens

    def sync_s(self) -> float:
        return self.weight_bytes / self.sync_bytes_per_s

    def scaled(self, factor: float) -> "CostModel":
        """Every time times `factor` (e.g. tiny for a quick test): the bytes stay, the
        bandwidth is divided by it."""
        rates = {"weight_bytes": self.weight_bytes,
                 "sync_bytes_per_s": self.sync_bytes_per_s / factor}
        times = {f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)
                 if f.name not in rates}
        return CostModel(**times, **rates)


Lengths = Callable[[int, int], int]   # (prompt_id, sample_index) -> response length


def long_tail_lengths(max_new_tokens: int, *, long_fraction: float = 0.125) -> Lengths:
    """A long-tailed response-length distribution: most responses take 1/16 - 1/4 of the budget,
    `long_fraction` of them 3/4 of it to all of it (seeded by the request, so repeatable)."""
    def lengths(prompt_id: int, sample_index: int) -> int:
        rng = np.random.default_rng([prompt_id, sample_index])
        if rng.random() < long_fraction:
            return int(rng.integers(3 * max_new_tokens // 4, max_new_tokens + 1))
        return int(rng.integers(max(1, max_new_tokens // 16), max_new_tokens // 4 + 1))
    return lengths


@dataclasses.dataclass
class _Slots:
    """Host-side slot state of a simulated sampler: per slot, the versions of the tokens
    generated so far and the length the response will have."""

    versions: list
    target: list

    @property
    def active(self) -> list[int]:
        return [s for s, v in enumerate(self.versions)
                if v is not None and len(v) < self.target[s]]


class SimulatedPrograms(SlotPrograms):
    """The device side of a Sampler as timed waits (see the module docstring): the real host
    loop, Sampler.serve, runs around it."""

    def __init__(self, cost: CostModel, lengths: Lengths, *, num_slots: int,
                 steps_per_call: int):
        self.cost, self.lengths = cost, lengths
        self.num_slots, self.steps_per_call = num_slots, steps_per_call

    def init_state(self, params=None) -> _Slots:
        return _Slots([None] * self.num_slots, [0] * self.num_slots)

    def start(self, params, state: _Slots, starts: list, version: int, seed) -> _Slots:
        time.sleep(self.cost.prefill_s(sum(len(request[2]) for _, request in starts)))
        for slot, (prompt_id, sample_index, _, limit) in starts:
            # Prefill draws the first token, as the real program does.
            state.versions[slot] = [version]
            state.target[slot] = min(limit, self.lengths(prompt_id, sample_index))
        return state

    def decode(self, params, state: _Slots, version: int, seed,
               stop_on_finish: bool) -> tuple[_Slots, int]:
        seconds, steps = 0.0, 0
        while steps < self.steps_per_call:
            active = state.active
            if not active:
                break
            seconds += self.cost.decode_s(len(active))
            for slot in active:
                state.versions[slot].append(version)
            steps += 1
            if stop_on_finish and len(state.active) < len(active):
                break
        time.sleep(seconds)
        return state, steps

    def refresh(self, params, state: _Slots, rows) -> _Slots:
        # A KV recompute of every active slot: one prefill-sized call over their tokens so far.
        time.sleep(self.cost.prefill_s(sum(len(state.versions[s]) for s in state.active)))
        return state

    def harvest(self, state: _Slots, slot_request: list, candidates: list[int]) -> list:
        out = []
        for slot in candidates:
            if slot in state.active:
                continue
            prompt_id, sample_index, prompt, _ = slot_request[slot]
            versions = np.asarray(state.versions[slot], np.int32)
            n = versions.size
            out.append((slot, Sample(
                prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=prompt,
                tokens=np.zeros((n,), np.int32), behavior_logp=np.zeros((n,), np.float32),
                logit_floor=np.full((n,), -np.inf, np.float32), versions=versions,
                entropy=None, finish_reason=FINISH_LENGTH)))
            state.versions[slot] = None
        return out


class SimulatedTrainer(Trainer):
    """A Trainer whose scoring, update and weight copy are timed waits; versions and held
    versions behave as the real ones (prepare_batch runs for real on zero logprobs)."""

    def __init__(self, *args, cost: CostModel, **kwargs):
        super().__init__(*args, **kwargs)
        self.cost = cost
        self.simulated_version = 0

    @property
    def version(self) -> int:
        return self.simulated_version

    def prepare(self, rollout) -> PreparedBatch:
        def score_with(packed):
            return lambda params: np.zeros(packed.tokens.shape, np.float32)
        return prepare_batch(rollout, trainer_version=self.version, current_params=None,
                             held=dict.fromkeys(self.versions), score_with=score_with,
                             options=self.options.prepare,
                             advantages=self.recipe.advantages, reference=None)

    def train_on(self, batch: TrainBatch, rl_step: int) -> dict:
        time.sleep(self.cost.train_s(int(np.asarray(batch.loss_mask).sum())))
        self.simulated_version += self.updates_per_step
        return {}

    def hold_version(self) -> int:
        self.versions[self.version] = None
        for old in sorted(self.versions)[:-self.keep_versions]:
            del self.versions[old]
        return self.version

    def publish(self, devices: list) -> Published:
        seconds = self.cost.sync_s()
        time.sleep(seconds)
        return Published([None] * len(devices), self.hold_version(), seconds)

    def save(self, rl_step: int, meta: dict) -> None:
        pass   # nothing real to save


def simulated_run(config, workdir: str, *, cost: CostModel, lengths: Lengths, **kwargs) -> Run:
    """A Run on simulated devices (config: any valid run config; its model only sets shapes);
    kwargs: Run's."""
    def sampler_factory(cfg, model_config, sampling) -> Sampler:
        return build_sampler(cfg, model_config, sampling, programs=SimulatedPrograms(
            cost, lengths, num_slots=cfg.rollout.num_slots,
            steps_per_call=cfg.rollout.steps_per_call))

    return Run(config, workdir, sampler_factory=sampler_factory,
               trainer_factory=functools.partial(SimulatedTrainer, cost=cost), **kwargs)
