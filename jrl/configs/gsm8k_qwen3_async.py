"""The seed article's asynchronous GSM8K run: 4 rollout + 4 train devices, staleness bound 1.

Same as gsm8k_qwen3_sync but responses up to 2048 tokens and TIS (cap 2) against the sampler's
p_b; the rollout side generates the next batch while the trainer trains, weights are swapped into
in-flight generations (interruptible), and admission control keeps every consumed token at most
one policy version old. Point it at local files as in gsm8k_qwen3_sync.py.
"""

import dataclasses

from jrl.configs import gsm8k_qwen3_sync
from jrl.pipeline.config import RunConfig


def get_config() -> RunConfig:
    base = gsm8k_qwen3_sync.get_config()
    return dataclasses.replace(
        base,
        name="gsm8k_qwen3_async",
        sampling=base.sampling.replace(max_new_tokens=2048),
        algorithm=dataclasses.replace(base.algorithm, tis_cap=2.0, dynamic_sampling=False),
        # TIS corrects p_old / p_b: p_old must be the trainer's own logprob, not p_b.
        train=dataclasses.replace(base.train, old_logp="recompute"),
        pipeline=dataclasses.replace(base.pipeline, max_staleness=1, rollout_devices=4,
                                     train_devices=4, interrupt=True, kv_on_swap="keep"),
    )
