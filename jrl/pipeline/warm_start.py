"""The supervised warm start: token-mean cross-entropy on the training set's worked solutions."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from jrl.data import PromptExample, PromptStream, with_wrong_final_answers
from jrl.metrics import names
from jrl.models.config import ModelConfig
from jrl.models.tokenizer import Tokenizer
from jrl.pipeline import builders
from jrl.pipeline.experiment import ExperimentConfig
from jrl.train import OptimizerConfig, create_train_state, make_optimizer, make_sft_step


def warm_start(params: Any, config: ExperimentConfig, model_config: ModelConfig,
               examples: list[PromptExample], *, tokenizer: Tokenizer,
               render: Callable[[PromptExample], list[int]], seq_len: int, device,
               log: Callable[[str], None] = print) -> Any:
    """config.train.sft_steps Adam steps (sft_learning_rate, constant) on batches of
    sft_batch_size solutions drawn from `examples`; returns the new params on `device`.

    With train.sft_wrong_answer_frac > 0, that fraction of the solutions ends in a wrong final
    answer (jrl.data.with_wrong_final_answers), chosen per example once for the whole warm start.
    """
    cfg = config
    if cfg.train.sft_steps == 0:
        return params
    optimizer = make_optimizer(OptimizerConfig(
        learning_rate=cfg.train.sft_learning_rate, warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0))
    state = jax.device_put(create_train_state(params, optimizer, jax.random.PRNGKey(cfg.seed)),
                           device)
    step = jax.jit(make_sft_step(model_config, cfg.numerics, optimizer))
    examples = with_wrong_final_answers(examples, cfg.train.sft_wrong_answer_frac,
                                        seed=cfg.data.seed + 2)
    stream = PromptStream(examples, seed=cfg.data.seed + 1)
    start = time.perf_counter()
    for i in range(cfg.train.sft_steps):
        batch = builders.sft_batch(stream.next_batch(cfg.train.sft_batch_size), tokenizer,
                                   render, seq_len)
        state, metrics = step(state, jax.device_put(batch, device))
        if (i + 1) % max(1, cfg.train.sft_steps // 5) == 0 or i == 0:
            log(f"  sft {i + 1}/{cfg.train.sft_steps}: loss {float(metrics[names.SFT_LOSS]):.4f}")
    log(f"warm start: {cfg.train.sft_steps} steps in {time.perf_counter() - start:.1f}s")
    return state.params
