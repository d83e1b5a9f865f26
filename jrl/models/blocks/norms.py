"""RMSNorm scales as the families define them, through the batch-invariant kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig


def norm(x: jax.Array, weight: jax.Array, config: ModelConfig,
         contract: NumericalContract) -> jax.Array:
    """x / rms(x) * s with s = weight (Llama, Qwen2, Qwen3) or s = 1 + weight in float32
    (config.norm_offset = 1: Qwen3.5's zero-centred norms, as transformers computes them).
    x [..., D], weight [D] -> [..., D] in x.dtype."""
    scale = weight if config.norm_offset == 0.0 else (
        jnp.float32(config.norm_offset) + weight.astype(jnp.float32))
    return kernels.rms_norm(x, scale, eps=config.rms_norm_eps, contract=contract)
