"""A run's prompts from its config: the train and eval examples of data.source, cut to
data.train_size / eval_size, and only those whose prompts fit (jrl.pipeline.setup.data_checks)."""

from __future__ import annotations

from typing import Callable

from jrl import logs
from jrl.paths import require_path
from jrl.data import ArithmeticTask, PromptExample, load_prompt_file, load_tfds_gsm8k
from jrl.pipeline.config import RunConfig
from jrl.pipeline.rollout.task import Task
from jrl.pipeline.setup import data_checks
from jrl.plugins import load_plugin


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
        # Both paths are checked before either file is read: a missing eval file costs no load.
        path = require_path("data.path", data.path)
        eval_path = require_path("data.eval_path", data.eval_path) if data.eval_path else None
        train = _first(load(path), data.train_size, "data.train_size", path, log)
        if eval_path is None:
            log("data: no eval set (data.eval_path is empty): eval/* is not measured; set "
                "data.eval_path to a held-out file")
            return train, []
        return train, _first(load(eval_path), data.eval_size, "data.eval_size", eval_path, log)
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


def checked_data(cfg: RunConfig, task: Task, train: list[PromptExample],
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
