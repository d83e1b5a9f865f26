"""Shared helpers for jrl.losses: dtype policy, masks, masked reductions, config validation.

Dtype policy: every public function casts its floating inputs to float32 before doing arithmetic
and returns float32. Inputs may be bf16 (the model's logprobs usually are); sums and means over
thousands of tokens in bf16 keep only ~3 significant digits, and exp() of a bf16 log-ratio turns a
0.004 difference into a 0.4% ratio error, which is larger than GSPO's whole clip range.
"""

from __future__ import annotations

from typing import Any, Sequence

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def f32(x: Any) -> Array:
    """Casts to float32 (see the module docstring for why)."""
    return jnp.asarray(x, jnp.float32)


def as_mask(mask: Any) -> Array:
    """Boolean validity mask: nonzero entries are valid tokens."""
    return jnp.asarray(mask) != 0


def masked_log_ratio(numerator: Array, denominator: Array, mask: Array | None) -> Array:
    """`numerator - stop_gradient(denominator)` in f32, exactly 0 at masked positions.

    Zeroing before any exp() matters for gradients, not only values: a masked position holding
    garbage (e.g. 1e4) would give exp(1e4) = inf, and `where(mask, inf, 0)` still back-propagates
    0 * inf = NaN. Sanitising the log-ratio first keeps masked positions out of values and grads.
    """
    log_ratio = f32(numerator) - jax.lax.stop_gradient(f32(denominator))
    if mask is None:
        return log_ratio
    return jnp.where(as_mask(mask), log_ratio, 0.0)


def clip_log_ratio(log_ratio: Array, log_ratio_clip: float | None) -> Array:
    """Clamps a log-ratio to [-c, c] before exp (None: no clamp)."""
    if log_ratio_clip is None:
        return log_ratio
    return jnp.clip(log_ratio, -log_ratio_clip, log_ratio_clip)


def masked_sum(values: Array, mask: Array, axis: int | None = None) -> Array:
    return jnp.sum(jnp.where(as_mask(mask), f32(values), 0.0), axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Mean over valid entries; 0.0 (not NaN) when there are none."""
    count = jnp.sum(as_mask(mask), axis=axis)
    return masked_sum(values, mask, axis) / jnp.maximum(count, 1)


def masked_min(values: Array, mask: Array) -> Array:
    """Min over valid entries; 0.0 when there are none (inf would poison metric averages)."""
    mask = as_mask(mask)
    low = jnp.min(jnp.where(mask, f32(values), jnp.inf))
    return jnp.where(jnp.any(mask), low, 0.0)


def masked_max(values: Array, mask: Array) -> Array:
    """Max over valid entries; 0.0 when there are none."""
    mask = as_mask(mask)
    high = jnp.max(jnp.where(mask, f32(values), -jnp.inf))
    return jnp.where(jnp.any(mask), high, 0.0)


def masked_fraction(flags: Array, mask: Array) -> Array:
    """Fraction of valid entries where `flags` is true; 0.0 when there are none."""
    return masked_mean(jnp.asarray(flags, jnp.float32), mask)


def broadcast_per_sequence(values: Array, shape: Sequence[int]) -> Array:
    """[B] -> [B, T] by repeating along T; [B, T] passes through (shape-checked)."""
    values = f32(values)
    shape = tuple(shape)
    if values.ndim == len(shape) - 1:
        chex.assert_shape(values, shape[:-1])
        values = values[..., None]
    else:
        chex.assert_shape(values, shape)
    return jnp.broadcast_to(values, shape)


def check_choice(where: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
    """Raises ValueError naming the field, the value and the allowed values."""
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{where}: {field}={value!r} is not allowed; choose one of {choices}.")


def check_positive(where: str, field: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = value is not None and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{where}: {field}={value!r} is not allowed; it must be a number {bound}.")


def as_groups(values: Array, group_size: int, where: str) -> Array:
    """[B] -> [B // group_size, group_size]; groups are consecutive runs of `group_size` rows."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(
            f"{where}: group_size={group_size!r} is not allowed; it must be an int >= 1."
        )
    if values.ndim != 1:
        raise ValueError(f"{where}: rewards must have shape [B]; got shape {values.shape}.")
    batch = values.shape[0]
    if batch % group_size != 0:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"{where}: group_size={group_size} does not divide the batch size B={batch}; "
            f"allowed values are the divisors of B: {divisors}."
        )
    return values.reshape(batch // group_size, group_size)
