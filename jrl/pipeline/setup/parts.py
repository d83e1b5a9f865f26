"""A run's parts built from its config: the one builder that Run, the split-process mode and a
hand-written loop share.

    parts = build_parts(cfg)                  # RunParts
    parts.task, parts.trainer, parts.worker, parts.samplers, parts.eval_sampler, parts.stream

What it settles, so that no caller has to rediscover it:
- every sampler uses the task's stop ids (Task.sampling_params: the tokenizer's stop ids merged
  into sampling.stop_tokens), and decoding drops them (Task.decode);
- one sampler per rollout device, plus a greedy single-sample one for evaluation;
- the trainer's options, the recipe's loss chain and the checkpoint directory;
- with several processes (multi=True), each samples its share of the prompts
  (prompts_per_step / processes, its shard of the stream) on its first local device and
  training runs on one mesh over every process's devices.

What happens once per run is the caller's (Run.run does both): the fresh run's starting policy
(jrl.pipeline.loop.warm_start.start_policy: warm start, then the frozen reference), and
publishing the weights before the worker starts (jrl.pipeline.training.rl_step.publish_to).

Injection: task (a Task instance), sampler_factory(cfg, model_config, sampling) -> Sampler
(jrl.pipeline.setup.samplers.build_sampler's signature; e.g.
functools.partial(build_sampler, cls=MySampler)),
trainer_factory(options, model_config, params, devices, **keywords) -> Trainer (Trainer's
signature) and worker_factory(samplers, devices, stream, task, options) -> RolloutWorker replace
the default parts, e.g. simulated devices (launch/simulate.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jrl import logs
from jrl.data import PromptExample, PromptStream
from jrl.losses import Recipe
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.pipeline.config import RunConfig
from jrl.pipeline.rollout.task import Task
from jrl.pipeline.rollout.worker import RolloutWorker
from jrl.pipeline.setup.data import build_data, checked_data
from jrl.pipeline.setup.devices import check_spmd, rollout_and_train_devices
from jrl.pipeline.setup.model import build_model, check_model_fits
from jrl.pipeline.setup.options import rollout_options, task_from_config, trainer_options
from jrl.pipeline.setup.samplers import build_sampler
from jrl.pipeline.training.trainer import Trainer
from jrl.sampling import Sampler


@dataclasses.dataclass
class RunParts:
    """The parts of one run (module docstring). samplers[i] samples on rollout_devices[i]."""

    config: RunConfig
    model_config: ModelConfig
    tokenizer: Any
    recipe: Recipe
    task: Task
    train_examples: list[PromptExample]
    eval_examples: list[PromptExample]
    stream: PromptStream
    rollout_devices: list
    train_devices: list
    samplers: list[Sampler]
    eval_sampler: Sampler
    trainer: Trainer
    worker: RolloutWorker
    multi: bool = False

    def describe(self) -> str:
        """The run's banner: size, numerics, devices, staleness bound, fast-rollout options,
        then the whole recipe (advantages + loss chain + shaping) on its own line."""
        cfg, contract = self.config, self.config.numerics
        fast = [name for name, on in (("share_prefill", cfg.rollout.share_prefill),
                                      (f"speculative={cfg.rollout.speculative.num_draft}",
                                       cfg.rollout.speculative.enabled),
                                      (f"draft={cfg.rollout.speculative.draft}",
                                       cfg.rollout.speculative.draft)) if on]
        return (f"jrl run {cfg.name!r}: {transformer.num_params(self.model_config):,} params, "
                f"backend={contract.backend} ({contract.compute_dtype}), rollout devices "
                f"{len(self.rollout_devices)}, train devices {len(self.train_devices)}, "
                f"max_staleness={cfg.pipeline.max_staleness}"
                + (", rollout " + " ".join(fast) if fast else "")
                + f"\nrecipe: {self.recipe!r}")


def build_parts(cfg: RunConfig, *, devices: list | None = None, multi: bool = False,
                checkpoint_dir: str | None = None, task: Task | None = None,
                reward_fn: Callable | None = None, raise_reward_errors: bool = False,
                sampler_factory: Callable[..., Sampler] = build_sampler,
                trainer_factory: Callable[..., Trainer] = Trainer,
                worker_factory: Callable[..., RolloutWorker] = RolloutWorker,
                log: Callable[[str], None] = logs.info) -> RunParts:
    """Builds every part of a run from `cfg` (module docstring).

    devices: the devices to split into rollout and train sets (pipeline.rollout_devices /
    train_devices; default jax.devices()); ignored with multi=True. reward_fn /
    raise_reward_errors: for the default Task (jrl.pipeline.setup.options.task_from_config);
    give `task` instead to replace it whole. Every prompt is rendered now: one longer than
    rollout.max_prompt_len is a ValueError naming it, or is left out with a count logged
    (data.too_long="skip"); data hygiene warnings (jrl.pipeline.setup.data_checks) are logged
    too.
    """
    if multi:
        check_spmd(cfg, process_count=jax.process_count(), device_count=jax.device_count())
        rollout_devices, train_devices = [jax.local_devices()[0]], list(jax.devices())
        processes, shard = jax.process_count(), jax.process_index()
    else:
        rollout_devices, train_devices = rollout_and_train_devices(
            devices if devices is not None else jax.devices(),
            cfg.pipeline.rollout_devices, cfg.pipeline.train_devices)
        processes, shard = 1, 0
    model_config, params, tokenizer = build_model(cfg)
    check_model_fits(cfg, model_config)
    recipe = cfg.recipe()
    if task is None:
        task = task_from_config(cfg, tokenizer, reward_fn=reward_fn,
                                raise_reward_errors=raise_reward_errors)
    train_options = trainer_options(cfg)
    worker_options = rollout_options(cfg, processes=processes, shard_index=shard, recipe=recipe)
    train_examples, eval_examples = build_data(cfg, log)
    train_examples, eval_examples = checked_data(cfg, task, train_examples, eval_examples, log)
    stream = PromptStream(train_examples, seed=cfg.seeds().data)
    if multi:
        stream = stream.shard(shard, processes)
    trainer = trainer_factory(train_options, model_config, params,
                              train_devices, contract=cfg.numerics, recipe=recipe,
                              multi=multi, checkpoint_dir=checkpoint_dir)
    sampling = task.sampling_params(cfg.resolved_sampling())
    samplers = [sampler_factory(cfg, model_config, sampling) for _ in rollout_devices]
    eval_sampler = sampler_factory(cfg, model_config, sampling.replace(greedy=True,
                                                                       group_size=1))
    worker = worker_factory(samplers, rollout_devices, stream, task, worker_options)
    return RunParts(cfg, model_config, tokenizer, recipe, task, train_examples, eval_examples,
                    stream, rollout_devices, train_devices, samplers, eval_sampler, trainer,
                    worker, multi)
