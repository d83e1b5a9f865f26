"""Tests for jrl.losses.shaping: DAPO's overlong penalty on the seed's numbers."""

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import overlong_penalty


def test_seed_example(maybe_jit, dtype):
    # max_len 20480, buffer 4096: free up to 16384, linear to -1 at 20480, -1 beyond.
    # 18432 is the middle of the buffer: -(18432 - 16384) / 4096 = -0.5.
    # 17408: -(1024 / 4096) = -0.25. bf16 holds these integers exactly (multiples of 64).
    lengths = jnp.array([1000, 16384, 17408, 18432, 20480, 30000], dtype)
    fn = maybe_jit(lambda l: overlong_penalty(l, max_len=20480, buffer_len=4096))
    out = fn(lengths)
    assert out.dtype == jnp.float32
    expected = [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    np.testing.assert_allclose(out, expected, atol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


def test_factor_and_int_lengths():
    out = overlong_penalty(jnp.array([18432, 99999]), max_len=20480, buffer_len=4096, factor=2.0)
    np.testing.assert_allclose(out, [-1.0, -2.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="buffer_len=5000 .*max_len=4096"):
        overlong_penalty(jnp.array([1]), max_len=4096, buffer_len=5000)
    with pytest.raises(ValueError, match="buffer_len=0"):
        overlong_penalty(jnp.array([1]), max_len=4096, buffer_len=0)
