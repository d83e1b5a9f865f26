"""The train side of a run: the train state on the train devices and everything that changes it.

    trainer = Trainer(trainer_options(cfg), model_config, params, devices,
                      contract=cfg.numerics, recipe=cfg.recipe())
    prepared = trainer.prepare(rollout)          # complete TrainBatch (jrl.pipeline.training.prepare)
    metrics = trainer.train_on(prepared.batch, rl_step)
    published = trainer.publish(rollout_devices) # Published(params, version, seconds)
    trainer.save(rl_step, meta) / trainer.restore(...)

One device: jax.jit of jrl.train.make_train_step. Several train devices: the row-parallel step
(jrl.train.parallel_step) over an FSDP mesh, bitwise equal to one device. Several processes
(SPMD): the same mesh spans every process's devices and host values are all-gathered.

Versions: every optimizer update makes a new policy version. The trainer holds the params of the
last `keep_versions` versions it gave out (publish / hold_version), so p_o can be recomputed
under the weights that sampled each token.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.losses.recipes import Recipe
from jrl.metrics import names
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.nnx_model import as_params
from jrl.pipeline.training.batching import PackedRollout, select_rows
from jrl.pipeline.training.prepare import PreparedBatch, PrepareOptions, prepare_batch
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.train import (TrainBatch, create_train_state, jit_train_step, make_logprob_fn,
                       make_optimizer, make_score_fn, make_train_step, shared_program)
from jrl.train.checkpoint import Checkpointer
from jrl.train.optimizer import OptimizerConfig, learning_rate_at
from jrl.train.publish import WeightPublisher


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """What the Trainer needs besides the model, its params, devices and loss.

    prepare: batch shape and preparation (PrepareOptions: rows, seq_len, p_old, reference).
    optimizer: the RL optimizer. Each RL step makes `epochs` passes over its batch in
    `mini_batches` updates, each accumulating `micro_batches` micro-batches. temperature: the
    sampler's (logprobs are of the tempered distribution). seed: the optimizer state's RNG and
    the mini-batch shuffles. keep_versions: published versions held for p_o (at least
    max_staleness + 1). routing: MoE experts "recompute"d by the train forward or "replay"ed
    from the sampler's record (model.routing). mesh_data / mesh_tensor: the train mesh's data
    and tensor axes (fsdp takes the rest of several devices). checkpoint_keep: checkpoints
    kept.
    """

    prepare: PrepareOptions
    optimizer: OptimizerConfig = OptimizerConfig()
    mini_batches: int = 1
    epochs: int = 1
    micro_batches: int = 1
    temperature: float = 1.0
    seed: int = 0
    keep_versions: int = 2
    mesh_data: int = 1
    mesh_tensor: int = 1
    checkpoint_keep: int = 2
    routing: str = "recompute"

    def __post_init__(self):
        rows = self.prepare.rows
        if rows % self.mini_batches or (rows // self.mini_batches) % self.micro_batches:
            raise ValueError(f"TrainerOptions: {rows} rows must split into mini_batches="
                             f"{self.mini_batches} of micro_batches={self.micro_batches} "
                             "equal micro-batches")

    @property
    def updates_per_step(self) -> int:
        return self.mini_batches * self.epochs

    @property
    def with_reference(self) -> bool:
        return self.prepare.reference != "none"


class Published(NamedTuple):
    """Weights handed to the rollout side: one copy per device, their version, and the seconds
    the copy took."""

    params: list
    version: int
    seconds: float


class Trainer:
    """Train state, train step, held versions, weight publishing and checkpoints.

    options: TrainerOptions; params: initial policy params (host or any device; a Decoder or its
    params pytree); devices: the train devices; contract: the numerical contract (shared with
    the samplers); recipe: the algorithm (jrl.losses.Recipe): its advantages score each batch
    and its loss chain trains on it (its shaping belongs to the rollout's RolloutSpec); multi:
    one SPMD run over several processes; checkpoint_dir: where save / restore go (None: no
    checkpoints).
    """

    def __init__(self, options: TrainerOptions, model_config: ModelConfig, params: Any,
                 devices: list, *, contract: NumericalContract, recipe: Recipe,
                 multi: bool = False, checkpoint_dir: str | None = None):
        if not isinstance(recipe, Recipe):
            raise TypeError(f"Trainer(recipe=...) takes a jrl.losses.Recipe (advantages, loss "
                            f"and shaping as one unit), got {type(recipe).__name__}")
        self.options = options
        self.model_config = model_config
        self.contract = contract
        self.devices = list(devices)
        self.device = self.devices[0]
        self.multi = multi
        self.recipe = recipe
        self.loss_fn = recipe.loss
        self.optimizer = make_optimizer(options.optimizer)
        self.updates_per_step = options.updates_per_step
        self.replay = options.routing == "replay"
        if self.replay and not model_config.has_moe:
            raise ValueError(f"model.routing='replay' needs an MoE model; the loaded model "
                             f"({model_config.model_type}) has no MoE layers")
        if model_config.has_moe:
            # The recorded routes' shape, so that prepare packs and compares them.
            self.options = options = dataclasses.replace(options, prepare=dataclasses.replace(
                options.prepare, num_experts=model_config.num_experts,
                route_shape=(len(transformer.moe_layers(model_config)),
                             model_config.num_experts_per_tok)))
        self.rows, self.seq_len = options.prepare.rows, options.prepare.seq_len
        self.keep_versions = options.keep_versions
        self.versions: dict[int, Any] = {}    # version -> params on the train devices
        self.reference = None
        # LoRA: the frozen base goes to each rollout device once; publish() sends adapters.
        self.publisher = WeightPublisher()
        self._build_step(as_params(params))     # a Decoder or its params pytree
        # Not SPMD (multi=False) inside a multi-process job: this process checkpoints alone.
        self.checkpointer = (Checkpointer(checkpoint_dir, keep=options.checkpoint_keep,
                                          alone=not multi)
                             if checkpoint_dir is not None else None)

    def _build_step(self, params) -> None:
        options = self.options
        step_args = dict(num_micro_batches=options.micro_batches,
                         temperature=options.temperature, with_reference=options.with_reference,
                         replay=self.replay)
        score_args = dict(temperature=options.temperature, replay=self.replay)
        state = create_train_state(params, self.optimizer, jax.random.PRNGKey(options.seed))
        # Programs keyed by every setting they are built from: an equal trainer later in this
        # process (jrl.train.programs) reuses them and their compiled executables.
        config, contract, loss_fn = self.model_config, self.contract, self.loss_fn
        settings = (config, contract, loss_fn, options.optimizer, tuple(sorted(step_args.items())))
        if len(self.devices) == 1:
            self.mesh = None
            # jit_train_step: a frozen LoRA base is read in place, never copied per step.
            self._train_step = shared_program(("train_step",) + settings, lambda: jit_train_step(
                make_train_step(config, contract, loss_fn, make_optimizer(options.optimizer),
                                **step_args)))
            self._logprobs = shared_program(
                ("logprobs", config, contract, options.temperature),
                lambda: jax.jit(make_logprob_fn(config, contract,
                                                temperature=options.temperature)))
            self._scores = shared_program(
                ("scores", config, contract, tuple(sorted(score_args.items()))),
                lambda: jax.jit(make_score_fn(config, contract, **score_args)))
            # Every leaf committed to the train device, as the step's outputs are: no second
            # compile.
            self.state_placement = self.device
            self.batch_placement = self.device
        else:
            from jrl import parallel
            from jrl.train import parallel_step
            self.mesh = mesh = parallel.make_mesh(
                parallel.MeshConfig(data=options.mesh_data, fsdp=-1, tensor=options.mesh_tensor),
                devices=self.devices)
            shardings = parallel.train_state_shardings(jax.eval_shape(lambda: state),
                                                       self.model_config, self.mesh)
            leaves, treedef = jax.tree.flatten(shardings)
            self._train_step = shared_program(
                ("parallel_train_step", mesh, tuple(leaves), treedef) + settings,
                lambda: parallel.shard_train_step(
                    parallel_step.make_parallel_train_step(
                        config, contract, loss_fn, make_optimizer(options.optimizer), mesh,
                        **step_args),
                    shardings, parallel.batch_sharding(mesh), donate=False))
            self._logprobs = shared_program(
                ("parallel_logprobs", mesh, config, contract, options.temperature),
                lambda: jax.jit(parallel_step.make_parallel_logprob_fn(
                    config, contract, mesh, temperature=options.temperature)))
            self._scores = shared_program(
                ("parallel_scores", mesh, config, contract, tuple(sorted(score_args.items()))),
                lambda: jax.jit(parallel_step.make_parallel_score_fn(
                    config, contract, mesh, **score_args)))
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
        engine's logprobs [R, T] (host) of the packed tokens under any params; for MoE models
        (logp, routes [R, T, L_moe, k]): the router's own experts too (replaying the recorded
        routes under model.routing="replay")."""
        arrays = self._place((packed.tokens, packed.attn_mask, packed.logit_floor),
                             self.batch_placement)
        if self.model_config.has_moe:
            routes = (self._place(packed.routes, self.batch_placement) if self.replay
                      else None)

            def score_moe(params) -> tuple[np.ndarray, np.ndarray]:
                out = self._scores(params, *arrays, routes)
                return tuple(np.asarray(x) for x in self.host((out.logp, out.routes)))
            return score_moe

        def score(params) -> np.ndarray:
            logp, _ = self._logprobs(params, *arrays)
            return np.asarray(self.host(logp))
        return score

    def prepare(self, rollout: RolloutBatch) -> PreparedBatch:
        """The rollout as a complete TrainBatch with the trainer's versions (see prepare_batch)."""
        return prepare_batch(rollout, trainer_version=self.version,
                             current_params=self.state.params, held=self.versions,
                             score_with=self.score_with, options=self.options.prepare,
                             advantages=self.recipe.advantages, reference=self.reference)

    def train_on(self, batch: TrainBatch, rl_step: int) -> dict:
        """`epochs` passes over the batch in `mini_batches` updates (rows shuffled per epoch when
        there is more than one update). Returns the updates' metrics combined by their declared
        reductions, and train/lr."""
        options = self.options
        per_update = self.rows // options.mini_batches
        rng = np.random.default_rng([options.seed, rl_step])
        collected: list[dict] = []
        for _ in range(options.epochs):
            order = rng.permutation(self.rows) if self.updates_per_step > 1 else \
                np.arange(self.rows)
            for j in range(options.mini_batches):
                rows = order[j * per_update:(j + 1) * per_update]
                mini = self._place(select_rows(batch, rows), self.batch_placement)
                self.state, metrics = self._train_step(self.state, mini)
                collected.append(metrics)
        out = names.combine_updates(self.host(collected))
        # The rate the step's last update ran at: optax's schedule reads the update count
        # before the update (the first update of a warmup from 0 runs at rate 0).
        out[names.TRAIN_LR] = learning_rate_at(options.optimizer,
                                               max(0, int(self.host(self.state.step)) - 1))
        return out

    def freeze_reference(self) -> None:
        """The frozen reference policy := the current params, when the options train with one
        (after the warm start of a fresh run; a resumed run restores its own)."""
        if self.options.with_reference:
            self.reference = self.state.params

    def hold_version(self) -> int:
        """Holds the current params as their version, for rescoring the tokens they sample
        (drops versions past keep_versions); returns that version."""
        version = self.version
        self.versions[version] = self.state.params
        for old in sorted(self.versions)[:-self.keep_versions]:
            del self.versions[old]
        return version

    def publish(self, devices: list) -> Published:
        """The current params for the rollout side: a copy on each of `devices`, held as their
        version (hold_version). Returns Published(copies, version, seconds of the copy)."""
        start = time.perf_counter()
        source = self.host(self.state.params) if self.multi else self.state.params
        copies = self.publisher(source, devices)
        jax.block_until_ready(copies)
        version = self.hold_version()
        return Published(copies, version, time.perf_counter() - start)

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
        # Restored into self.state's shardings (global ones with several processes); a
        # checkpointer alone in a multi-process job gives host arrays, placed here.
        self.state = state if self.multi else jax.device_put(state, self.state_placement)
        self.reference = reference
        if reference is not None and not self.multi:
            self.reference = jax.device_put(reference, self.state_placement.params
                                            if self.mesh is not None else self.state_placement)
        return meta

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpointer.directory     # absolute, or a URL (jrl.paths.resolve)
