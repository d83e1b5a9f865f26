"""Mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE): a router, top-k experts, an optional shared
expert. (Forward pending the batch-invariant MoE kernels.)"""

from __future__ import annotations

import jax

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig


def param_shapes(config: ModelConfig, n: int) -> dict:
    """Shapes of a stack of n MoE MLPs: router [D, E], experts [E, D, F] / [E, F, D], and the
    shared expert (Qwen3.5-MoE) with its gate [D, 1]."""
    d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes = {"router": (n, d, e), "experts_gate": (n, e, d, f), "experts_up": (n, e, d, f),
              "experts_down": (n, e, f, d)}
    if config.shared_expert_intermediate_size:
        fs = config.shared_expert_intermediate_size
        shapes.update(shared_gate=(n, d, fs), shared_up=(n, d, fs), shared_down=(n, fs, d),
                      shared_expert_gate=(n, d, 1))
    return shapes


def forward(x: jax.Array, layer: dict, *, config: ModelConfig, contract: NumericalContract,
            mask: jax.Array) -> jax.Array:
    raise NotImplementedError("MoE layers: the batch-invariant expert kernels are not merged yet")
