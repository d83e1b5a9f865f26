"""Builds the pieces of a run from its config: model, tokenizer, data, template, samplers, the
device split (jrl.pipeline.parts assembles them into a run's parts; the algorithm comes from
RunConfig.recipe())."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import numpy as np

from jrl import logs
from jrl.data import (ArithmeticTask, PromptExample, PromptTemplate, load_prompt_file,
                      load_tfds_gsm8k)
from jrl.envs import Environment, make_environment
from jrl.models import (CharTokenizer, load_gguf, load_hf, load_hf_mtp, load_tokenizer,
                        smollm2_gguf_path)
from jrl.models import lora, transformer
from jrl.models.mtp import MtpHead
from jrl.parallel import split_devices
from jrl.pipeline.config import RunConfig
from jrl.plugins import load_plugin
from jrl.sampling import DraftModel, Sampler, SamplingParams, SpeculativeConfig
from jrl.train.state import SFTBatch


def rollout_and_train_devices(devices: Sequence, rollout: int, train: int) -> tuple[list, list]:
    """(rollout devices, train devices) from pipeline.rollout_devices / pipeline.train_devices.

    0 and 0: both sides share the first device. Otherwise jrl.parallel.split_devices: the first
    `rollout` devices sample and the next `train` devices train (disjoint).
    """
    devices = list(devices)
    if rollout == 0 and train == 0:
        return devices[:1], devices[:1]
    if rollout <= 0 or train <= 0:
        raise ValueError(f"pipeline.rollout_devices={rollout} and pipeline.train_devices={train}:"
                         " set both (a disjoint split) or neither (share the first device)")
    if rollout + train > len(devices):
        raise ValueError(f"pipeline.rollout_devices + pipeline.train_devices = {rollout + train} "
                         f"but only {len(devices)} devices are available")
    return split_devices(devices, rollout, train)


def require_path(key: str, path: str | None) -> str:
    """Raises FileNotFoundError naming the config key when a configured path (local, or a URL:
    jrl.paths) does not exist."""
    from jrl import paths
    if not path or not paths.exists(path):
        raise FileNotFoundError(f"{key}={path!r}: no such file or directory; set it with "
                                f"--set {key}=/local/path")
    return path


def load_weights(key: str, source: str, path: str | None, numerics):
    """(ModelConfig, params, tokenizer or None) of a checkpoint: source "hf" (a directory),
    "gguf" (a file, with its tokenizer) or "smollm2" (the packaged GGUF); `key` names the
    config field in the error for a missing path."""
    if source == "smollm2":
        return load_gguf(smollm2_gguf_path(), dtype=numerics.params)
    require_path(key, path)
    if source == "gguf":
        import os
        if os.path.isdir(path):
            raise ValueError(f"{key}={path!r} is a directory; a GGUF model is one .gguf file "
                             "(a Hugging Face checkpoint directory is model.source='hf')")
        return load_gguf(path, dtype=numerics.params)
    config, params = load_hf(path, dtype=numerics.param_dtype)
    return config, params, None


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
    if model_config.eos_token_id is not None and hasattr(tokenizer, "with_stop_ids"):
        eos = model_config.eos_token_id
        tokenizer = tokenizer.with_stop_ids(eos if isinstance(eos, tuple) else (eos,))
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


def build_data(cfg: RunConfig, log: Callable[[str], None] = logs.info
               ) -> tuple[list[PromptExample], list[PromptExample]]:
    """(train, eval) examples of cfg.data. A file longer than data.train_size / eval_size is
    cut to its first records, and a run without eval set is said, each in one logged line."""
    data = cfg.data
    if data.source == "arithmetic":
        task = ArithmeticTask(num_terms=data.num_terms, max_operand=data.max_operand,
                              operators=data.operators, word_problems=data.word_problems)
        return task.train_eval_split(data.train_size, data.eval_size, seed=cfg.seeds().data)
    if data.source in ("gsm8k_jsonl", "file"):
        adapter = (load_plugin("data.record_adapter", data.record_adapter)
                   if data.record_adapter else None)

        def load(path):
            return load_prompt_file(path, data.record_fields(), adapter=adapter, log=log)
        path = require_path("data.path", data.path)
        train = _first(load(path), data.train_size, "data.train_size", path, log)
        if not data.eval_path:
            log("data: no eval set (data.eval_path is empty): eval/* is not measured; set "
                "data.eval_path to a held-out file")
            return train, []
        require_path("data.eval_path", data.eval_path)
        return train, _first(load(data.eval_path), data.eval_size, "data.eval_size",
                             data.eval_path, log)
    return (_first(load_tfds_gsm8k("train"), data.train_size, "data.train_size",
                   "TFDS gsm8k train", log),
            _first(load_tfds_gsm8k("test"), data.eval_size, "data.eval_size", "TFDS gsm8k test",
                   log))


def _first(records: list, size: int, field: str, where: str, log: Callable[[str], None]
           ) -> list:
    """The first `size` records, saying so when that cuts some off (in file order)."""
    if len(records) > size:
        log(f"data: using the first {size} of {len(records)} records of {where} ({field}; raise "
            "it to use more)")
    return records[:size]


def environment_factory(cfg: RunConfig) -> Callable[[], Environment]:
    """make_env() -> a new Environment per episode, from env.name: a built-in (its final answer
    graded with rollout.reward_mode; the python tool in env.sandbox) or "package.module:factory" (imported now, so that a typo is
    a setup error)."""
    name = cfg.env.name
    if ":" not in name:
        options = dict(reward_mode=cfg.rollout.reward_mode)
        if name == "python":
            options["sandbox"] = cfg.env.sandbox
        return functools.partial(make_environment, name, **options)
    factory = load_plugin("env.name", name)
    if not callable(factory):
        raise ValueError(f"env.name={name!r} is a {type(factory).__name__}, not a callable "
                         "that makes an Environment")
    return factory


def build_sampler(cfg: RunConfig, model_config, sampling: SamplingParams, *,
                  cls: type[Sampler] = Sampler, **extra) -> Sampler:
    """A sampler (`cls`, given `extra` keywords too, which take precedence) of the config's
    rollout section with `sampling` (give it the task's stop ids: Task.sampling_params): KV
    recompute on weight swaps with pipeline.kv_on_swap="recompute", room for
    env.max_observation_tokens per observation in multi-turn runs, shared prefill and
    speculative decoding (n-gram drafts, or rollout.speculative.draft's model) when
    rollout.share_prefill / rollout.speculative.num_draft turn them on."""
    rollout = cfg.rollout
    options = dict(num_slots=rollout.num_slots, max_prompt_len=rollout.max_prompt_len,
                   steps_per_call=rollout.steps_per_call,
                   recompute_kv_on_swap=cfg.pipeline.kv_on_swap == "recompute",
                   max_observation_len=(cfg.env.max_observation_tokens if cfg.env.multi_turn
                                        else 0),
                   share_prefill=rollout.share_prefill,
                   prefill_buckets=rollout.prefill_buckets)
    spec = rollout.speculative
    if spec.enabled:
        draft = spec.source
        if draft == "mtp":
            draft = load_mtp_head(cfg.model.path, cfg.numerics)
        elif draft == "draft_model":
            draft = load_draft_model(spec.draft, cfg.numerics)
        options["speculative"] = SpeculativeConfig(
            draft=draft, num_draft=spec.num_draft, ngram_max=spec.ngram_max,
            draft_min_accept=spec.draft_min_accept, draft_pick=spec.draft_pick or None)
    options.update(extra)
    return cls(model_config, cfg.numerics, sampling, **options)


@functools.lru_cache(maxsize=4)
def load_draft_model(path: str, numerics) -> DraftModel:
    """rollout.speculative.draft's model, loaded once for all sampler replicas."""
    source = ("smollm2" if path == "smollm2" else "gguf" if path.endswith(".gguf") else "hf")
    config, params, _ = load_weights("rollout.speculative.draft", source, path, numerics)
    return DraftModel(config, params)


@functools.lru_cache(maxsize=4)
def load_mtp_head(path: str, numerics) -> MtpHead:
    """The MTP head of the policy checkpoint at model.path (rollout.speculative.draft='mtp'),
    loaded once for all sampler replicas."""
    _, params = load_hf_mtp(path, dtype=numerics.param_dtype)
    return MtpHead(params)


def build_template(cfg: RunConfig) -> PromptTemplate:
    return PromptTemplate(kind=cfg.data.template, user_format=cfg.data.user_format,
                          system=cfg.data.system,
                          chat_template_kwargs=cfg.data.template_variables())


def sft_batch_from_segments(rows: Sequence[Sequence[tuple[Sequence[int], bool]]],
                            seq_len: int) -> SFTBatch:
    """One row per list of (token ids, trained) segments, concatenated and cut at seq_len; the
    loss covers the trained segments (a multi-turn demonstration: the model's turns, not the
    prompt or the observations)."""
    tokens = np.zeros((len(rows), seq_len), np.int32)
    attn = np.zeros((len(rows), seq_len), bool)
    target = np.zeros((len(rows), seq_len), bool)
    for row, segments in enumerate(rows):
        ids, trained = [], []
        for segment, is_trained in segments:
            ids.extend(int(t) for t in segment)
            trained.extend([is_trained] * len(segment))
        ids, trained = ids[:seq_len], trained[:seq_len]
        tokens[row, :len(ids)] = ids
        attn[row, :len(ids)] = True
        target[row, :len(ids)] = trained
    return SFTBatch(tokens=tokens, attn_mask=attn, loss_mask=target)
