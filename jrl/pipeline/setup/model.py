"""The policy of a run from its config: the weights (jrl.models.loading.load_weights, or a random
init), the tokenizer with the model's eos ids among its stop ids, LoRA adapters, and the config's
rules that need the model."""

from __future__ import annotations

import dataclasses

import jax

from jrl.models import CharTokenizer, lora, transformer
from jrl.models.loading import load_tokenizer, load_weights, with_eos_stops
from jrl.pipeline.config import RunConfig


def build_model(cfg: RunConfig):
    """(ModelConfig, params, tokenizer) with params in cfg.numerics.param_dtype; with
    model.lora, the config and params carry fresh adapters (B = 0) on the (quantised) base."""
    source = cfg.model.source
    dtype = cfg.numerics.params
    if source == "random":
        model_config = cfg.model.arch
        params = transformer.init_params(model_config, jax.random.key(cfg.seeds().model_init),
                                         dtype)
        tokenizer = None
    else:
        model_config, params, tokenizer = load_weights("model.path", source, cfg.model.path,
                                                       cfg.numerics)
        if source == "hf" and cfg.model.tokenizer == "model":
            tokenizer = load_tokenizer(cfg.model.path)
    if cfg.model.tokenizer == "char":
        tokenizer = CharTokenizer()
        if tokenizer.vocab_size > model_config.vocab_size:
            raise ValueError(f"model.tokenizer='char' needs vocab_size >= {tokenizer.vocab_size}"
                             f"; model.arch.vocab_size={model_config.vocab_size}")
    elif tokenizer is None:
        raise ValueError(f"model.tokenizer='model' but model.source={source!r} has no tokenizer")
    tokenizer = with_eos_stops(tokenizer, model_config)
    if cfg.model.lora.enabled:
        adapters = dataclasses.replace(cfg.model.lora, seed=cfg.seeds().lora)
        model_config, params = lora.attach(model_config, params, adapters, dtype=dtype)
    return model_config, params, tokenizer


def check_model_fits(cfg: RunConfig, model_config) -> None:
    """The config's rules that need the model: sampling.stop_tokens are ids of its vocabulary,
    and a sample's positions (rollout.max_prompt_len + sampling.max_new_tokens) fit its
    max_position_embeddings. ValueError naming the fields otherwise."""
    vocab = model_config.vocab_size
    outside = [t for t in cfg.sampling.stop_tokens if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"sampling.stop_tokens={list(cfg.sampling.stop_tokens)}: {outside} "
                         f"outside the model's vocabulary [0, {vocab})")
    positions = cfg.rollout.max_prompt_len + cfg.sampling.max_new_tokens
    limit = model_config.max_position_embeddings
    if positions > limit:
        raise ValueError(f"rollout.max_prompt_len + sampling.max_new_tokens = "
                         f"{cfg.rollout.max_prompt_len} + {cfg.sampling.max_new_tokens} = "
                         f"{positions} positions, more than the model's "
                         f"max_position_embeddings={limit}")
