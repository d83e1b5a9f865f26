"""jrl.kernels.rowwise: pointwise math in fixed row tiles, bitwise independent of the row count
and of the surrounding program, differentiable through the plain function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import NumericalContract
from jrl.kernels.rowwise import rowwise, sigmoid_gate, silu_gate, swiglu

from .helpers import assert_bitwise_equal, normal

PALLAS = NumericalContract(backend="pallas", norm_block_rows=8)


def test_values_match_the_formulas():
    # silu(1) * 2 = 2 / (1 + e^-1) = 1.4621172; 3 * sigmoid(0) = 1.5; 2 * silu(-1) =
    # -2 / (1 + e) = -0.5378828.
    one = jnp.ones((3, 4))
    np.testing.assert_allclose(swiglu(PALLAS, jnp.float32, one, 2 * one), 1.4621172, rtol=1e-6)
    np.testing.assert_allclose(sigmoid_gate(PALLAS, jnp.float32, 3 * one, 0 * one), 1.5)
    np.testing.assert_allclose(silu_gate(PALLAS, jnp.float32, 2 * one, -one), -0.5378828,
                               rtol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_row_bits_do_not_depend_on_the_row_count_or_the_program(dtype):
    """One row computed alone, among 37 others (several tiles, a partial last one), and inside a
    bigger jitted program with other work around it: the same bits."""
    rng = np.random.default_rng(0)
    gate, up = normal(rng, (37, 24), dtype, 3.0), normal(rng, (37, 24), dtype, 3.0)
    many = swiglu(PALLAS, jnp.dtype(dtype), gate, up)
    for row in (0, 8, 36):
        alone = jax.jit(lambda g, u: swiglu(PALLAS, jnp.dtype(dtype), g, u))(gate[row:row + 1],
                                                                               up[row:row + 1])
        assert_bitwise_equal(alone[0], many[row], f"row {row}")

    @jax.jit
    def surrounded(g, u):   # other work in the same program, fused around the call
        y = swiglu(PALLAS, jnp.dtype(dtype), g, u)
        return y, jnp.tanh(y.astype(jnp.float32)) * 3.0 + jnp.sum(jnp.exp(g.astype(jnp.float32)))

    assert_bitwise_equal(surrounded(gate, up)[0][5], many[5], "inside a program")


def test_gradients_are_those_of_the_formula():
    rng = np.random.default_rng(1)
    x, g = normal(rng, (6, 5)), normal(rng, (6, 5))

    def plain(x, g):
        return jnp.sum((x * jax.nn.sigmoid(g)) ** 2)

    def tiled(x, g):
        return jnp.sum(sigmoid_gate(PALLAS, jnp.float32, x, g) ** 2)

    for a, b in zip(jax.grad(tiled, argnums=(0, 1))(x, g), jax.grad(plain, argnums=(0, 1))(x, g)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_shared_inputs_and_several_outputs():
    """rowwise with a shared weight and two outputs of different widths."""
    rng = np.random.default_rng(2)
    x, w = normal(rng, (11, 3, 4)), normal(rng, (3, 4))
    total, first = rowwise(lambda x, w: (jnp.sum(x * w, axis=1), x[:, 0, :1]), rows=(x,),
                           shared=(w,), out=[((4,), jnp.float32), ((1,), jnp.float32)],
                           contract=PALLAS)
    np.testing.assert_allclose(total, np.sum(np.asarray(x) * np.asarray(w), axis=1), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(first, np.asarray(x)[:, 0, :1])
