"""train_state_shardings covers every leaf; batch sharding; host <-> global placement."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jrl import parallel
from jrl.models import ModelConfig, init_params, param_partition_specs
from launch.parallel_selftest import tiny_setup
from jrl.train import OptimizerConfig, TrainState, create_train_state, make_optimizer

from .helpers import devices


def _state_shape(config, optimizer):
    return jax.eval_shape(lambda: create_train_state(
        init_params(config, jax.random.PRNGKey(0)), optimizer, jax.random.PRNGKey(1)))


@pytest.mark.parametrize("model", ["llama_tied", "qwen2_untied_bias", "qwen3_qk_norm"])
def test_train_state_shardings_cover_every_leaf(model):
    config = {"llama_tied": ModelConfig(),
              "qwen2_untied_bias": ModelConfig(model_type="qwen2", attention_bias=True,
                                               tie_word_embeddings=False),
              "qwen3_qk_norm": ModelConfig(model_type="qwen3", qk_norm=True)}[model]
    optimizer = make_optimizer(OptimizerConfig())
    shape = _state_shape(config, optimizer)
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2, tensor=2), devices(8))
    shardings = parallel.train_state_shardings(shape, config, mesh)
    assert isinstance(shardings, TrainState)
    leaves = jax.tree.leaves(shape)
    sharding_leaves = jax.tree.leaves(shardings)
    assert len(leaves) == len(sharding_leaves)
    assert jax.tree.structure(shardings) == jax.tree.structure(shape)
    assert all(isinstance(s, NamedSharding) and s.mesh is mesh for s in sharding_leaves)
    # Every leaf can be placed with its sharding (divisibility holds).
    for leaf, sharding in zip(leaves, sharding_leaves):
        sharding.shard_shape(leaf.shape)

    specs = param_partition_specs(config, mesh_axis_sizes=dict(mesh.shape))
    got_specs = jax.tree.map(lambda s: s.spec, shardings.params)
    assert got_specs == specs
    # adam mu / nu mirror the params; counts, step, version, rng are replicated.
    adam = shardings.opt_state[1][0]
    assert jax.tree.map(lambda s: s.spec, adam.mu) == specs
    assert jax.tree.map(lambda s: s.spec, adam.nu) == specs
    for replicated in (adam.count, shardings.step, shardings.version, shardings.rng):
        assert replicated.spec == PartitionSpec()


def test_mirror_params_replicates_params_shaped_trees_with_other_shapes():
    """A params-structured tree with other shapes (adafactor-like factored stats) is not
    mistaken for params."""
    params = {"a": np.zeros((4, 8)), "b": np.zeros((8,))}
    factored = {"a": np.zeros((4,)), "b": np.zeros((8,))}
    out = parallel.mirror_params({"mu": params, "v_row": factored, "count": np.zeros(())},
                                 params, "P", "R")
    assert out == {"mu": "P", "v_row": {"a": "R", "b": "R"}, "count": "R"}


def test_divisibility_error_names_the_param():
    config = ModelConfig(num_heads=4, num_kv_heads=1, head_dim=4)
    shape = _state_shape(config, optax.sgd(1e-3))
    mesh = parallel.make_mesh(parallel.MeshConfig(data=1, fsdp=1, tensor=8), devices(8))
    with pytest.raises(ValueError, match=r"layers/wk dim 2 \(kv_heads, size 4\) is not "
                                         r"divisible by mesh axes \('tensor',\) \(8 ways\)"):
        parallel.train_state_shardings(shape, config, mesh)


def test_batch_sharding_and_host_round_trip():
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, fsdp=2), devices(4))
    sharding = parallel.batch_sharding(mesh)
    assert sharding.spec == PartitionSpec(("data", "fsdp"))
    _, _, _, _, host_state, host_batch = tiny_setup()
    batch = parallel.host_to_global(host_batch, sharding)
    # Row block i on the device at flat index i of (data, fsdp).
    shard = next(s for s in batch.tokens.addressable_shards
                 if s.device == mesh.devices[1, 0, 0])
    np.testing.assert_array_equal(shard.data, host_batch.tokens[4:6])
    back = parallel.global_to_host(batch)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(host_batch)):
        assert a.tobytes() == b.tobytes()
    local = parallel.local_rows_to_global(host_batch, sharding)  # one process: all rows local
    assert local.tokens.sharding == sharding
    np.testing.assert_array_equal(np.asarray(local.tokens), host_batch.tokens)


def test_shard_train_step_requires_named_shardings():
    with pytest.raises(TypeError, match="pytree of NamedSharding"):
        parallel.shard_train_step(lambda s, b: (s, {}), {"a": None},
                                  parallel.batch_sharding(parallel.make_mesh(
                                      parallel.MeshConfig(), devices(1))))
