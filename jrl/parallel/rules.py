"""Sharding rules applied to the whole train state and the batch, and the pjit-style jit of a
train step with those shardings.

Params follow jrl.models.sharding (logical axes -> mesh axes); optimizer state mirrors the params
wherever a subtree has the params' structure and shapes (optax adam's mu and nu); every other leaf
(step counts, scalars, the raw uint32 PRNG key) is replicated.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.models.config import ModelConfig
from jrl.models.sharding import MeshAxes, param_partition_specs

BATCH_AXES = ("data", "fsdp")


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def param_shardings(model_config: ModelConfig, mesh: Mesh,
                    rules: Mapping[str, MeshAxes] | None = None) -> dict:
    """NamedSharding of every param (same structure as the params pytree). Raises ValueError
    naming the param and dimension when a sharded dimension does not divide over the mesh."""
    specs = param_partition_specs(model_config, rules, mesh_axis_sizes=dict(mesh.shape))
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


def mirror_params(tree: Any, params_shape: Any, params_sharding: Any, other: Any) -> Any:
    """Shardings for `tree` (e.g. an optax state): every subtree with the params' structure and
    shapes gets `params_sharding`; every other leaf gets `other`."""
    treedef = jax.tree.structure(params_shape)
    shapes = [_shape(x) for x in jax.tree.leaves(params_shape)]

    def is_params_like(node) -> bool:
        if jax.tree.structure(node) != treedef:
            return False
        return [_shape(x) for x in jax.tree.leaves(node)] == shapes

    return jax.tree.map(lambda node: params_sharding if is_params_like(node) else other,
                        tree, is_leaf=is_params_like)


def train_state_shardings(state_shape: Any, model_config: ModelConfig, mesh: Mesh,
                          rules: Mapping[str, MeshAxes] | None = None) -> Any:
    """A pytree of NamedSharding with the structure of `state_shape` (a jrl.train.TrainState of
    arrays or jax.ShapeDtypeStruct, e.g. from jax.eval_shape).

    params: by `rules` (default jrl.models.sharding.DEFAULT_RULES); opt_state: params-shaped
    subtrees (adam mu / nu) as the params, the rest replicated; step, version, rng: replicated.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    params = param_shardings(model_config, mesh, rules)
    if jax.tree.structure(state_shape.params) != jax.tree.structure(params):
        raise ValueError("train_state_shardings: state.params does not have the structure of "
                         f"param_shapes({model_config}); got "
                         f"{jax.tree.structure(state_shape.params)}")
    return type(state_shape)(
        params=params,
        opt_state=mirror_params(state_shape.opt_state, state_shape.params, params, replicated),
        step=replicated, version=replicated, rng=replicated)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows (the leading dim of every batch field) split over ("data", "fsdp") combined, row
    block i on the device at flat index i of those two axes (data-major)."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_train_step(train_step: Callable, state_shardings: Any, batch_sharding: NamedSharding,
                     *, donate: bool = True) -> Callable:
    """jax.jit(train_step) with in_shardings=(state, batch), out_shardings=(state, replicated
    metrics) and the input state donated (its buffers are reused for the new state).

    For bitwise-reproducible multi-device training pass a step built by
    jrl.train.make_parallel_train_step. A plain jrl.train.make_train_step also runs, with the
    kernels partitioned by XLA (GSPMD): numerically close but NOT bitwise equal to one device
    (XLA splits the gradient and norm reductions across devices in its own order), and native
    Mosaic kernels refuse automatic partitioning.
    """
    leaves = jax.tree.leaves(state_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    if not leaves or not all(isinstance(s, NamedSharding) for s in leaves):
        raise TypeError("shard_train_step: state_shardings must be a pytree of NamedSharding "
                        "(see train_state_shardings)")
    metrics_sharding = NamedSharding(leaves[0].mesh, PartitionSpec())
    return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, metrics_sharding),
                   donate_argnums=(0,) if donate else ())


# -------------------------------------------------------------------------------------------------
# Placing host data on a (possibly multi-process) mesh and reading it back.

def host_to_global(tree: Any, shardings: Any) -> Any:
    """Places a pytree whose every process holds the WHOLE value (numpy or local arrays, e.g.
    params initialised from the same seed on every host) as global arrays with `shardings` (a
    matching pytree, or one sharding for all). Each process copies only its own shards; works
    with one process or many."""
    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: put(x, shardings), tree)
    return jax.tree.map(put, tree, shardings)


def local_rows_to_global(tree: Any, sharding: NamedSharding) -> Any:
    """Per-process rows -> global arrays: each process passes ITS rows (e.g. from
    PromptStream.shard(process_index, process_count)); the global batch is the processes' rows
    in process order. The row count per process must split evenly over its devices."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        tree)


def global_to_host(tree: Any) -> Any:
    """Whole values as numpy on every process (an all-gather across processes when needed)."""
    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(fetch, tree)
