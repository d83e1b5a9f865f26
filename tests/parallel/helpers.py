"""Shared by the jrl.parallel tests: running steps on a mesh and comparing bits.

`python -m tests.parallel.helpers OUT` writes the runs that tests/parallel/test_step.py compares
(MESH_RUNS and the single-device steps) to OUT as a pickled {run: {path: array}}: that file runs
it in a child process compiled with XLA's default CPU fusion emitters (tests/conftest.py)."""

from __future__ import annotations

import os
import pickle
import sys

import jax
import numpy as np

from jrl import parallel
from jrl.train import parallel_step
from launch.parallel_selftest import flatten, tiny_setup

NUM_DEVICES = 4
STEPS = 2
MICRO_BATCHES = 4


def run_split_worker(config, tmp_path, workdir: str = "split") -> None:
    """Runs `config` in the split-process mode (launch.pipeline_worker, two processes of one
    device) with workdir tmp_path/workdir and results in tmp_path/out; asserts it exits 0."""
    import io
    import json

    from jrl.cli import local_cluster
    from jrl.pipeline.config.tools import to_dict
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(to_dict(config)))
    out = io.StringIO()
    status = local_cluster.run(
        [sys.executable, "-m", "launch.pipeline_worker", "--config", str(config_path),
         "--workdir", str(tmp_path / workdir), "--out", str(tmp_path / "out")],
        processes=2, devices_per_process=1, timeout_s=400, out=out)
    assert status == 0, out.getvalue()[-5000:]


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


# (data, fsdp, tensor) meshes of the row-parallel step, by the name the tests use.
MESH_RUNS = {"fsdp4": (1, 4, 1), "data4": (4, 1, 1), "data2_fsdp2": (2, 2, 1),
             "fsdp2_two_micro_per_device": (1, 2, 1), "fsdp2_tensor2": (1, 2, 2),
             "row_parallel_one_device": (1, 1, 1)}


def all_runs() -> dict[str, dict[str, np.ndarray]]:
    """MESH_RUNS, jrl.train's single-device step ("jrl_single") and that step partitioned by
    GSPMD on the fsdp=4 mesh ("gspmd_fsdp4")."""
    from jrl.train import make_train_step

    runs = {name: run_parallel(sizes) for name, sizes in MESH_RUNS.items()}
    config, contract, optimizer, loss_fn, host_state, _ = tiny_setup()
    plain = make_train_step(config, contract, loss_fn, optimizer, num_micro_batches=MICRO_BATCHES)
    runs["jrl_single"] = run_train_step(jax.jit(plain))
    mesh = parallel.make_mesh(parallel.MeshConfig(*MESH_RUNS["fsdp4"]), devices())
    shardings = parallel.train_state_shardings(host_state, config, mesh)
    runs["gspmd_fsdp4"] = run_train_step(
        parallel.shard_train_step(plain, shardings, parallel.batch_sharding(mesh)),
        state_shardings=shardings, batch_sharding=parallel.batch_sharding(mesh))
    return runs


if __name__ == "__main__":
    # The runs must compile with XLA's default CPU fusion emitters (test_step.py).
    assert "--xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "").split()
    with open(sys.argv[1], "wb") as f:
        pickle.dump(all_runs(), f)
