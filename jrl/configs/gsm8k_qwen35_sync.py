"""The seed article's synchronous GSM8K run on its own model, Qwen3.5-0.8B, for an accelerator.

The article's settings (see jrl/configs/gsm8k_qwen3_sync.py for each): GRPO, temperature 1.0, 1024
responses per step (128 prompts x 8), one optimizer update per rollout, responses up to 1024
tokens, p_old recomputed by the train engine, dynamic sampling on, reference KL computed with
coefficient 0. Qwen3.5-0.8B is a hybrid of Gated DeltaNet and gated attention (3 to 1): jrl
loads the Hub's Qwen3_5ForConditionalGeneration directory (its text model; the vision tower and
the MTP head are skipped) or a text-only Qwen3_5ForCausalLM one. Point it at local files:

    python -m jrl.cli.train --config jrl/configs/gsm8k_qwen35_sync.py \\
        --set model.path=/path/to/Qwen3.5-0.8B --set data.path=/path/to/gsm8k/train.jsonl \\
        --set data.eval_path=/path/to/gsm8k/test.jsonl
"""

import dataclasses

from jrl.configs import gsm8k_qwen3_sync
from jrl.pipeline.config import RunConfig


def get_config() -> RunConfig:
    base = gsm8k_qwen3_sync.get_config()
    return dataclasses.replace(base, name="gsm8k_qwen35_sync")
