"""The dense SwiGLU MLP: down(silu(x W_gate) * (x W_up))."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.models.lora import project_all, project_rows


def param_shapes(config: ModelConfig, n: int, width: int | None = None) -> dict:
    """Shapes of a stack of n MLPs (weights [in, out]); width defaults to intermediate_size."""
    d, f = config.hidden_size, width or config.intermediate_size
    return {"w_gate": (n, d, f), "w_up": (n, d, f), "w_down": (n, f, d)}


def swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in float32 with one rounding to dtype, so the bits do not depend on how
    XLA fuses it."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


def forward(x: jax.Array, layer: dict, *, contract: NumericalContract, prefix: str = "w_",
            config: ModelConfig | None = None,
            input_norm: tuple[jax.Array, float] | None = None,
            tensor_axis: str | None = None) -> jax.Array:
    """x [..., D] (normed, or normed by the gate/up kernel when input_norm = (scale, eps) is given)
    -> [..., D] in contract.compute. prefix names the weights (f"{prefix}gate", f"{prefix}up",
    f"{prefix}down"), so a shared expert reuses this. config: the model's (its LoRA scale, when
    the layer carries adapters). tensor_axis: tensor parallelism inside shard_map (the layer
    holds this device's columns of gate/up and rows of down; jrl.parallel.tensor)."""
    gate, up = project_all(x, layer, (prefix + "gate", prefix + "up"), config=config,
                           contract=contract, norm=input_norm)
    hidden = swiglu(gate, up, contract.compute)
    return project_rows(hidden, layer, prefix + "down", config=config, contract=contract,
                        tensor_axis=tensor_axis)
