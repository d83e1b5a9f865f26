"""The RL run: rollout and training connected by a bounded queue, with explicit policy versions.

One code path serves synchronous and asynchronous training. A rollout thread generates the
batch of RL step i on the rollout devices as soon as admission allows it: when the weights it
would use are at most `max_staleness` versions behind the version that will consume the batch
(AReaL's capacity rule). With max_staleness = 0 that is exactly the synchronous loop
(sample -> reward -> filter -> advantages -> train -> sync weights). The main thread trains on
the train devices, publishes new weights to the rollout devices (timed), evaluates, checkpoints
and writes metrics. All impurity (threads, queues, clocks, files) lives here and in launch/.

Versions: every optimizer update makes a new policy version; the weights published after RL
step i have version (i + 1) * updates_per_step. Every generated token records the version of
the weights that produced it; staleness = trainer version at consumption - token version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import queue
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from jrl import losses
from jrl.data import PromptExample, PromptStream, with_wrong_final_answers
from jrl.kernels.contract import NumericalContract
from jrl.metrics import ProgressBar, make_writers
from jrl.pipeline import builders
from jrl.pipeline.batching import pack_samples, select_rows
from jrl.pipeline.config_tools import to_dict
from jrl.pipeline.experiment import ExperimentConfig
from jrl.pipeline.admission import AdmissionQueue
from jrl.pipeline.rollout import RolloutBatch, RolloutSpec
from jrl.rewards import extract_last_number, math_reward, numbers_equal
from jrl.sampling import Sample, Sampler
from jrl.train import (OptimizerConfig, TrainBatch, TrainState, create_train_state,
                       make_logprob_fn, make_optimizer, make_sft_step, make_train_step)
from jrl.train.checkpoint import Checkpointer


class RunStopped(Exception):
    """Raised inside the rollout thread when the run is shutting down."""


@dataclasses.dataclass
class RunResult:
    state: TrainState
    history: list[dict]
    final_eval: dict
    workdir: str


class _WeightBoard:
    """The latest published weights, one copy per rollout device, and their version."""

    def __init__(self):
        self._lock = threading.Lock()
        self.version = -1
        self.params: list = []

    def publish(self, params_per_device: list, version: int) -> None:
        with self._lock:
            self.params, self.version = params_per_device, version

    def latest(self) -> tuple[list, int]:
        with self._lock:
            return self.params, self.version


class Run:
    """An experiment: build everything from the config, then `run()`.

    workdir holds checkpoints/ and metrics.jsonl. resume=True continues from the latest
    checkpoint. reward_fn(response_text, example) -> float | RewardResult (default: the math
    verifier); raise_reward_errors=True stops the run on the first failing reward call instead of
    counting it as reward 0. spmd: see __init__ (default: jax.process_count() > 1).
    """

    def __init__(self, config: ExperimentConfig, workdir: str, *, resume: bool = False,
                 reward_fn: Callable | None = None, raise_reward_errors: bool = False,
                 log: Callable[[str], None] = print, devices: list | None = None,
                 write_metrics: bool = True, spmd: bool | None = None):
        self.config = config
        self.workdir = os.path.abspath(workdir)
        self.resume = resume
        self.log = log
        self.raise_reward_errors = raise_reward_errors
        os.makedirs(self.workdir, exist_ok=True)
        cfg = config
        self.contract: NumericalContract = cfg.numerics

        # Devices: disjoint rollout and train sets when the config asks for them. Several
        # processes (SPMD): each samples its share of the prompts on its first local device, and
        # training runs on one mesh over every process's devices.
        # spmd: one run over every process (default when there are several); False keeps this
        # process's Run local (jrl.pipeline.multihost drives such runs itself).
        self.multi = jax.process_count() > 1 if spmd is None else spmd
        self._writes_files = not self.multi or jax.process_index() == 0   # metrics, config.json
        if self.multi:
            self._check_multi(cfg)
            self.rollout_devices = [jax.local_devices()[0]]
            self.train_devices = list(jax.devices())
        else:
            devices = list(devices if devices is not None else jax.devices())
            self.rollout_devices, self.train_devices = builders.split_devices(
                devices, cfg.pipeline.rollout_devices, cfg.pipeline.train_devices)
        self.train_device = self.train_devices[0]

        # Model, tokenizer, data.
        self.model_config, params, self.tokenizer = builders.build_model(cfg)
        self.stop_tokens = tuple(sorted(set(cfg.sampling.stop_tokens)
                                        | set(self.tokenizer.stop_ids)))
        self.sampling = cfg.sampling.replace(stop_tokens=self.stop_tokens)
        self.train_examples, self.eval_examples = builders.build_data(cfg)
        self.template = builders.build_template(cfg)
        self.stream = PromptStream(self.train_examples, seed=cfg.data.seed)
        if self.multi:
            self.stream = self.stream.shard(jax.process_index(), jax.process_count())
        self.reward_fn = reward_fn or (lambda text, example: math_reward(
            text, example, mode=cfg.rollout.reward_mode, format_reward=cfg.rollout.format_reward))

        # Loss and train step.
        self.loss_fn = builders.build_loss(cfg)
        self.optimizer = make_optimizer(cfg.optimizer)
        self.updates_per_step = cfg.train.mini_batches * cfg.train.epochs
        self.rows = cfg.rollout.prompts_per_step * cfg.sampling.group_size
        self.seq_len = cfg.rollout.max_prompt_len + cfg.sampling.max_new_tokens
        self._setup_train_devices(params)
        self.reference = None

        # Samplers: one replica per rollout device, plus a greedy one for evaluation.
        self.samplers = [self._make_sampler(self.sampling) for _ in self.rollout_devices]
        self.eval_sampler = self._make_sampler(self.sampling.replace(greedy=True, group_size=1))
        self.rollout_spec = RolloutSpec(
            prompts_per_step=cfg.rollout.prompts_per_step // (
                jax.process_count() if self.multi else 1),
            group_size=cfg.sampling.group_size,
            max_new_tokens=cfg.sampling.max_new_tokens,
            dynamic_sampling=cfg.rollout.dynamic_sampling,
            max_rounds=cfg.rollout.max_sampling_rounds,
            overlong_buffer=cfg.rollout.overlong_buffer,
            overlong_factor=cfg.rollout.overlong_factor)

        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                         keep=cfg.checkpoint.keep)
        self.start_step = 0
        self.history: list[dict] = []
        self._write_metrics = write_metrics
        self._versions: dict[int, Any] = {}   # version -> params on the train device
        self.consumed: list[dict] = []        # per RL step: the versions the trainer consumed
        self._started = False
        self.resumed_from: int | None = None
        self.log(f"jrl run {cfg.name!r}: {self.model_config.num_params():,} params, "
                 f"backend={self.contract.backend} ({self.contract.compute_dtype}), "
                 f"rollout devices {len(self.rollout_devices)}, train devices "
                 f"{len(self.train_devices)}, max_staleness={cfg.pipeline.max_staleness}")
        self.log(f"loss: {self.loss_fn!r}")

    # ------------------------------------------------------------------------------------------
    # Building blocks

    @staticmethod
    def _check_multi(cfg: ExperimentConfig) -> None:
        """The SPMD multi-process run's requirements (ValueError naming the config key)."""
        count = jax.process_count()
        if cfg.rollout.prompts_per_step % count:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be "
                             f"divisible by the number of processes ({count})")
        if cfg.rollout.dynamic_sampling:
            raise ValueError("rollout.dynamic_sampling is not supported with several processes "
                             "(every host must draw the same number of prompts)")
        shards = jax.device_count() // max(1, cfg.pipeline.train_mesh_tensor)
        if cfg.train.micro_batches % shards:
            raise ValueError(f"train.micro_batches={cfg.train.micro_batches} must be a multiple "
                             f"of the row shards of the train mesh ({shards} = "
                             f"{jax.device_count()} devices / tensor "
                             f"{cfg.pipeline.train_mesh_tensor})")

    def _put_batch(self, batch):
        """A host (numpy) batch, identical on every process, onto the batch placement."""
        if self.multi:
            from jrl.parallel import host_to_global
            return host_to_global(batch, self._batch_placement)
        return jax.device_put(batch, self._batch_placement)

    @staticmethod
    def _host(tree):
        """Whole values as numpy (an all-gather across processes where needed)."""
        from jrl.parallel import global_to_host
        return global_to_host(tree)

    @staticmethod
    def _allgather_objects(obj) -> list:
        """Every process's `obj` (picklable), in process order, on every process."""
        from jax.experimental import multihost_utils
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.asarray(multihost_utils.process_allgather(
            np.array([data.size], np.int32))).reshape(-1)
        padded = np.zeros((int(sizes.max()),), np.uint8)
        padded[:data.size] = data
        gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(
            len(sizes), -1)
        return [pickle.loads(gathered[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]

    def _setup_train_devices(self, params) -> None:
        """The jitted train step and logprob forward, on one device or row-parallel over the
        train devices (FSDP params and optimizer state, bitwise equal to one device)."""
        cfg = self.config
        step_args = dict(num_micro_batches=cfg.train.micro_batches,
                         temperature=cfg.sampling.temperature,
                         with_reference=cfg.train.reference != "none")
        state = create_train_state(params, self.optimizer, jax.random.PRNGKey(cfg.seed))
        if len(self.train_devices) == 1:
            self.mesh = None
            self._train_step = jax.jit(make_train_step(
                self.model_config, self.contract, self.loss_fn, self.optimizer, **step_args))
            self._logprobs = jax.jit(make_logprob_fn(self.model_config, self.contract,
                                                     temperature=cfg.sampling.temperature))
            # Every leaf committed to the train device, as the step's outputs are: no second
            # compile.
            self._state_placement = self.train_device
            self._batch_placement = self.train_device
        else:
            from jrl import parallel
            self.mesh = parallel.make_mesh(
                parallel.MeshConfig(data=cfg.pipeline.train_mesh_data, fsdp=-1,
                                    tensor=cfg.pipeline.train_mesh_tensor),
                devices=self.train_devices)
            shardings = parallel.train_state_shardings(jax.eval_shape(lambda: state),
                                                       self.model_config, self.mesh)
            self._train_step = parallel.shard_train_step(
                parallel.make_parallel_train_step(self.model_config, self.contract, self.loss_fn,
                                                  self.optimizer, self.mesh, **step_args),
                shardings, parallel.batch_sharding(self.mesh), donate=False)
            self._logprobs = jax.jit(parallel.make_parallel_logprob_fn(
                self.model_config, self.contract, self.mesh,
                temperature=cfg.sampling.temperature))
            self._state_placement = shardings
            self._batch_placement = parallel.batch_sharding(self.mesh)
        if self.multi:
            from jrl.parallel import host_to_global
            self.state = host_to_global(jax.device_get(state), self._state_placement)
        else:
            self.state = jax.device_put(state, self._state_placement)

    def _make_sampler(self, sampling) -> Sampler:
        cfg = self.config
        kwargs = {}
        if cfg.pipeline.kv_on_swap == "recompute":
            kwargs["recompute_kv_on_swap"] = True
        return Sampler(self.model_config, self.contract, sampling,
                       num_slots=cfg.rollout.num_slots, max_prompt_len=cfg.rollout.max_prompt_len,
                       steps_per_call=cfg.rollout.steps_per_call, **kwargs)

    def render_prompt(self, example: PromptExample) -> list[int]:
        return builders.encode_prompt(self.template, self.tokenizer, example)

    def decode_response(self, sample: Sample) -> str:
        # Ids past the tokenizer's vocabulary (padded embedding rows) decode to nothing.
        vocab = self.tokenizer.vocab_size
        tokens = [int(t) for t in sample.tokens
                  if int(t) not in self.stop_tokens and int(t) < vocab]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------
    # Supervised warm start

    def warm_start(self) -> None:
        """sft_steps of token-mean cross-entropy on the training set's worked solutions."""
        cfg = self.config
        if cfg.train.sft_steps == 0:
            return
        optimizer = make_optimizer(OptimizerConfig(
            learning_rate=cfg.train.sft_learning_rate, warmup_steps=0, weight_decay=0.0,
            max_grad_norm=1.0))
        # Several processes: every one runs the same SFT on its first local device.
        sft_device = self.rollout_devices[0] if self.multi else self.train_device
        params = self._host(self.state.params) if self.multi else self.state.params
        state = jax.device_put(create_train_state(params, optimizer,
                                                  jax.random.PRNGKey(cfg.seed)), sft_device)
        step = jax.jit(make_sft_step(self.model_config, self.contract, optimizer))
        examples = with_wrong_final_answers(self.train_examples, cfg.train.sft_wrong_answer_frac,
                                            seed=cfg.data.seed + 2)
        stream = PromptStream(examples, seed=cfg.data.seed + 1)
        start = time.perf_counter()
        for i in range(cfg.train.sft_steps):
            batch = builders.sft_batch(stream.next_batch(cfg.train.sft_batch_size), self.tokenizer,
                                       self.render_prompt, self.seq_len)
            state, metrics = step(state, jax.device_put(batch, sft_device))
            if (i + 1) % max(1, cfg.train.sft_steps // 5) == 0 or i == 0:
                self.log(f"  sft {i + 1}/{cfg.train.sft_steps}: loss "
                         f"{float(metrics['sft/loss']):.4f}")
        if self.multi:
            from jrl.parallel import host_to_global
            self.state = self.state._replace(params=host_to_global(
                jax.device_get(state.params), self._state_placement.params))
        else:
            self.state = jax.device_put(self.state._replace(params=state.params),
                                        self._state_placement)
        self.log(f"warm start: {cfg.train.sft_steps} steps in {time.perf_counter() - start:.1f}s")

    # ------------------------------------------------------------------------------------------
    # Evaluation

    def evaluate(self) -> dict:
        """Greedy (and sampled) accuracy on the held-out prompts with the current weights."""
        cfg = self.config
        if not self.eval_examples:
            return {}
        params = jax.device_put(self._host(self.state.params) if self.multi
                                else self.state.params, self.rollout_devices[0])
        requests = [(10**9 + i, self.render_prompt(e)) for i, e in enumerate(self.eval_examples)]
        out = {}
        runs = []
        if cfg.eval.greedy:
            runs.append(("eval/accuracy_greedy", self.eval_sampler, 1))
        if cfg.eval.sampled:
            runs.append(("eval/accuracy_sampled", self.samplers[0], 1))
        for name, sampler, group in runs:
            samples = sampler.generate(params, requests, version=int(self.state.version),
                                       group_size=group)
            correct, last_number = [], []
            for sample, example in zip(samples, self.eval_examples):
                text = self.decode_response(sample)
                result = self.reward_fn(text, example)
                correct.append(bool(result.correct) if hasattr(result, "correct")
                               else float(result) > 0)
                # Format-free: the response's last number, wherever it stands, so a gain that
                # is only the answer format shows as a gap between the two figures.
                last_number.append(numbers_equal(extract_last_number(text), example.answer))
            out[name] = float(np.mean(correct))
            out[name + "_last_number"] = float(np.mean(last_number))
        if out:
            out["eval/accuracy"] = out.get("eval/accuracy_greedy",
                                           out.get("eval/accuracy_sampled"))
        return out

    # ------------------------------------------------------------------------------------------
    # Weights

    def _publish(self) -> float:
        """Copies the trainer's params to every rollout device; returns the seconds it took."""
        start = time.perf_counter()
        version = int(self.state.version)
        source = self._host(self.state.params) if self.multi else self.state.params
        copies = [jax.device_put(source, device) for device in self.rollout_devices]
        jax.block_until_ready(copies)
        self._versions[version] = self.state.params
        for old in sorted(self._versions)[:-max(self.config.pipeline.keep_versions,
                                                 self.config.pipeline.max_staleness + 1)]:
            del self._versions[old]
        self._board.publish(copies, version)
        return time.perf_counter() - start

    # ------------------------------------------------------------------------------------------
    # Rollout side (a thread)

    def _rollout_loop(self, first_step: int, last_step: int) -> None:
        """Runs one streaming sampler per rollout device, all fed by one admission queue."""
        cfg = self.config

        def emit(batch: RolloutBatch) -> None:
            while True:
                if self._stop.is_set():
                    raise RunStopped()
                try:
                    self._queue.put(batch, timeout=0.05)
                    return
                except queue.Full:
                    continue

        admission = AdmissionQueue(
            first_step=first_step, last_step=last_step, stream=self.stream,
            spec=self.rollout_spec, updates_per_step=self.updates_per_step,
            max_staleness=cfg.pipeline.max_staleness,
            render=self.render_prompt,
            decode=self.decode_response, reward_fn=self.reward_fn,
            raise_reward_errors=self.raise_reward_errors, emit=emit,
            shard_index=jax.process_index() if self.multi else 0)
        self._admission = admission

        def replica(r: int) -> None:
            try:
                params_all, version = self._board.latest()
                outstanding = [0]   # requests taken by this replica and not yet finished
                local = {"version": version}

                def next_request():
                    if self._stop.is_set():
                        raise RunStopped()
                    request = admission.pop(local["version"])
                    if request is not None:
                        outstanding[0] += 1
                    return request

                def on_sample(sample):
                    outstanding[0] -= 1
                    admission.on_sample(sample)

                def poll():
                    if self._stop.is_set():
                        raise RunStopped()
                    params, latest = self._board.latest()
                    if latest <= local["version"]:
                        return None
                    # Without interruption, new weights wait until in-flight samples finish.
                    if not cfg.pipeline.interrupt and outstanding[0] > 0:
                        return None
                    local["version"] = latest
                    return params[r], latest

                self.samplers[r].serve(
                    params_all[r], next_request=next_request, on_sample=on_sample,
                    version=version, poll_weights=poll,
                    keep_alive=lambda: not admission.done() and not self._stop.is_set())
            except RunStopped:
                return
            except BaseException as err:  # surfaced in the main thread
                if self._rollout_error is None:
                    self._rollout_error = err
                self._stop.set()

        threads = [threading.Thread(target=replica, args=(r,), daemon=True,
                                    name=f"jrl-rollout-{r}") for r in range(len(self.samplers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # ------------------------------------------------------------------------------------------
    # Train side

    def _rollout_idle_fraction(self) -> float:
        """Fraction of the time since the last call that the samplers sat with no request."""
        now = time.perf_counter()
        idle = sum(sampler.idle_s for sampler in self.samplers)
        last_time, last_idle = getattr(self, "_idle_mark", (now, idle))
        self._idle_mark = (now, idle)
        return (idle - last_idle) / max((now - last_time) * len(self.samplers), 1e-9)

    def _next_batch(self) -> RolloutBatch:
        while True:
            if self._rollout_error is not None:
                raise self._rollout_error
            try:
                return self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._rollout_thread.is_alive() and self._queue.empty():
                    if self._rollout_error is not None:
                        raise self._rollout_error
                    raise RuntimeError("rollout thread ended without producing a batch")

    def _gather_rollout(self, local: RolloutBatch) -> RolloutBatch:
        """Several processes: every host's RolloutBatch (its share of the step's prompts) joined
        in process order into the step's global batch, identical on every host."""
        parts = self._allgather_objects(
            (local.rl_step, local.samples, local.examples, local.rewards, local.metrics))
        if len({p[0] for p in parts}) != 1:
            raise RuntimeError(f"processes disagree on the RL step: {[p[0] for p in parts]}")
        samples = [s for p in parts for s in p[1]]
        examples = [e for p in parts for e in p[2]]
        rewards = np.concatenate([np.asarray(p[3], np.float32) for p in parts])
        weights = np.array([max(len(p[1]), 1) for p in parts], np.float64)
        metrics = {}
        for name, value in parts[0][4].items():
            values = [p[4][name] for p in parts]
            if name.endswith(("_mean", "_frac")):
                metrics[name] = float(np.average(values, weights=weights))
            elif name.startswith("time/") or name == "rollout/sampling_rounds":
                metrics[name] = max(values)
            else:
                metrics[name] = sum(values)
        return dataclasses.replace(local, samples=samples, examples=examples, rewards=rewards,
                                   metrics=metrics)

    def _prepare(self, rollout: RolloutBatch) -> tuple[TrainBatch, dict]:
        """Packs a rollout batch, measures mismatch and staleness, sets old/ref logp and
        advantages."""
        cfg = self.config
        version = int(self.state.version)
        metrics = dict(rollout.metrics)
        samples, rewards = rollout.samples, rollout.rewards
        group = rollout.group_size

        # Hard staleness bound (admission control should make this a no-op).
        dropped = 0
        if cfg.pipeline.drop_stale_beyond is not None and samples:
            keep_groups = []
            for g in range(len(samples) // group):
                members = samples[g * group:(g + 1) * group]
                oldest = min(int(s.versions.min()) for s in members)
                if version - oldest > cfg.pipeline.drop_stale_beyond:
                    dropped += group
                else:
                    keep_groups.append(g)
            samples = [samples[g * group + j] for g in keep_groups for j in range(group)]
            rewards = np.concatenate([rewards[g * group:(g + 1) * group] for g in keep_groups]) \
                if keep_groups else np.zeros((0,), np.float32)
        metrics["rollout/dropped_stale"] = dropped

        batch, versions = pack_samples(samples, np.zeros((self.rows,), np.float32),
                                       num_rows=self.rows, seq_len=self.seq_len)
        response = batch.loss_mask
        staleness = np.where(response, version - versions, 0)
        metrics["rollout/staleness_mean"] = float(staleness[response].mean()) if response.any() \
            else 0.0
        metrics["rollout/staleness_max"] = int(staleness.max()) if response.any() else 0

        # p_o for every held version: the train engine on the weights that sampled the token.
        device_batch = self._put_batch(batch)
        current_logp, _ = self._logprobs(self.state.params, device_batch.tokens,
                                         device_batch.attn_mask, device_batch.logit_floor)
        current_logp = self._host(current_logp)
        p_o = np.where(versions == version, current_logp, np.nan)
        for held, params in self._versions.items():
            if held != version and np.any(response & (versions == held)):
                logp, _ = self._logprobs(params, device_batch.tokens, device_batch.attn_mask,
                                         device_batch.logit_floor)
                p_o = np.where(versions == held, self._host(logp), p_o)
        # A token is reproducible by one version when every KV entry it attended to was computed
        # with that version: always after a KV recompute on weight swap; with the KV kept, only
        # while the sample has not crossed a swap (versions never decrease along a sample).
        first_version = np.where(response, versions, np.iinfo(np.int32).max).min(axis=1)
        single_version = response & (versions == first_version[:, None])
        reproducible = response if cfg.pipeline.kv_on_swap == "recompute" else single_version
        held_mask = reproducible & ~np.isnan(p_o)
        numerical = np.abs(p_o - batch.behavior_logp)[held_mask]
        stale = np.abs(current_logp - p_o)[held_mask]
        metrics["mismatch/kv_mixed_token_frac"] = float(
            (response & ~reproducible).sum() / max(response.sum(), 1))
        self.consumed.append({"rl_step": rollout.rl_step, "trainer_version": version,
                              "token_versions": sorted(set(versions[response].tolist())),
                              "staleness_max": metrics["rollout/staleness_max"]})
        metrics["mismatch/logprob_abs_diff_max"] = float(numerical.max()) if numerical.size else 0.0
        metrics["mismatch/numerical_abs"] = float(numerical.mean()) if numerical.size else 0.0
        metrics["mismatch/staleness_abs"] = float(stale.mean()) if stale.size else 0.0
        metrics["mismatch/held_token_frac"] = float(held_mask.sum() / max(response.sum(), 1))

        if cfg.train.old_logp == "recompute":
            batch = batch._replace(old_logp=np.where(response, current_logp, 0.0)
                                   .astype(np.float32))
        rewards_full = np.zeros((self.rows,), np.float32)
        rewards_full[:len(samples)] = rewards
        if self.reference is not None:
            ref_logp, _ = self._logprobs(self.reference, device_batch.tokens,
                                         device_batch.attn_mask, device_batch.logit_floor)
            ref_logp = np.where(response, self._host(ref_logp), 0.0).astype(np.float32)
            batch = batch._replace(ref_logp=ref_logp)
            if cfg.train.reference == "reward":
                k1 = np.where(response, batch.behavior_logp - ref_logp, 0.0).sum(axis=1)
                rewards_full = rewards_full - cfg.train.kl_reward_coef * k1
                metrics["train/ref_kl"] = float(k1[:len(samples)].mean()) if samples else 0.0
        advantages = np.zeros((self.rows,), np.float32)
        num_kept = (len(samples) // group) * group
        if num_kept:
            advantages[:num_kept] = np.asarray(losses.group_advantages(
                rewards_full[:num_kept], group, std_power=cfg.loss.std_power,
                unbiased=cfg.loss.unbiased_std))
        batch = batch._replace(advantages=advantages)
        return batch, metrics

    def _train_on(self, batch: TrainBatch, rl_step: int) -> dict:
        cfg = self.config
        per_update = self.rows // cfg.train.mini_batches
        rng = np.random.default_rng([cfg.seed, rl_step])
        collected: list[dict] = []
        for epoch in range(cfg.train.epochs):
            order = rng.permutation(self.rows) if self.updates_per_step > 1 else \
                np.arange(self.rows)
            for j in range(cfg.train.mini_batches):
                rows = order[j * per_update:(j + 1) * per_update]
                mini = self._put_batch(select_rows(batch, rows))
                self.state, metrics = self._train_step(self.state, mini)
                collected.append(metrics)
        host = self._host(collected) if self.multi else jax.device_get(collected)
        out = {name: float(np.mean([m[name] for m in host])) for name in host[0]}
        for name in host[0]:
            if name.endswith("_max"):
                out[name] = float(np.max([m[name] for m in host]))
            elif name.endswith("_min"):
                out[name] = float(np.min([m[name] for m in host]))
        out["train/lr"] = float(builders.learning_rate_at(
            cfg.optimizer, int(self._host(self.state.step) if self.multi else self.state.step)))
        return out

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def _meta(self, rl_step: int, data_state: dict) -> dict:
        return {"rl_step": rl_step, "version": int(self.state.version),
                "data_state": data_state, "config": to_dict(self.config),
                "numerics": self.contract.to_dict(), "model": self.model_config.to_dict()}

    def save_checkpoint(self, rl_step: int, data_state: dict) -> None:
        self.checkpointer.save(rl_step, self.state, self._meta(rl_step, data_state),
                               reference=self.reference)
        self.log(f"checkpoint: step {rl_step} -> {self.checkpointer.directory}")

    def _try_resume(self) -> bool:
        if not self.resume or self.checkpointer.latest_step() is None:
            if self.resume:
                self.log("resume: no checkpoint yet, starting fresh")
            return False
        meta = self.checkpointer.read_meta()
        NumericalContract.from_dict(meta["numerics"]).check_compatible(
            self.contract, what="checkpoint")
        if meta["model"] != self.model_config.to_dict():
            raise ValueError("resume: the checkpoint's model config differs from this run's: "
                             f"{meta['model']} vs {self.model_config.to_dict()}")
        like_reference = self.state.params if meta["config"]["train"]["reference"] != "none" \
            else None
        state, reference, meta = self.checkpointer.restore(self.state,
                                                           like_reference=like_reference)
        # Restored into self.state's shardings (global ones with several processes).
        self.state = state if self.multi else jax.device_put(state, self._state_placement)
        self.reference = reference
        self.stream.load_state_dict(meta["data_state"])
        self.start_step = int(meta["rl_step"])
        self.resumed_from = self.start_step
        self.log(f"resume: from step {self.start_step} (version {int(self.state.version)})")
        return True

    # ------------------------------------------------------------------------------------------
    # The loop

    def _open_writer(self, *, fresh: bool):
        if not self._write_metrics:
            return None
        tensorboard = {"auto": "auto", "true": True, "false": False}[self.config.tensorboard]
        path = os.path.join(self.workdir, "metrics.jsonl")
        if fresh and os.path.exists(path) and self._writes_files:
            os.remove(path)   # a new run in an old workdir starts a new metrics file
        return make_writers(self.workdir, tensorboard=tensorboard,
                            is_main_process=self._writes_files,
                            resume_step=None if fresh else self.start_step)

    def run(self, *, steps: int | None = None) -> RunResult:
        """Trains until config.train.steps RL steps (or `steps` more) are done.

        May be called again to continue (e.g. run(steps=1) to compile, then run()).
        """
        cfg = self.config
        final_eval: dict = {}
        if not self._started:
            self._started = True
            resumed = self._try_resume()
            if not resumed:
                self.warm_start()
                if cfg.train.reference != "none":
                    self.reference = self.state.params
            writer = self._open_writer(fresh=not resumed)
            if self._writes_files:
                with open(os.path.join(self.workdir, "config.json"), "w") as f:
                    json.dump(to_dict(cfg), f, indent=1)
            if not resumed:
                final_eval = self.evaluate()
                if final_eval:
                    self.log("eval at step 0: " + ", ".join(f"{k}={v:.3f}"
                                                           for k, v in final_eval.items()))
                    if writer is not None:
                        writer.write(0, final_eval)
        else:
            writer = self._open_writer(fresh=False)
        last_step = cfg.train.steps if steps is None else min(cfg.train.steps,
                                                              self.start_step + steps)

        self._board = _WeightBoard()
        # Admission already bounds how far rollout runs ahead (k + 1 steps); the queue must hold
        # that many batches so a finished batch never blocks a sampler thread.
        self._queue: queue.Queue = queue.Queue(
            maxsize=max(cfg.pipeline.queue_size, cfg.pipeline.max_staleness + 2))
        self._stop = threading.Event()
        self._rollout_error: BaseException | None = None
        self._publish()
        self._rollout_thread = threading.Thread(
            target=self._rollout_loop, args=(self.start_step, last_step), daemon=True,
            name="jrl-rollout")
        progress = ProgressBar(last_step)
        run_start = time.perf_counter()
        last_done = self.start_step
        data_state = self.stream.state_dict()
        self._rollout_thread.start()
        try:
            for rl_step in range(self.start_step, last_step):
                step_start = time.perf_counter()
                rollout = self._next_batch()
                if self.multi:
                    rollout = self._gather_rollout(rollout)
                wait = time.perf_counter() - step_start
                batch, metrics = self._prepare(rollout)
                train_start = time.perf_counter()
                metrics.update(self._train_on(batch, rl_step))
                metrics["time/train_s"] = time.perf_counter() - train_start
                metrics["time/weight_sync_s"] = self._publish()
                metrics["time/wait_s"] = wait
                metrics["time/step_s"] = time.perf_counter() - step_start
                metrics["time/train_idle_frac"] = wait / max(metrics["time/step_s"], 1e-9)
                metrics["time/rollout_idle_frac"] = self._rollout_idle_fraction()
                metrics["train/version"] = int(self.state.version)
                done = rl_step + 1
                data_state = rollout.data_state
                if cfg.eval.every and done % cfg.eval.every == 0 or done == last_step:
                    final_eval = self.evaluate()
                    metrics.update(final_eval)
                if writer is not None:
                    writer.write(done, metrics)
                self.history.append({"step": done, **metrics})
                progress.update(done, metrics)
                last_done = done
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 \
                        and done != last_step:
                    self.save_checkpoint(done, data_state)
            self.save_checkpoint(last_done, data_state)
        except KeyboardInterrupt:
            self.log(f"\ninterrupted: saving step {last_done} and stopping")
            if last_done > self.start_step:
                self.save_checkpoint(last_done, data_state)
            raise
        finally:
            self._stop.set()
            self._rollout_thread.join(timeout=30)
            progress.close()
            if writer is not None:
                writer.close()
        self.log(f"done: {last_done - self.start_step} steps in "
                 f"{time.perf_counter() - run_start:.1f}s")
        self.start_step = last_done
        return RunResult(self.state, self.history, final_eval, self.workdir)
