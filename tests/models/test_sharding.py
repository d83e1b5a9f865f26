"""Logical axes and partition specs of the params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.models import ModelConfig, init_params, param_logical_axes, param_partition_specs
from jrl.models import param_shapes
from jrl.models.sharding import DEFAULT_RULES

CONFIGS = {
    "llama": ModelConfig(model_type="llama", tie_word_embeddings=True),
    "qwen2": ModelConfig(model_type="qwen2", attention_bias=True, tie_word_embeddings=False),
    "qwen3": ModelConfig(model_type="qwen3", qk_norm=True, head_dim=32),
}


def _is_tuple(x):
    return isinstance(x, tuple)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logical_axes_cover_every_param_dimension(name):
    config = CONFIGS[name]
    axes, shapes = param_logical_axes(config), param_shapes(config)
    assert (jax.tree_util.tree_structure(axes, is_leaf=_is_tuple)
            == jax.tree_util.tree_structure(shapes, is_leaf=_is_tuple))
    for names, shape in zip(jax.tree_util.tree_leaves(axes, is_leaf=_is_tuple),
                            jax.tree_util.tree_leaves(shapes, is_leaf=_is_tuple)):
        assert len(names) == len(shape)


def test_logical_axes_values():
    axes = param_logical_axes(CONFIGS["qwen2"])
    assert axes["embed"] == ("vocab", "embed")
    assert axes["lm_head"] == ("embed", "vocab")
    assert axes["layers"]["wq"] == ("layers", "embed", "heads")
    assert axes["layers"]["wk"] == ("layers", "embed", "kv_heads")
    assert axes["layers"]["wo"] == ("layers", "heads", "embed")
    assert axes["layers"]["w_down"] == ("layers", "mlp", "embed")
    assert axes["layers"]["bq"] == ("layers", "heads")


def test_default_rules_give_fsdp_plus_tensor_parallel():
    specs = param_partition_specs(CONFIGS["qwen2"])
    assert specs["embed"] == PartitionSpec("tensor", "fsdp")
    assert specs["layers"]["wq"] == PartitionSpec(None, "fsdp", "tensor")
    assert specs["layers"]["w_down"] == PartitionSpec(None, "tensor", "fsdp")
    assert specs["layers"]["attn_norm"] == PartitionSpec(None, None)
    assert specs["final_norm"] == PartitionSpec(None)
    custom = dict(DEFAULT_RULES, embed=None, mlp=("fsdp", "tensor"))
    assert param_partition_specs(CONFIGS["llama"], custom)["layers"]["w_up"] == PartitionSpec(
        None, None, ("fsdp", "tensor"))


def test_rule_errors_name_the_problem():
    with pytest.raises(ValueError, match="no entry for logical axis 'mlp'"):
        param_partition_specs(CONFIGS["llama"], {k: v for k, v in DEFAULT_RULES.items()
                                                 if k != "mlp"})
    with pytest.raises(ValueError, match="mesh axis 'tensor' is used by two dimensions"):
        param_partition_specs(CONFIGS["llama"], dict(DEFAULT_RULES, embed="tensor"))
    # 1 kv head * 16 = 16 columns cannot be split 32 ways (vocab 256, q 64, mlp 128 can).
    with pytest.raises(ValueError, match=r"layers/wk dim 2 \(kv_heads, size 16\) is not "
                                         r"divisible by mesh axes \('tensor',\) \(32 ways\)"):
        param_partition_specs(CONFIGS["llama"].replace(num_kv_heads=1),
                              mesh_axis_sizes={"data": 1, "fsdp": 1, "tensor": 32})


def test_specs_place_params_on_a_one_device_mesh():
    config = CONFIGS["qwen3"]
    params = init_params(config, jax.random.PRNGKey(0))
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    specs = param_partition_specs(config, mesh_axis_sizes=dict(mesh.shape))
    placed = jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params, specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec))
    for a, b in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(params)):
        assert jnp.array_equal(a, b)
