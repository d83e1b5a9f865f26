"""Logical sharding annotations of the params and the rules that map them to mesh axes.

Each param dimension has a logical name ("vocab", "embed", "heads", "mlp", ...); a rule set maps
logical names to mesh axes ("data", "fsdp", "tensor") or None (replicated). The default rules give
FSDP over the model dimension and tensor parallelism over heads, MLP and vocabulary. On one
device every mesh axis has size 1 and the specs change nothing.
"""

from __future__ import annotations

from typing import Mapping

from jax.sharding import PartitionSpec

from jrl.models.config import ModelConfig
from jrl.models.lora import adapter_of, is_adapter
from jrl.models.transformer import param_shapes

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# logical axis -> mesh axis (or axes, or None = replicated).
DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),   # activations: rows split over data and fsdp replicas
    "layers": None,              # the scanned layer axis stays whole on every device
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",           # Hq * head_dim, split at head boundaries when divisible
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,                # norm scales are tiny: replicated
    # Gated DeltaNet: [q, k, v] share one projection and conv, so their columns stay whole.
    "linear_qkv": None,
    "linear_value": None,
    "linear_heads": None,
    "conv_kernel": None,
    # Mixture of experts: replicated here; EXPERT_PARALLEL_RULES shard them over "expert".
    "experts": None,
    "expert_mlp": None,
    "router_experts": None,      # the router's E columns: whole wherever tokens are routed
    # LoRA: an adapter's rank dimension is small; its other dim follows the weight it adapts.
    "lora_rank": None,
}

# Expert parallelism (jrl.parallel.expert): the experts split over the mesh axis "expert",
# activations' rows over ("data", "expert"), everything else replicated.
EXPERT_AXIS = "expert"
EXPERT_PARALLEL_RULES: dict[str, MeshAxes] = {
    **{name: None for name in DEFAULT_RULES}, "batch": ("data", EXPERT_AXIS),
    "experts": EXPERT_AXIS}

_LAYER_AXES = {
    "attn_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "bq": ("layers", "heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "wo": ("layers", "heads", "embed"),
    "mlp_norm": ("layers", "norm"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    # Gated DeltaNet
    "w_qkv": ("layers", "embed", "linear_qkv"),
    "conv": ("layers", "conv_kernel", "linear_qkv"),
    "w_z": ("layers", "embed", "linear_value"),
    "w_a": ("layers", "embed", "linear_heads"),
    "w_b": ("layers", "embed", "linear_heads"),
    "dt_bias": ("layers", "linear_heads"),
    "A_log": ("layers", "linear_heads"),
    "delta_norm": ("layers", "head_dim"),
    "w_out": ("layers", "linear_value", "embed"),
    # Mixture of experts
    "router": ("layers", "embed", "router_experts"),
    "experts_gate": ("layers", "experts", "embed", "expert_mlp"),
    "experts_up": ("layers", "experts", "embed", "expert_mlp"),
    "experts_down": ("layers", "experts", "expert_mlp", "embed"),
    "shared_gate": ("layers", "embed", "mlp"),
    "shared_up": ("layers", "embed", "mlp"),
    "shared_down": ("layers", "mlp", "embed"),
    "shared_expert_gate": ("layers", "embed", None),
}
_GLOBAL_AXES = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}


def _layer_axes(name: str) -> tuple:
    """A layer param's logical axes; a LoRA adapter takes its weight's with "lora_rank" for the
    rank dim (A [.., K, r], B [.., r, N])."""
    if is_adapter(name):
        axes = _LAYER_AXES[adapter_of(name)]
        if name.endswith("_lora_a"):
            return axes[:-1] + ("lora_rank",)
        return axes[:-2] + ("lora_rank", axes[-1])
    return _LAYER_AXES[name]


def param_logical_axes(config: ModelConfig) -> dict:
    """Logical axis names of every param: same structure as the params pytree, one tuple of
    names per param (one name per dimension)."""
    shapes = param_shapes(config)
    return {key: ({name: _layer_axes(name) for name in value} if isinstance(value, dict)
                  else _GLOBAL_AXES[key]) for key, value in shapes.items()}


def _mesh_axes_tuple(value: MeshAxes) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def param_partition_specs(config: ModelConfig, rules: Mapping[str, MeshAxes] | None = None, *,
                          mesh_axis_sizes: Mapping[str, int] | None = None) -> dict:
    """PartitionSpec of every param (same structure as params) under `rules`.

    rules: logical axis -> mesh axis name, tuple of names, or None (default DEFAULT_RULES).
    mesh_axis_sizes: if given (e.g. dict(mesh.shape)), every sharded dimension is checked to be
      divisible by the product of its mesh axes, with an error naming the param and dimension.
    """
    rules = DEFAULT_RULES if rules is None else rules
    logical = param_logical_axes(config)
    shapes = param_shapes(config)

    def spec_for(name: str, names: tuple[str, ...], shape: tuple[int, ...]) -> PartitionSpec:
        used: list[str] = []
        entries = []
        for dim, (logical_name, size) in enumerate(zip(names, shape)):
            if logical_name is None:       # a size-1 dimension: nothing to shard
                entries.append(None)
                continue
            if logical_name not in rules:
                raise ValueError(f"sharding rules have no entry for logical axis "
                                 f"{logical_name!r} (param {name}, dim {dim}); rules cover "
                                 f"{sorted(rules)}")
            mesh_axes = _mesh_axes_tuple(rules[logical_name])
            for axis in mesh_axes:
                if axis in used:
                    raise ValueError(f"param {name}: mesh axis {axis!r} is used by two dimensions "
                                     f"({names}); each mesh axis may shard one dimension")
                used.append(axis)
            if mesh_axis_sizes is not None and mesh_axes:
                missing = [a for a in mesh_axes if a not in mesh_axis_sizes]
                if missing:
                    raise ValueError(f"param {name}: mesh axes {missing} are not in the mesh "
                                     f"{dict(mesh_axis_sizes)}")
                ways = 1
                for axis in mesh_axes:
                    ways *= mesh_axis_sizes[axis]
                if size % ways:
                    raise ValueError(f"param {name} dim {dim} ({logical_name}, size {size}) is not "
                                     f"divisible by mesh axes {mesh_axes} ({ways} ways)")
            entries.append(None if not mesh_axes else
                           mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        return PartitionSpec(*entries)

    return {key: ({name: spec_for(f"{key}/{name}", axes[name], shapes[key][name])
                   for name in axes} if isinstance(axes, dict)
                  else spec_for(key, axes, shapes[key])) for key, axes in logical.items()}
