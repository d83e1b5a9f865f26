"""Data parallel: rows sharded over 4 devices with shard_rows give the unsharded bits."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jrl import kernels
from jrl.kernels import NumericalContract

from .helpers import assert_bitwise_equal, normal

NUM_DEVICES = 4


def check_sharded_equals_unsharded():
    """Runs every kernel sharded (inside one jit) and unsharded; asserts equal bits."""
    mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16"):
        c = NumericalContract(platform="cpu", compute_dtype=dtype, matmul_block_m=16,
                              attn_block_q=16, attn_block_k=16, norm_block_rows=8,
                              logprob_block_rows=8, vocab_chunk=128)
        x, w, scale = normal(rng, (12, 5, 64)), normal(rng, (64, 48)), normal(rng, (64,))
        logits = normal(rng, (12, 5, 300))
        targets = jnp.asarray(rng.integers(0, 300, (12, 5)), jnp.int32)
        q = normal(rng, (8, 20, 4, 16))
        k, v = normal(rng, (8, 20, 2, 16)), normal(rng, (8, 20, 2, 16))
        pos = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (8, 20))
        valid = pos < jnp.asarray([20, 3, 11, 20, 7, 19, 1, 15])[:, None]

        def run(x, w, scale, logits, targets, q, k, v, pos, valid):
            return (kernels.matmul(x, w, contract=c),
                    kernels.rms_norm(x, scale, eps=1e-6, contract=c),
                    kernels.token_logprobs(logits, targets, contract=c),
                    kernels.attention(q, k, v, q_positions=pos, kv_positions=pos,
                                      kv_valid=valid, contract=c))

        def run_sharded(x, w, scale, logits, targets, q, k, v, pos, valid):
            mm = kernels.shard_rows(lambda x, w: kernels.matmul(x, w, contract=c), mesh, "data",
                                    replicated=(1,))
            norm = kernels.shard_rows(lambda x, s: kernels.rms_norm(x, s, eps=1e-6, contract=c),
                                      mesh, "data", replicated=(1,))
            lp = kernels.shard_rows(lambda l, t: kernels.token_logprobs(l, t, contract=c),
                                    mesh, "data")
            attn = kernels.shard_rows(lambda q, k, v, p, m: kernels.attention(
                q, k, v, q_positions=p, kv_positions=p, kv_valid=m, contract=c), mesh, "data")
            return mm(x, w), norm(x, scale), lp(logits, targets), attn(q, k, v, pos, valid)

        args = (x, w, scale, logits, targets, q, k, v, pos, valid)
        expected = jax.jit(run)(*args)
        sharded_args = [jax.device_put(a, rows) if i not in (1, 2) else a
                        for i, a in enumerate(args)]
        got = jax.jit(run_sharded)(*sharded_args)
        assert got[0].sharding.spec == PartitionSpec("data")
        for name, g, e in zip(("matmul", "rms_norm", "logp", "entropy", "attention"),
                              jax.tree.leaves(got), jax.tree.leaves(expected)):
            assert_bitwise_equal(g, e, f"{name} {dtype}")


def test_shard_rows_equals_unsharded_bitwise():
    if len(jax.devices()) >= NUM_DEVICES:
        check_sharded_equals_unsharded()
        return
    # JAX started with fewer devices (tests/conftest.py did not run first): use a subprocess.
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={NUM_DEVICES}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, 'tests'); "
            "from kernels.test_sharding import check_sharded_equals_unsharded as c; c()")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
