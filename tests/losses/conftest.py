"""Shared fixtures for the jrl.losses tests: eager/jit, f32/bf16, tolerances, masked garbage."""

import jax
import jax.numpy as jnp
import pytest

# Value written into masked positions to prove they never leak into values or gradients. It is
# finite (no NaN/inf) but would dominate any sum and overflow any exp if it were used.
GARBAGE = 1e4


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Either jax.jit or the identity, so each test runs both ways."""
    return jax.jit if request.param else (lambda fn: fn)


@pytest.fixture(params=[jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture
def tol(dtype):
    """Comparison tolerance for hand-computed values; bf16 inputs keep ~3 significant digits."""
    if dtype == jnp.bfloat16:
        return dict(rtol=2e-2, atol=2e-2)
    return dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def garbage():
    """garbage(x, mask): x with GARBAGE at the masked (mask == 0) positions, same dtype."""

    def fill(x, mask):
        return jnp.where(jnp.asarray(mask) != 0, x, jnp.asarray(GARBAGE, x.dtype))

    return fill
