"""The train side of a run: the train state on the train devices and everything that changes it.

    trainer = Trainer(config, model_config, params, devices, loss_fn=..., multi=False)
    prepared = trainer.prepare(rollout)          # complete TrainBatch (jrl.pipeline.prepare)
    metrics = trainer.train_on(prepared.batch, rl_step)
    copies, version, seconds = trainer.publish(rollout_devices)
    trainer.save(rl_step, meta) / trainer.restore(...)

One device: jax.jit of jrl.train.make_train_step. Several train devices: the row-parallel step
(jrl.train.parallel_step) over an FSDP mesh, bitwise equal to one device. Several processes
(SPMD): the same mesh spans every process's devices and host values are all-gathered.

Versions: every optimizer update makes a new policy version. The trainer keeps the params of the
last `keep_versions` published versions (at least max_staleness + 1), so p_o can be recomputed
under the weights that sampled each token.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import jax
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.metrics import names
from jrl.models.config import ModelConfig
from jrl.pipeline import builders
from jrl.pipeline.batching import PackedRollout, select_rows
from jrl.pipeline.experiment import ExperimentConfig
from jrl.pipeline.prepare import PreparedBatch, PrepareOptions, prepare_batch
from jrl.pipeline.rollout import RolloutBatch
from jrl.train import (TrainBatch, create_train_state, jit_train_step, make_logprob_fn,
                       make_optimizer, make_train_step)
from jrl.train.checkpoint import Checkpointer
from jrl.train.publish import WeightPublisher


class Trainer:
    """Train state, train step, held versions, weight publishing and checkpoints.

    config: the experiment; params: initial policy params (host or any device); devices: the
    train devices; loss_fn: a jrl.losses chain; multi: one SPMD run over several processes.
    """

    def __init__(self, config: ExperimentConfig, model_config: ModelConfig, params: Any,
                 devices: list, *, loss_fn: Callable, multi: bool = False,
                 checkpoint_dir: str | None = None):
        cfg = config
        self.config = config
        self.model_config = model_config
        self.contract: NumericalContract = cfg.numerics
        self.devices = list(devices)
        self.device = self.devices[0]
        self.multi = multi
        self.loss_fn = loss_fn
        self.optimizer = make_optimizer(cfg.optimizer)
        self.updates_per_step = cfg.train.mini_batches * cfg.train.epochs
        self.options = PrepareOptions.from_config(cfg)
        self.rows, self.seq_len = self.options.rows, self.options.seq_len
        self.keep_versions = max(cfg.pipeline.keep_versions, cfg.pipeline.max_staleness + 1)
        self.versions: dict[int, Any] = {}    # version -> params on the train devices
        self.reference = None
        # LoRA: the frozen base goes to each rollout device once; publish() sends adapters.
        self.publisher = WeightPublisher()
        self._build_step(params)
        # Not SPMD (multi=False) inside a multi-process job: this process checkpoints alone.
        self.checkpointer = (Checkpointer(checkpoint_dir, keep=cfg.checkpoint.keep,
                                          alone=not multi)
                             if checkpoint_dir is not None else None)

    def _build_step(self, params) -> None:
        cfg = self.config
        step_args = dict(num_micro_batches=cfg.train.micro_batches,
                         temperature=cfg.sampling.temperature,
                         with_reference=cfg.train.reference != "none")
        state = create_train_state(params, self.optimizer, jax.random.PRNGKey(cfg.seed))
        if len(self.devices) == 1:
            self.mesh = None
            # jit_train_step: a frozen LoRA base is read in place, never copied per step.
            self._train_step = jit_train_step(make_train_step(
                self.model_config, self.contract, self.loss_fn, self.optimizer, **step_args))
            self._logprobs = jax.jit(make_logprob_fn(self.model_config, self.contract,
                                                     temperature=cfg.sampling.temperature))
            # Every leaf committed to the train device, as the step's outputs are: no second
            # compile.
            self.state_placement = self.device
            self.batch_placement = self.device
        else:
            from jrl import parallel
            from jrl.train import parallel_step
            self.mesh = parallel.make_mesh(
                parallel.MeshConfig(data=cfg.pipeline.train_mesh_data, fsdp=-1,
                                    tensor=cfg.pipeline.train_mesh_tensor),
                devices=self.devices)
            shardings = parallel.train_state_shardings(jax.eval_shape(lambda: state),
                                                       self.model_config, self.mesh)
            self._train_step = parallel.shard_train_step(
                parallel_step.make_parallel_train_step(
                    self.model_config, self.contract, self.loss_fn, self.optimizer, self.mesh,
                    **step_args),
                shardings, parallel.batch_sharding(self.mesh), donate=False)
            self._logprobs = jax.jit(parallel_step.make_parallel_logprob_fn(
                self.model_config, self.contract, self.mesh,
                temperature=cfg.sampling.temperature))
            self.state_placement = shardings
            self.batch_placement = parallel.batch_sharding(self.mesh)
        self.state = self._place(state, self.state_placement)

    # ------------------------------------------------------------------------------------------
    # Placement

    def _place(self, tree, placement):
        """Host values (identical on every process) onto `placement`."""
        if self.multi:
            from jrl.parallel import host_to_global
            return host_to_global(jax.device_get(tree), placement)
        return jax.device_put(tree, placement)

    def host(self, tree):
        """Whole values as numpy (an all-gather across processes where needed)."""
        if self.multi:
            from jrl.parallel import global_to_host
            return global_to_host(tree)
        return jax.device_get(tree)

    @property
    def version(self) -> int:
        return int(self.state.version)

    def set_params(self, params) -> None:
        """Replaces the policy params (e.g. after a warm start), keeping their placement."""
        self.state = self.state._replace(
            params=self._place(params, self.state_placement.params if self.mesh is not None
                               else self.state_placement))

    def params_on_host(self):
        return self.host(self.state.params)

    # ------------------------------------------------------------------------------------------
    # One RL step

    def score_with(self, packed: PackedRollout) -> Callable[[Any], np.ndarray]:
        """The arrays go to the train devices once; the returned function gives the train
        engine's logprobs [R, T] (host) of the packed tokens under any params."""
        arrays = self._place((packed.tokens, packed.attn_mask, packed.logit_floor),
                             self.batch_placement)

        def score(params) -> np.ndarray:
            logp, _ = self._logprobs(params, *arrays)
            return np.asarray(self.host(logp))
        return score

    def prepare(self, rollout: RolloutBatch) -> PreparedBatch:
        """The rollout as a complete TrainBatch with the trainer's versions (see prepare_batch)."""
        return prepare_batch(rollout, trainer_version=self.version,
                             current_params=self.state.params, held=self.versions,
                             score_with=self.score_with, options=self.options,
                             reference=self.reference)

    def train_on(self, batch: TrainBatch, rl_step: int) -> dict:
        """`epochs` passes over the batch in `mini_batches` updates (rows shuffled per epoch when
        there is more than one update). Returns the updates' metrics combined by their declared
        reductions, and train/lr."""
        cfg = self.config
        per_update = self.rows // cfg.train.mini_batches
        rng = np.random.default_rng([cfg.seed, rl_step])
        collected: list[dict] = []
        for _ in range(cfg.train.epochs):
            order = rng.permutation(self.rows) if self.updates_per_step > 1 else \
                np.arange(self.rows)
            for j in range(cfg.train.mini_batches):
                rows = order[j * per_update:(j + 1) * per_update]
                mini = self._place(select_rows(batch, rows), self.batch_placement)
                self.state, metrics = self._train_step(self.state, mini)
                collected.append(metrics)
        out = names.combine_updates(self.host(collected))
        out[names.TRAIN_LR] = float(builders.learning_rate_at(
            cfg.optimizer, int(self.host(self.state.step))))
        return out

    def remember_version(self) -> None:
        """Holds the current params as their version; drops versions past keep_versions."""
        self.versions[self.version] = self.state.params
        for old in sorted(self.versions)[:-self.keep_versions]:
            del self.versions[old]

    def publish(self, devices: list) -> tuple[list, int, float]:
        """Copies of the current params on each of `devices` (the rollout side), their version,
        and the seconds the copy took. The version is held for later p_o recomputation."""
        start = time.perf_counter()
        source = self.host(self.state.params) if self.multi else self.state.params
        copies = self.publisher(source, devices)
        jax.block_until_ready(copies)
        self.remember_version()
        return copies, self.version, time.perf_counter() - start

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def save(self, rl_step: int, meta: dict) -> None:
        self.checkpointer.save(rl_step, self.state, meta, reference=self.reference)

    def restore(self, *, with_reference: bool, step: int | None = None) -> dict:
        """Restores checkpoint `step` (default the latest) into the current placement; returns
        its metadata. CorruptCheckpointError when its files cannot be read."""
        like_reference = self.state.params if with_reference else None
        state, reference, meta = self.checkpointer.restore(self.state, step,
                                                           like_reference=like_reference)
        # Restored into self.state's shardings (global ones with several processes).
        self.state = state if self.multi else jax.device_put(state, self.state_placement)
        self.reference = reference
        return meta

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

    @property
    def checkpoint_dir(self) -> str:
        return os.path.abspath(self.checkpointer.directory)
