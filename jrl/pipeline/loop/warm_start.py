"""The supervised warm start: token-mean cross-entropy on the training set's worked solutions,
and the policy a fresh run starts from (start_policy: warm start, then the frozen reference)."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np

from jrl import logs
from jrl.data import PromptExample, PromptStream, with_wrong_final_answers
from jrl.metrics import names
from jrl.models.config import ModelConfig
from jrl.pipeline.setup import data_checks
from jrl.pipeline.config import RunConfig
from jrl.stop_request import check_stop
from jrl.pipeline.rollout.task import Task
from jrl.pipeline.training.trainer import Trainer
from jrl.train import (OptimizerConfig, create_train_state, jit_train_step, make_optimizer,
                       make_sft_step, shared_program)
from jrl.train.state import sft_batch_from_segments


def start_policy(trainer: Trainer, config: RunConfig, examples: list[PromptExample], *,
                 task: Task, device=None, log: Callable[[str], None] = logs.info) -> None:
    """A fresh run's starting policy, set on `trainer`: the supervised warm start (warm_start,
    train.sft_steps) of its params on `device` (default the train device; with several
    processes each runs the same SFT on a local device), then the frozen reference set to the
    result when train.reference != "none". Run and the split-process mode call it once, before
    the first step of a run that did not resume (a resumed run restores both)."""
    params = trainer.params_on_host() if trainer.multi else trainer.state.params
    trainer.set_params(warm_start(params, config, trainer.model_config, examples, task=task,
                                  seq_len=trainer.seq_len, device=device or trainer.device,
                                  log=log))
    trainer.freeze_reference()


def warm_start(params: Any, config: RunConfig, model_config: ModelConfig,
               examples: list[PromptExample], *, task: Task, seq_len: int, device,
               log: Callable[[str], None] = logs.info) -> Any:
    """config.train.sft_steps Adam steps (sft_learning_rate, constant) on batches of
    sft_batch_size solutions drawn from `examples` (prompts rendered by the task, each solution
    ending in the tokenizer's first stop id); returns the new params on `device`.

    With train.sft_wrong_answer_frac > 0, that fraction of the solutions ends in a wrong final
    answer (jrl.data.with_wrong_final_answers), chosen per example once for the whole warm start.
    With train.sft_tool_frac > 0, that fraction of the examples (chosen the same way) is shown
    as a tool-using episode instead: the task's demonstration(example) segments
    (jrl.train.state.sft_batch_from_segments).
    """
    cfg = config
    if cfg.train.sft_steps == 0:
        return params
    optimizer_config = OptimizerConfig(learning_rate=cfg.train.sft_learning_rate,
                                       warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0)
    optimizer = make_optimizer(optimizer_config)
    state = jax.device_put(create_train_state(params, optimizer, jax.random.PRNGKey(cfg.seed)),
                           device)
    # Shared with an equal warm start earlier in the process (jrl.train.programs).
    step = shared_program(("sft_step", model_config, cfg.numerics, optimizer_config),
                          lambda: jit_train_step(make_sft_step(model_config, cfg.numerics,
                                                               optimizer)))
    data_seed = cfg.seeds().data
    examples = with_wrong_final_answers(examples, cfg.train.sft_wrong_answer_frac,
                                        seed=data_seed + 2)
    stream = PromptStream(examples, seed=data_seed + 1)
    start = time.perf_counter()
    tool_frac = cfg.train.sft_tool_frac
    if tool_frac > 0 and not task.multi_turn:
        raise ValueError(f"train.sft_tool_frac={tool_frac} needs a multi-turn task (an "
                         "environment's demonstrations)")
    tokenizer = task.tokenizer
    eos = tokenizer.stop_ids[0]

    if tool_frac < 1:
        missing = next((i for i, e in enumerate(examples) if not e.solution), None)
        if missing is not None:
            where = data_checks.describe_example(examples[missing], missing)
            raise ValueError(
                f"train.sft_steps={cfg.train.sft_steps} needs a worked solution for every "
                f"training example, and {where} has none: name the record field that holds "
                "one (data.solution_field) or set train.sft_steps=0")

    def segments(example: PromptExample) -> list:
        if tool_frac > 0 and np.random.default_rng([data_seed + 3, example.id]).random() \
                < tool_frac:
            return task.demonstration(example)
        if not example.solution:
            raise ValueError(f"example {example.id} has no solution text for the SFT warm start")
        return [(task.render(example), False),
                (list(tokenizer.encode(example.solution)) + [eos], True)]

    _check_rows(examples, segments, seq_len, log)
    for i in range(cfg.train.sft_steps):
        check_stop()    # a stop request ends the warm start between steps (nothing is saved)
        batch = sft_batch_from_segments(
            [segments(e) for e in stream.next_batch(cfg.train.sft_batch_size)], seq_len)
        state, metrics = step(state, jax.device_put(batch, device))
        if (i + 1) % max(1, cfg.train.sft_steps // 5) == 0 or i == 0:
            log(f"  sft {i + 1}/{cfg.train.sft_steps}: loss {float(metrics[names.SFT_LOSS]):.4f}")
    log(f"warm start: {cfg.train.sft_steps} steps in {time.perf_counter() - start:.1f}s")
    return state.params


def _check_rows(examples: list[PromptExample], segments: Callable[[PromptExample], list],
                seq_len: int, log: Callable[[str], None]) -> None:
    """Every warm-start row is built once before training: a solution the tokenizer cannot
    encode is refused naming its file and line (or example index); rows longer than seq_len
    (rollout.max_prompt_len + sampling.max_new_tokens) are cut there, which drops their final
    answer and end of sequence from training, so they are counted and said; a warm start in
    which no row keeps a single trained token is refused."""
    cut = useless = 0
    for index, example in enumerate(examples):
        try:
            row = segments(example)
        except ValueError as error:
            raise ValueError(f"warm start, {data_checks.describe_example(example, index)}: "
                             f"{error}") from error
        cut += sum(len(ids) for ids, _ in row) > seq_len
        position, trained = 0, False
        for ids, is_trained in row:
            trained |= is_trained and position < seq_len and len(ids) > 0
            position += len(ids)
        useless += not trained
    row = f"the row of {seq_len} tokens (rollout.max_prompt_len + sampling.max_new_tokens)"
    if useless == len(examples):
        raise ValueError(f"warm start: no solution token of the {len(examples)} examples fits "
                         f"{row}: nothing would be trained; raise sampling.max_new_tokens")
    if cut:
        log(f"warm start: {cut} of {len(examples)} prompt + solution rows are longer than "
            f"{row} and are cut there: their final answer and end of sequence are not trained")
