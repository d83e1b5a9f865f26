"""The seed article's asynchronous GSM8K run on Qwen3.5-0.8B: 4 rollout + 4 train devices,
staleness bound 1, responses up to 2048 tokens, TIS (cap 2) against the sampler's p_b (see
jrl/configs/gsm8k_qwen3_async.py); point it at local files as in gsm8k_qwen35_sync.py."""

import dataclasses

from jrl.configs import gsm8k_qwen3_async
from jrl.pipeline.config import RunConfig


def get_config() -> RunConfig:
    base = gsm8k_qwen3_async.get_config()
    return dataclasses.replace(base, name="gsm8k_qwen35_async")
