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
(jrl.pipeline.warm_start.start_policy: warm start, then the frozen reference), and publishing the
weights before the worker starts (jrl.pipeline.rl_step.publish_to).

Injection: task (a Task instance), sampler_factory(cfg, model_config, sampling) -> Sampler
(builders.build_sampler's signature; e.g. functools.partial(build_sampler, cls=MySampler)),
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
from jrl.pipeline import builders, data_checks
from jrl.pipeline.config import RunConfig
from jrl.pipeline.rollout import RolloutOptions
from jrl.pipeline.rollout_worker import RolloutWorker
from jrl.pipeline.spmd import check_spmd
from jrl.pipeline.task import Task
from jrl.pipeline.trainer import Trainer, TrainerOptions
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
                sampler_factory: Callable[..., Sampler] = builders.build_sampler,
                trainer_factory: Callable[..., Trainer] = Trainer,
                worker_factory: Callable[..., RolloutWorker] = RolloutWorker,
                log: Callable[[str], None] = logs.info) -> RunParts:
    """Builds every part of a run from `cfg` (module docstring).

    devices: the devices to split into rollout and train sets (pipeline.rollout_devices /
    train_devices; default jax.devices()); ignored with multi=True. reward_fn /
    raise_reward_errors: for the default Task (Task.from_config); give `task` instead to
    replace it whole. Every prompt is rendered now: one longer than rollout.max_prompt_len is
    a ValueError naming it, or is left out with a count logged (data.too_long="skip"); data
    hygiene warnings (jrl.pipeline.data_checks) are logged too.
    """
    if multi:
        check_spmd(cfg, process_count=jax.process_count(), device_count=jax.device_count())
        rollout_devices, train_devices = [jax.local_devices()[0]], list(jax.devices())
        processes, shard = jax.process_count(), jax.process_index()
    else:
        rollout_devices, train_devices = builders.rollout_and_train_devices(
            devices if devices is not None else jax.devices(),
            cfg.pipeline.rollout_devices, cfg.pipeline.train_devices)
        processes, shard = 1, 0
    model_config, params, tokenizer = builders.build_model(cfg)
    builders.check_model_fits(cfg, model_config)
    if task is None:
        task = Task.from_config(cfg, tokenizer, reward_fn=reward_fn,
                                raise_reward_errors=raise_reward_errors)
    train_examples, eval_examples = builders.build_data(cfg, log)
    train_examples, eval_examples = _checked_data(cfg, task, train_examples, eval_examples, log)
    stream = PromptStream(train_examples, seed=cfg.seeds().data)
    if multi:
        stream = stream.shard(shard, processes)
    recipe = cfg.recipe()
    trainer = trainer_factory(TrainerOptions.from_config(cfg), model_config, params,
                              train_devices, contract=cfg.numerics, recipe=recipe,
                              multi=multi, checkpoint_dir=checkpoint_dir)
    sampling = task.sampling_params(cfg.resolved_sampling())
    samplers = [sampler_factory(cfg, model_config, sampling) for _ in rollout_devices]
    eval_sampler = sampler_factory(cfg, model_config, sampling.replace(greedy=True,
                                                                       group_size=1))
    worker = worker_factory(samplers, rollout_devices, stream, task,
                            RolloutOptions.from_config(cfg, processes=processes,
                                                       shard_index=shard, recipe=recipe))
    return RunParts(cfg, model_config, tokenizer, recipe, task, train_examples, eval_examples,
                    stream, rollout_devices, train_devices, samplers, eval_sampler, trainer,
                    worker, multi)


def _checked_data(cfg: RunConfig, task: Task, train: list[PromptExample],
                  evals: list[PromptExample], log: Callable[[str], None]
                  ) -> tuple[list[PromptExample], list[PromptExample]]:
    """The train and eval examples whose prompts fit (data_checks.fit_prompts), after logging
    what was left out and, for data files, the hygiene warnings (data_checks.hygiene_warnings:
    the synthetic arithmetic task repeats train questions by design and keeps eval apart)."""
    fitted = []
    for split, examples in (("train", train), ("eval", evals)):
        kept, skipped = data_checks.fit_prompts(
            examples, task.render, max_prompt_len=cfg.rollout.max_prompt_len,
            too_long=cfg.data.too_long, split=split, env_name=task.env_name)
        if skipped:
            log(f"data.too_long='skip': left out {skipped} of {len(examples)} {split} prompts "
                f"longer than rollout.max_prompt_len={cfg.rollout.max_prompt_len} tokens")
        if examples and not kept:
            raise ValueError(f"every {split} prompt is longer than rollout.max_prompt_len="
                             f"{cfg.rollout.max_prompt_len} tokens; raise it")
        fitted.append(kept)
    if cfg.data.source != "arithmetic":   # the synthetic task repeats train questions by design
        for warning in data_checks.hygiene_warnings(*fitted):
            log(warning)
    return fitted[0], fitted[1]
