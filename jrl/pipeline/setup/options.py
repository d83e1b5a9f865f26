"""The config's side of every part: each part's options (and the task) read from a RunConfig.

The parts themselves (jrl.pipeline.rollout, jrl.pipeline.training) never see a RunConfig; a
hand-written loop builds their options directly, or reads them from a config here:

    task = task_from_config(cfg, tokenizer)
    trainer = Trainer(trainer_options(cfg), model_config, params, devices, recipe=recipe, ...)
    worker = RolloutWorker(samplers, devices, stream, task, rollout_options(cfg, recipe=recipe))
"""

from __future__ import annotations

from typing import Callable

from jrl.data import PromptTemplate
from jrl.losses.recipes import Recipe
from jrl.pipeline.config import RunConfig
from jrl.pipeline.rollout.batch import RolloutOptions, RolloutSpec
from jrl.pipeline.rollout.task import Task
from jrl.pipeline.training.prepare import PrepareOptions
from jrl.pipeline.training.trainer import TrainerOptions
from jrl.rewards import math_reward


def task_from_config(cfg: RunConfig, tokenizer, *, reward_fn: Callable | None = None,
                     raise_reward_errors: bool = False) -> Task:
    """The task of a run config: data.template, sampling.stop_tokens (plus the tokenizer's),
    rollout.reward_fn (your own reward, imported now) or else rollout.reward_mode /
    format_reward for the default math verifier, and the env section. reward_fn (in code)
    replaces the verifier (not allowed with a multi-turn env, nor beside rollout.reward_fn:
    ValueError)."""
    if reward_fn is not None and cfg.env.multi_turn:
        raise ValueError(f"env.name={cfg.env.name!r}: a multi-turn run's reward is its "
                         "environment's; a reward_fn would not be used")
    if reward_fn is not None and cfg.rollout.reward_fn:
        raise ValueError(f"a reward_fn was given in code and rollout.reward_fn="
                         f"{cfg.rollout.reward_fn!r} in the config: give one")
    if reward_fn is None:
        reward_fn = cfg.rollout.custom_reward()
    if reward_fn is None:
        mode, format_reward = cfg.rollout.reward_mode, cfg.rollout.format_reward

        def reward_fn(text, example):
            return math_reward(text, example, mode=mode, format_reward=format_reward)
    return Task(tokenizer=tokenizer, template=template_from_config(cfg),
                reward_fn=reward_fn, raise_reward_errors=raise_reward_errors,
                stop_tokens=cfg.sampling.stop_tokens,
                make_env=(cfg.env.environment_factory(cfg.rollout.reward_mode)
                          if cfg.env.multi_turn else None),
                episode_options=cfg.env.episode_options(), env_threads=cfg.env.threads,
                env_name=cfg.env.name)


def template_from_config(cfg: RunConfig) -> PromptTemplate:
    return PromptTemplate(kind=cfg.data.template, user_format=cfg.data.user_format,
                          system=cfg.data.system,
                          chat_template_kwargs=cfg.data.template_variables())


def prepare_options(cfg: RunConfig) -> PrepareOptions:
    train = cfg.resolved_train()        # reference / old_logp: the recipe's where unset
    return PrepareOptions(rows=cfg.rollout.prompts_per_step * cfg.sampling.group_size,
                          seq_len=cfg.rollout.max_prompt_len + cfg.sampling.max_new_tokens,
                          drop_stale_beyond=cfg.pipeline.drop_stale_beyond,
                          kv_on_swap=cfg.pipeline.kv_on_swap, old_logp=train.old_logp,
                          reference=train.reference, kl_reward_coef=train.kl_reward_coef,
                          routing=cfg.model.routing,
                          exact=cfg.numerics.backend == "pallas", p_o_every=cfg.train.p_o_every)


def trainer_options(cfg: RunConfig) -> TrainerOptions:
    return TrainerOptions(prepare=prepare_options(cfg), optimizer=cfg.resolved_optimizer(),
                          mini_batches=cfg.train.mini_batches, epochs=cfg.train.epochs,
                          micro_batches=cfg.train.micro_batches,
                          temperature=cfg.sampling.temperature, seed=cfg.seed,
                          keep_versions=max(cfg.pipeline.keep_versions,
                                            cfg.pipeline.max_staleness + 1),
                          mesh_data=cfg.pipeline.train_mesh_data,
                          mesh_tensor=cfg.pipeline.train_mesh_tensor,
                          checkpoint_keep=cfg.checkpoint.keep, routing=cfg.model.routing)


def rollout_spec(cfg: RunConfig, *, processes: int = 1,
                 recipe: Recipe | None = None) -> RolloutSpec:
    """The config's batch shape and the shaping of `recipe` (default: the config's own,
    cfg.recipe()); `processes` share the prompts of a step (SPMD: each samples
    prompts_per_step / processes of them)."""
    recipe = cfg.recipe() if recipe is None else recipe
    return RolloutSpec(prompts_per_step=cfg.rollout.prompts_per_step // processes,
                       group_size=cfg.sampling.group_size,
                       max_new_tokens=cfg.sampling.max_new_tokens, shaping=recipe.shaping,
                       max_rounds=cfg.rollout.max_sampling_rounds)


def rollout_options(cfg: RunConfig, *, processes: int = 1, shard_index: int = 0,
                    recipe: Recipe | None = None) -> RolloutOptions:
    return RolloutOptions(spec=rollout_spec(cfg, processes=processes, recipe=recipe),
                          updates_per_step=cfg.train.updates_per_step,
                          max_staleness=cfg.pipeline.max_staleness,
                          interrupt=cfg.pipeline.interrupt, queue_size=cfg.pipeline.queue_size,
                          precompile=cfg.rollout.precompile, shard_index=shard_index)
