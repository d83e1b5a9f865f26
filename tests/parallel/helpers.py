"""Shared by the jrl.parallel tests: running steps on a mesh and comparing bits."""

from __future__ import annotations

import jax
import numpy as np

from jrl import parallel
from jrl.train import parallel_step
from launch.parallel_selftest import flatten, tiny_setup

NUM_DEVICES = 4
STEPS = 2
MICRO_BATCHES = 4


def devices(n: int = NUM_DEVICES):
    if len(jax.devices()) < n:
        raise RuntimeError(f"needs {n} devices, JAX has {len(jax.devices())}; tests/conftest.py "
                           "forces 8 host devices (run pytest from the repo root)")
    return jax.devices()[:n]


def run_parallel(mesh_sizes: tuple[int, int, int], *, steps: int = STEPS,
                 micro_batches: int = MICRO_BATCHES) -> dict[str, np.ndarray]:
    """Flat {path: array} of the final state and the last metrics after `steps` row-parallel
    steps of the tiny setup on a (data, fsdp, tensor) mesh of the first devices."""
    config, contract, optimizer, loss_fn, host_state, host_batch = tiny_setup()
    count = int(np.prod(mesh_sizes))
    mesh = parallel.make_mesh(parallel.MeshConfig(*mesh_sizes), devices(count))
    shardings = parallel.train_state_shardings(host_state, config, mesh)
    step = parallel.shard_train_step(
        parallel_step.make_parallel_train_step(config, contract, loss_fn, optimizer, mesh,
                                          num_micro_batches=micro_batches),
        shardings, parallel.batch_sharding(mesh))
    state = parallel.host_to_global(host_state, shardings)
    batch = parallel.host_to_global(host_batch, parallel.batch_sharding(mesh))
    for _ in range(steps):
        state, metrics = step(state, batch)
    return as_flat(state, metrics)


def run_train_step(train_step, *, steps: int = STEPS, device=None,
                   state_shardings=None, batch_sharding=None) -> dict[str, np.ndarray]:
    """The same run with any train_step (one device by default)."""
    _, _, _, _, host_state, host_batch = tiny_setup()
    device = device or devices(1)[0]
    if state_shardings is None:
        state, batch = jax.device_put((host_state, host_batch), device)
    else:
        state = parallel.host_to_global(host_state, state_shardings)
        batch = parallel.host_to_global(host_batch, batch_sharding)
    for _ in range(steps):
        state, metrics = train_step(state, batch)
    return as_flat(state, metrics)


def as_flat(state, metrics) -> dict[str, np.ndarray]:
    out = flatten(parallel.global_to_host(state))
    out.update({f"metrics{k}": v for k, v in flatten(parallel.global_to_host(metrics)).items()})
    return out


def bitwise_differences(a: dict, b: dict) -> list[str]:
    """Names whose bytes differ (or that only one side has)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]
