"""Shared helpers for the kernel tests: bit-level comparison and random inputs."""

import jax.numpy as jnp
import numpy as np

DTYPES = ("float32", "bfloat16")
# Tolerances against the float32 reference: float32 accumulation order differs; bfloat16
# outputs are rounded to 8 mantissa bits.
ATOL = {"float32": 2e-5, "bfloat16": 5e-2}


def bits(x) -> np.ndarray:
    """The raw bits of an array (float32 view), so -0.0 != 0.0 and NaN payloads count."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32))
    return x.view(np.uint32)


def assert_bitwise_equal(actual, expected, what=""):
    a, e = bits(actual), bits(expected)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    differ = a != e
    if differ.any():
        av = a.view(np.float32)
        ev = e.view(np.float32)
        raise AssertionError(f"{what}: {int(differ.sum())}/{differ.size} elements differ in bits, "
                             f"max |diff| {np.abs(av - ev).max()}")


def normal(rng, shape, dtype="float32", scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(dtype)
