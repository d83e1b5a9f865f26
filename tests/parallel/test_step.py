"""The row-parallel train step: bitwise equal across meshes (FSDP, data parallel, both, tensor)
on 4 forced CPU devices, and equal to one device (see the module docstring of
jrl.train.parallel_step for what that equality needs).

The runs compared here are computed once, in a child process compiled with XLA's default CPU
fusion emitters: with the older emitters the rest of the suite compiles with (tests/conftest.py),
the meshes' gradients differ in the last bit, so the equality is a property of the default
emitters (checked with them, as production compiles)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jrl import parallel
from jrl.train import make_train_step, parallel_step
from launch.parallel_selftest import tiny_setup
from tests.conftest import _LEGACY_EMITTERS_FLAG, default_emitters_env

from .helpers import MESH_RUNS, MICRO_BATCHES, bitwise_differences, devices

FSDP4 = MESH_RUNS["fsdp4"]
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: {path: array}} of tests.parallel.helpers.all_runs, from a child process with
    XLA's default CPU fusion emitters."""
    out = tmp_path_factory.mktemp("parallel_runs") / "runs.pkl"
    env = default_emitters_env()
    assert _LEGACY_EMITTERS_FLAG not in env["XLA_FLAGS"].split()
    # Below pytest-timeout's 15 minutes, so a hung child's stderr is still reported.
    result = subprocess.run([sys.executable, "-m", "tests.parallel.helpers", str(out)],
                            cwd=_ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def fsdp4(runs):
    return runs["fsdp4"]


def test_fsdp_state_is_sharded_and_training_moves_params(fsdp4):
    config, _, _, _, host_state, _ = tiny_setup()
    mesh = parallel.make_mesh(parallel.MeshConfig(*FSDP4), devices())
    shardings = parallel.train_state_shardings(host_state, config, mesh)
    assert shardings.params["layers"]["wq"].spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor")
    assert shardings.opt_state[1][0].mu["layers"]["wq"].spec == shardings.params["layers"][
        "wq"].spec
    wq = fsdp4[".params['layers']['wq']"]
    assert wq.shape == host_state.params["layers"]["wq"].shape
    assert not np.array_equal(wq, host_state.params["layers"]["wq"])
    assert int(fsdp4[".step"]) == 2 and int(fsdp4[".version"]) == 2
    assert np.isfinite(fsdp4["metrics['train/loss']"])


@pytest.mark.parametrize("mesh_name", ["data4", "data2_fsdp2", "fsdp2_two_micro_per_device",
                                       "fsdp2_tensor2"])
def test_meshes_give_the_same_bits(runs, mesh_name):
    """Params, optimizer state and metrics after 2 steps do not depend on the mesh."""
    assert bitwise_differences(runs[mesh_name], runs["fsdp4"]) == []


def test_num_micro_batches_must_cover_the_row_shards():
    config, contract, optimizer, loss_fn, _, _ = tiny_setup()
    mesh = parallel.make_mesh(parallel.MeshConfig(2, 2, 1), devices())
    with pytest.raises(ValueError, match=r"num_micro_batches=6 must be a positive multiple of "
                                         r"data \* fsdp = 4"):
        parallel_step.make_parallel_train_step(config, contract, loss_fn, optimizer, mesh,
                                          num_micro_batches=6)


# ------------------------------------------------------------------------------------------------
# Against one device.

def test_parallel_step_on_one_device_equals_four_bitwise(runs):
    """The row-parallel step on ONE device gives the bits of fsdp=4 (docs/design.md, invariant 4). Needs
    jrl.kernels.reference's softmax normalisations written as e * (1 / denom): XLA rewrites a
    division that way in some programs and not in others."""
    assert bitwise_differences(runs["fsdp4"], runs["row_parallel_one_device"]) == []


def test_bitwise_jrl_train_step_on_one_device_equals_fsdp4(runs):
    """jrl.train's single-device step equals the row-parallel FSDP=4 step bit for bit (it keeps
    each micro-batch gradient whole with an optimization barrier, and the reference backward
    uses explicit reciprocals)."""
    assert bitwise_differences(runs["jrl_single"], runs["fsdp4"]) == []


def test_gspmd_partitioned_jrl_train_step_is_close_but_not_bitwise(runs):
    """shard_train_step on a plain jrl.train step: XLA partitions the interpret-mode kernels
    itself. It runs and agrees to float32 rounding, but splits the reductions in its own order."""
    gspmd, fsdp4 = runs["gspmd_fsdp4"], runs["fsdp4"]
    params = [k for k in fsdp4 if k.startswith(".params")]
    for name in params:
        # Adam normalises the gradient, so a last-bit gradient difference moves a param by up to
        # ~lr (1e-3) times a small factor: compare to 2e-5.
        np.testing.assert_allclose(gspmd[name], fsdp4[name], rtol=0, atol=2e-5, err_msg=name)
    assert bitwise_differences(gspmd, fsdp4), "GSPMD became bitwise: update the docs"


# ------------------------------------------------------------------------------------------------
# The order-keeping reduction itself.

@pytest.mark.parametrize("mesh_sizes,spec", [
    ((2, 2, 1), PartitionSpec(None, "fsdp")),
    ((2, 2, 1), PartitionSpec()),
    ((2, 2, 1), PartitionSpec("data", "fsdp")),
    ((1, 2, 2), PartitionSpec(("fsdp", "tensor"))),
    ((1, 2, 2), PartitionSpec("tensor", "fsdp")),
    ((4, 1, 1), PartitionSpec("fsdp")),
])
def test_ordered_shard_sum_adds_in_device_order(mesh_sizes, spec):
    """Each device ends with its shard of (((acc + g_0) + g_1) + ...) over the row-shard
    devices in flat (data, fsdp) order; tensor peers hold identical partials and sum nothing."""
    mesh = parallel.make_mesh(parallel.MeshConfig(*mesh_sizes), devices())
    shape = (8, 12)
    rng = np.random.default_rng(0)
    num_rows = mesh.shape["data"] * mesh.shape["fsdp"]
    # Partial gradients with wildly different magnitudes, so the order shows in the bits.
    partials = (rng.normal(size=(num_rows,) + shape)
                * 10.0 ** rng.integers(-6, 6, (num_rows,) + shape)).astype(np.float32)
    acc0 = rng.normal(size=shape).astype(np.float32)
    expected = acc0.copy()
    for g in partials:
        expected = expected + g
    # [data, fsdp, tensor, ...]: device (d, f, t) holds partial d * F + f (same for every t).
    per_device = np.broadcast_to(
        partials.reshape(mesh.shape["data"], mesh.shape["fsdp"], 1, *shape),
        (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"], *shape))
    sharding = NamedSharding(mesh, spec)

    def local(acc, grad):
        return parallel_step.ordered_shard_sum(acc, grad[0, 0, 0], spec, dict(mesh.shape))

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, PartitionSpec(
        "data", "fsdp", "tensor")), out_specs=spec, check_vma=False))(
        jax.device_put(acc0, sharding), jnp.asarray(per_device))
    assert out.sharding.is_equivalent_to(sharding, 2)
    assert np.asarray(out).tobytes() == expected.tobytes()
    naive = partials.sum(axis=0, dtype=np.float32) + acc0
    assert naive.tobytes() != expected.tobytes()  # the order matters for these values


@pytest.mark.parametrize("with_reference", [False, True])
def test_same_state_and_metric_structure_as_jrl_train_step(with_reference):
    """The row-parallel step mirrors jrl.train.make_train_step's micro-batch loss: same output
    structure, shapes and metric names (traced only, nothing compiled)."""
    config, contract, optimizer, loss_fn, host_state, host_batch = tiny_setup()
    mesh = parallel.make_mesh(parallel.MeshConfig(1, 4, 1), devices())
    ours = parallel_step.make_parallel_train_step(config, contract, loss_fn, optimizer, mesh,
                                             num_micro_batches=MICRO_BATCHES,
                                             with_reference=with_reference)
    theirs = make_train_step(config, contract, loss_fn, optimizer,
                             num_micro_batches=MICRO_BATCHES, with_reference=with_reference)
    got = jax.eval_shape(ours, host_state, host_batch)
    want = jax.eval_shape(theirs, host_state, host_batch)
    assert sorted(got[1]) == sorted(want[1])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(jax.tree.leaves(jax.tree.map(
        lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), got, want)))
