"""The RL run: a RolloutWorker and a Trainer connected by a bounded queue, with explicit versions.

Each RL step, in the main thread:

    rollout = worker.next_batch()              # jrl.pipeline.rollout_worker
    prepared = trainer.prepare(rollout)        # jrl.pipeline.prepare: the complete TrainBatch
    metrics = trainer.train_on(prepared.batch, rl_step)            # jrl.pipeline.trainer
    worker.publish(*trainer.publish(worker.devices)[:2])           # new weights, new version

One code path serves synchronous and asynchronous training: the worker generates step i's batch
as soon as admission allows (the weights it would use at most `max_staleness` versions behind the
version that consumes it); with max_staleness = 0 that is exactly the synchronous loop. The run
also evaluates, checkpoints and writes metrics. All impurity (threads, queues, clocks, files)
lives in this package and in launch/.

Versions: every optimizer update makes a new policy version; the weights published after RL
step i have version (i + 1) * updates_per_step. Every generated token records the version of
the weights that produced it; staleness = trainer version at consumption - token version.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import jax

from jrl.data import PromptExample, PromptStream
from jrl.kernels.contract import NumericalContract
from jrl.metrics import ProgressBar, make_writers, names
from jrl.pipeline import builders
from jrl.pipeline.config_tools import to_dict
from jrl.pipeline.episodes import EpisodeDriver, demonstrate, transcript_segments
from jrl.pipeline.evaluation import evaluate
from jrl.pipeline.config import RunConfig
from jrl.pipeline.faults import (REWARD_ERROR_WARN_FRACTION, NonFiniteError, check_finite,
                                 interrupts_deferred)
from jrl.pipeline.resume import restore_checkpoint
from jrl.pipeline.rollout import RolloutSpec
from jrl.pipeline.rollout_worker import RolloutWorker
from jrl.pipeline.spmd import gather_rollout
from jrl.pipeline.trainer import Trainer
from jrl.pipeline.warm_start import warm_start
from jrl.pipeline.workdir import claim_workdir
from jrl.rewards import math_reward
from jrl.sampling import Sample, Sampler
from jrl.train import TrainState


__all__ = ["NonFiniteError", "Run", "RunResult"]


@dataclasses.dataclass
class RunResult:
    state: TrainState
    history: list[dict]
    final_eval: dict
    workdir: str


class Run:
    """An experiment: build everything from the config, then `run()`.

    workdir holds checkpoints/ and metrics.jsonl. resume=True continues from the latest intact
    checkpoint (resume_step: a given one); a workdir that already holds a run is refused unless
    resume or overwrite ("move" it aside or "delete" it; jrl.pipeline.workdir).
    reward_fn(response_text, example) -> float | RewardResult (default: the math verifier);
    raise_reward_errors=True stops the run on the
    first failing reward call instead of counting it as reward 0. devices: the devices to split
    into rollout and train sets (default jax.devices()). spmd: one run over every process
    (default when there are several); False keeps this process's Run local
    (jrl.pipeline.multihost drives such runs itself).
    """

    def __init__(self, config: RunConfig, workdir: str, *, resume: bool = False,
                 resume_step: int | None = None, overwrite: str | None = None,
                 reward_fn: Callable | None = None,
                 raise_reward_errors: bool = False, log: Callable[[str], None] = print,
                 devices: list | None = None, write_metrics: bool = True,
                 spmd: bool | None = None, claim: bool = True):
        cfg = config
        self.config = config
        self.workdir = os.path.abspath(workdir)
        self.resume = resume or resume_step is not None
        self.resume_step = resume_step
        self.log = log
        self.raise_reward_errors = raise_reward_errors
        self.multi = jax.process_count() > 1 if spmd is None else spmd
        # metrics, config.json, the workdir's marker and lock: one process writes them.
        self._writes_files = claim and (not self.multi or jax.process_index() == 0)
        # A run never replaces another one's files unless told to, and holds its workdir's
        # lock until close() (jrl.pipeline.workdir).
        self._claim = claim_workdir(self.workdir, resume=self.resume, overwrite=overwrite,
                                    name=cfg.name, act=self._writes_files, log=log)
        try:
            self._build(cfg, reward_fn=reward_fn, devices=devices, write_metrics=write_metrics)
        except BaseException:
            self._claim.release()
            raise

    def _build(self, cfg: RunConfig, *, reward_fn, devices, write_metrics):
        """Builds the parts from the config (the rest of __init__)."""
        raise_reward_errors = self.raise_reward_errors
        os.makedirs(self.workdir, exist_ok=True)
        self.contract: NumericalContract = cfg.numerics

        # Devices: disjoint rollout and train sets when the config asks for them. Several
        # processes (SPMD): each samples its share of the prompts on its first local device, and
        # training runs on one mesh over every process's devices.
        if self.multi:
            self._check_multi(cfg)
            self.rollout_devices = [jax.local_devices()[0]]
            self.train_devices = list(jax.devices())
        else:
            self.rollout_devices, self.train_devices = builders.rollout_and_train_devices(
                devices if devices is not None else jax.devices(),
                cfg.pipeline.rollout_devices, cfg.pipeline.train_devices)

        # Model, tokenizer, data, reward.
        self.model_config, params, self.tokenizer = builders.build_model(cfg)
        self.stop_tokens = tuple(sorted(set(cfg.sampling.stop_tokens)
                                        | set(self.tokenizer.stop_ids)))
        self.sampling = cfg.sampling.replace(stop_tokens=self.stop_tokens)
        self.train_examples, self.eval_examples = builders.build_data(cfg)
        self.template = builders.build_template(cfg)
        self.stream = PromptStream(self.train_examples, seed=cfg.data.seed)
        if self.multi:
            self.stream = self.stream.shard(jax.process_index(), jax.process_count())
        self.make_env = builders.environment_factory(cfg) if cfg.env.multi_turn else None
        if reward_fn is not None and cfg.env.multi_turn:
            raise ValueError(f"env.name={cfg.env.name!r}: a multi-turn run's reward is its "
                             "environment's; a reward_fn would not be used")
        self.reward_fn = reward_fn or (lambda text, example: math_reward(
            text, example, mode=cfg.rollout.reward_mode, format_reward=cfg.rollout.format_reward))

        # The train side.
        self.recipe = cfg.recipe()          # advantages + loss chain + reward shaping
        self.loss_fn = self.recipe.loss
        self.trainer = self._make_trainer(params)
        self.updates_per_step = self.trainer.updates_per_step
        self.rows, self.seq_len = self.trainer.rows, self.trainer.seq_len

        # The rollout side: one sampler per rollout device, plus a greedy one for evaluation.
        self.samplers = [self._make_sampler(self.sampling) for _ in self.rollout_devices]
        self.eval_sampler = self._make_sampler(self.sampling.replace(greedy=True, group_size=1))
        self.rollout_spec = RolloutSpec(
            prompts_per_step=cfg.rollout.prompts_per_step // (
                jax.process_count() if self.multi else 1),
            group_size=cfg.sampling.group_size,
            max_new_tokens=cfg.sampling.max_new_tokens,
            dynamic_sampling=self.recipe.shaping.dynamic_sampling,
            max_rounds=cfg.rollout.max_sampling_rounds,
            overlong_buffer=self.recipe.shaping.overlong_buffer_len(
                max_len=cfg.sampling.max_new_tokens),
            overlong_factor=self.recipe.shaping.overlong_factor)
        self.worker = RolloutWorker(
            self.samplers, self.rollout_devices, stream=self.stream, spec=self.rollout_spec,
            updates_per_step=self.updates_per_step, max_staleness=cfg.pipeline.max_staleness,
            interrupt=cfg.pipeline.interrupt, render=self.render_prompt,
            decode=self.decode_response, reward_fn=self.reward_fn,
            raise_reward_errors=raise_reward_errors,
            shard_index=jax.process_index() if self.multi else 0,
            queue_size=cfg.pipeline.queue_size, precompile=cfg.rollout.precompile,
            make_driver=self.make_episode_driver if cfg.env.multi_turn else None)

        self.start_step = 0
        self.history: list[dict] = []
        self._write_metrics = write_metrics
        self.consumed: list[dict] = []        # per RL step: the versions the trainer consumed
        self._started = False
        self.resumed_from: int | None = None
        self.saved_step: int | None = None    # the step this Run last wrote a checkpoint of
        # Resume now, so that a checkpoint that does not fit this config is a setup error.
        self._try_resume()
        self.log(f"jrl run {cfg.name!r}: {self.model_config.num_params():,} params, "
                 f"backend={self.contract.backend} ({self.contract.compute_dtype}), "
                 f"rollout devices {len(self.rollout_devices)}, train devices "
                 f"{len(self.train_devices)}, max_staleness={cfg.pipeline.max_staleness}")
        self.log(f"recipe: {self.recipe!r}")

    # ------------------------------------------------------------------------------------------
    # The parts, for callers that drive them (tests, jrl.pipeline.multihost)

    @property
    def state(self) -> TrainState:
        return self.trainer.state

    @property
    def mesh(self):
        return self.trainer.mesh

    @property
    def reference(self):
        return self.trainer.reference

    @staticmethod
    def _check_multi(cfg: RunConfig) -> None:
        """The SPMD multi-process run's requirements (ValueError naming the config key)."""
        count = jax.process_count()
        if cfg.rollout.prompts_per_step % count:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be "
                             f"divisible by the number of processes ({count})")
        if cfg.recipe().shaping.dynamic_sampling:
            raise ValueError(f"rollout.dynamic_sampling (on in loss.preset={cfg.loss.preset!r}'s "
                             "recipe unless set to false) is not supported with several "
                             "processes (every host must draw the same number of prompts)")
        shards = jax.device_count() // max(1, cfg.pipeline.train_mesh_tensor)
        if cfg.train.micro_batches % shards:
            raise ValueError(f"train.micro_batches={cfg.train.micro_batches} must be a multiple "
                             f"of the row shards of the train mesh ({shards} = "
                             f"{jax.device_count()} devices / tensor "
                             f"{cfg.pipeline.train_mesh_tensor})")

    def _make_trainer(self, params) -> Trainer:
        return Trainer(self.config, self.model_config, params, self.train_devices,
                       loss_fn=self.loss_fn, multi=self.multi,
                       checkpoint_dir=os.path.join(self.workdir, "checkpoints"))

    def _make_sampler(self, sampling) -> Sampler:
        cfg = self.config
        kwargs = {}
        if cfg.pipeline.kv_on_swap == "recompute":
            kwargs["recompute_kv_on_swap"] = True
        if cfg.env.multi_turn:
            kwargs["max_observation_len"] = cfg.env.max_observation_tokens
        return Sampler(self.model_config, self.contract, sampling,
                       num_slots=cfg.rollout.num_slots, max_prompt_len=cfg.rollout.max_prompt_len,
                       steps_per_call=cfg.rollout.steps_per_call, **kwargs)

    def render_prompt(self, example: PromptExample) -> list[int]:
        """The prompt's token ids; in multi-turn runs, rendered from the environment's first
        observation (env.reset(example)) instead of the question."""
        if self.config.env.multi_turn:
            example = dataclasses.replace(example, question=self.make_env().reset(example))
        return builders.encode_prompt(self.template, self.tokenizer, example)

    def decode_response(self, sample: Sample) -> str:
        return self.decode_tokens(sample.tokens)

    def decode_tokens(self, ids) -> str:
        # Stop tokens, and ids past the tokenizer's vocabulary (padded embedding rows), decode
        # to nothing.
        vocab = self.tokenizer.vocab_size
        tokens = [int(t) for t in ids if int(t) not in self.stop_tokens and int(t) < vocab]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def demonstration_segments(self, example: PromptExample) -> list:
        """A warm-start row showing a tool-using episode: the environment's demonstration
        actions run through it (jrl.pipeline.episodes.demonstrate), tokenized as the sampler
        would see them: the model's turns end in the stop token and are trained on; the
        observations are put in env.observation_format and cut as the driver cuts them."""
        env = self.make_env()
        if not hasattr(env, "demonstration"):
            raise ValueError(f"env.name={self.config.env.name!r} has no demonstrations "
                             "(a demonstration(example) method); set train.sft_tool_frac=0")
        transcript = demonstrate(env, example, env.demonstration(example))
        return [(self.render_prompt(example), False)] + transcript_segments(
            transcript, encode=self.tokenizer.encode, stop_id=self.tokenizer.stop_ids[0],
            options=self.config.env.episode_options())

    def make_episode_driver(self, example_of: Callable) -> EpisodeDriver:
        """The environment side of multi-turn episodes (config section env)."""
        cfg = self.config.env
        return EpisodeDriver(self.make_env, example_of=example_of, encode=self.tokenizer.encode,
                             special_texts=self.tokenizer.special_token_texts,
                             decode=self.decode_tokens, options=cfg.episode_options(),
                             threads=cfg.threads)

    def warm_start(self) -> None:
        """The supervised warm start (jrl.pipeline.warm_start) on the trainer's params. With
        several processes every one runs the same SFT on its first local device."""
        device = self.rollout_devices[0] if self.multi else self.trainer.device
        params = warm_start(self.trainer.params_on_host() if self.multi
                            else self.trainer.state.params,
                            self.config, self.model_config, self.train_examples,
                            tokenizer=self.tokenizer, render=self.render_prompt,
                            seq_len=self.seq_len, device=device, log=self.log,
                            demonstration=(self.demonstration_segments
                                           if self.config.train.sft_tool_frac > 0 else None))
        self.trainer.set_params(params)

    def evaluate(self) -> dict:
        """Greedy (and sampled) accuracy on the held-out prompts with the current weights."""
        cfg = self.config
        if not self.eval_examples:
            return {}
        params = jax.device_put(self.trainer.params_on_host() if self.multi
                                else self.trainer.state.params, self.rollout_devices[0])
        return evaluate(params, self.eval_examples, render=self.render_prompt,
                        decode=self.decode_response, reward_fn=self.reward_fn,
                        version=self.trainer.version,
                        greedy=self.eval_sampler if cfg.eval.greedy else None,
                        sampled=self.samplers[0] if cfg.eval.sampled else None,
                        raise_reward_errors=self.raise_reward_errors,
                        make_driver=self.make_episode_driver if cfg.env.multi_turn else None)

    def _publish(self) -> float:
        """The trainer's params to every rollout device; returns the seconds it took."""
        copies, version, seconds = self.trainer.publish(self.rollout_devices)
        self.worker.publish(copies, version)
        return seconds

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def _meta(self, rl_step: int, data_state: dict) -> dict:
        return {"rl_step": rl_step, "version": self.trainer.version,
                "data_state": data_state, "config": to_dict(self.config),
                "numerics": self.contract.to_dict(), "model": self.model_config.to_dict()}

    def save_checkpoint(self, rl_step: int, data_state: dict) -> None:
        """Writes checkpoint rl_step; an interrupt that arrives meanwhile is raised once it is
        complete on disk (jrl.pipeline.faults.interrupts_deferred)."""
        with interrupts_deferred():
            self.trainer.save(rl_step, self._meta(rl_step, data_state))
            self.saved_step = rl_step
            self.log(f"checkpoint: step {rl_step} -> {self.trainer.checkpointer.directory}")

    def _try_resume(self) -> bool:
        """Restores the newest intact checkpoint (or resume_step) when resume=True (see
        jrl.pipeline.resume); False when there is none or resume is off."""
        if not self.resume:
            return False
        meta = restore_checkpoint(self.trainer, self.config, self.model_config,
                                  resume_step=self.resume_step, set_aside=self._writes_files,
                                  log=self.log)
        if meta is None:
            self.log("resume: no checkpoint yet, starting fresh")
            return False
        self.stream.load_state_dict(meta["data_state"])
        self.start_step = int(meta["rl_step"])
        self.resumed_from = self.start_step
        self.log(f"resume: from step {self.start_step} (version {self.trainer.version})")
        return True

    # ------------------------------------------------------------------------------------------
    # The loop

    def _open_writer(self, *, fresh: bool):
        if not self._write_metrics:
            return None
        tensorboard = {"auto": "auto", "true": True, "false": False}[self.config.tensorboard]
        return make_writers(self.workdir, tensorboard=tensorboard,
                            is_main_process=self._writes_files,
                            resume_step=None if fresh else self.start_step)

    def _begin(self) -> tuple[object, dict]:
        """First call of run(): resume or warm start, the step-0 eval. Returns (writer, eval)."""
        cfg = self.config
        self._started = True
        resumed = self.resumed_from is not None
        if not resumed:
            self.warm_start()
            if cfg.train.reference != "none":
                self.trainer.reference = self.trainer.state.params
        writer = self._open_writer(fresh=not resumed)
        if self._writes_files:
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                json.dump(to_dict(cfg), f, indent=1)
        first_eval: dict = {}
        if not resumed:
            first_eval = self.evaluate()
            if first_eval:
                self.log("eval at step 0: " + ", ".join(f"{k}={v:.3f}"
                                                       for k, v in first_eval.items()))
                if writer is not None:
                    writer.write(0, first_eval)
        return writer, first_eval

    def _step(self, rl_step: int) -> tuple[dict, dict]:
        """One RL step on the trainer's side. Returns (metrics, data state after its prompts)."""
        step_start = time.perf_counter()
        rollout = self.worker.next_batch()
        if self.multi:
            rollout = gather_rollout(rollout)
        wait = time.perf_counter() - step_start
        errors = rollout.metrics.get(names.ROLLOUT_REWARD_ERRORS, 0)
        if errors > REWARD_ERROR_WARN_FRACTION * self.rows:
            self.log(f"warning: step {rl_step + 1}: {errors} reward calls failed and count as "
                     f"reward 0 (of {self.rows} rows); first: {rollout.first_reward_error}")
        prepared = self.trainer.prepare(rollout)
        self.consumed.append(prepared.consumed)
        metrics = prepared.metrics
        train_start = time.perf_counter()
        metrics.update(self.trainer.train_on(prepared.batch, rl_step))
        metrics[names.TIME_TRAIN_S] = time.perf_counter() - train_start
        metrics[names.TIME_WEIGHT_SYNC_S] = self._publish()
        metrics[names.TIME_WAIT_S] = wait
        metrics[names.TIME_STEP_S] = time.perf_counter() - step_start
        metrics[names.TIME_TRAIN_IDLE_FRAC] = wait / max(metrics[names.TIME_STEP_S], 1e-9)
        metrics[names.TIME_ROLLOUT_IDLE_FRAC] = self.worker.idle_fraction()
        metrics[names.TRAIN_VERSION] = self.trainer.version
        check_finite(rl_step + 1, metrics)
        return metrics, rollout.data_state

    def run(self, *, steps: int | None = None) -> RunResult:
        """Trains until config.train.steps RL steps (or `steps` more) are done.

        May be called again to continue (e.g. run(steps=1) to compile, then run()).
        """
        # The workdir is this run's while it trains (released when run() returns, so another
        # Run may continue it; close() releases it too).
        self._claim.acquire()
        try:
            return self._run(steps)
        finally:
            self._claim.release()

    def _run(self, steps: int | None) -> RunResult:
        cfg = self.config
        if not self._started:
            writer, final_eval = self._begin()
        else:
            writer, final_eval = self._open_writer(fresh=False), {}
        last_step = cfg.train.steps if steps is None else min(cfg.train.steps,
                                                              self.start_step + steps)
        if last_step <= self.start_step:
            self.log(f"already at step {self.start_step} of {cfg.train.steps}: nothing to do "
                     "(raise train.steps to train further)")
            if writer is not None:
                writer.close()
            return RunResult(self.trainer.state, self.history, final_eval, self.workdir)
        self._publish()
        progress = ProgressBar(last_step)
        run_start = time.perf_counter()
        # The last finished step, its data position and its train state: an interrupt saves
        # these together, never the state of a step cut short (its update may already be in
        # trainer.state while its metrics and data position are not).
        last_done = self.start_step
        data_state = self.stream.state_dict()
        committed = self.trainer.state
        self.worker.start(self.start_step, last_step)
        try:
            for rl_step in range(self.start_step, last_step):
                metrics, step_data_state = self._step(rl_step)
                done = rl_step + 1
                if cfg.eval.every and done % cfg.eval.every == 0 or done == last_step:
                    final_eval = self.evaluate()
                    metrics.update(final_eval)
                if writer is not None:
                    writer.write(done, metrics)
                self.history.append({"step": done, **metrics})
                progress.update(done, metrics)
                last_done, data_state, committed = done, step_data_state, self.trainer.state
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 \
                        and done != last_step:
                    self.save_checkpoint(done, data_state)
            self.save_checkpoint(last_done, data_state)
        except KeyboardInterrupt:
            # Back to the last finished step, so that this Run (and a checkpoint) is consistent.
            self.trainer.state = committed
            if last_done > self.start_step and self.saved_step == last_done:
                self.log(f"\ninterrupted: step {last_done} is saved; stopping")
            elif last_done > self.start_step:
                self.log(f"\ninterrupted: saving step {last_done} and stopping")
                self.save_checkpoint(last_done, data_state)
            else:
                self.log(f"\ninterrupted before step {last_done + 1} finished: nothing new to "
                         "save")
            self.start_step = last_done
            self.stream.load_state_dict(data_state)
            raise
        finally:
            self.worker.stop()
            progress.close()
            if writer is not None:
                writer.close()
        self.log(f"done: {last_done - self.start_step} steps in "
                 f"{time.perf_counter() - run_start:.1f}s")
        self.start_step = last_done
        return RunResult(self.trainer.state, self.history, final_eval, self.workdir)

    def close(self) -> None:
        """Stops the rollout threads, closes the checkpoint manager and releases the workdir
        (`with Run(...) as run:` does it on exit)."""
        try:
            self.worker.stop()
            self.trainer.close()
        finally:
            self._claim.release()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
