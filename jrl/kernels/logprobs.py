"""Batch-invariant token logprob and entropy: row tiles, the vocabulary in fixed chunks.

Each row tile walks the vocabulary in vocab_chunk pieces from left to right with an online
logsumexp (running max m, rescaled sum l), so a row's bits depend on neither the number of rows
nor the vocabulary split of any other call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import _grid, reference
from jrl.kernels.contract import NumericalContract
from jrl.kernels.reference import MASKED


class TokenLogprobs(NamedTuple):
    """logp [...] float32; entropy [...] float32, or None when not requested."""

    logp: jax.Array
    entropy: jax.Array | None


def _logprob_kernel(ids, *refs, temperature: float, vocab: int, chunk: int, num_chunks: int,
                    last_chunk: int, has_floor: bool, with_entropy: bool):
    """logits [R, Vb], targets [R, 1] int32, (floor [R, 1] f32) -> logp [R, 1] (, entropy).

    The vocabulary is walked as num_chunks chunks of `chunk`, then one of `last_chunk` (0: none).
    Natively Vb is V padded to a chunk multiple (columns >= vocab are masked); in the emulated
    grid Vb = V and the last chunk is narrower, which spares a padded copy of the logits.
    """
    del ids
    inverse_temperature = reference.inverse_temperature(temperature)
    logits_ref, target_ref, *refs = refs
    floor_ref = refs.pop(0) if has_floor else None
    logp_ref = refs.pop(0)
    rows = logits_ref.shape[0]
    target = target_ref[...]
    floor = floor_ref[...] if has_floor else None

    def update(carry, start, width):
        m, l, s, target_z = carry
        z = logits_ref[:, pl.ds(start, width)].astype(jnp.float32) * inverse_temperature
        col = start + jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1)
        kept = col < vocab
        if has_floor:
            kept = kept & (z >= floor)
        zk = jnp.where(kept, z, MASKED)
        m_new = jnp.maximum(m, jnp.max(zk, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        e = jnp.where(kept, jnp.exp(zk - m_new), 0.0)
        l = alpha * l + jnp.sum(e, axis=1, keepdims=True)
        if with_entropy:
            s = alpha * s + jnp.sum(e * jnp.where(kept, z, 0.0), axis=1, keepdims=True)
        # Exactly one column matches: a sum of zeros and z[target] is z[target], exactly.
        target_z = target_z + jnp.sum(jnp.where(col == target, z, 0.0), axis=1, keepdims=True)
        return m_new, l, s, target_z

    zeros = jnp.zeros((rows, 1), jnp.float32)
    carry = (jnp.full((rows, 1), MASKED, jnp.float32), zeros, zeros, zeros)
    if num_chunks:
        carry = jax.lax.fori_loop(
            0, num_chunks, lambda c, carry: update(carry, pl.multiple_of(c * chunk, chunk), chunk),
            carry)
    if last_chunk:
        carry = update(carry, num_chunks * chunk, last_chunk)
    m, l, s, target_z = carry
    lse = m + jnp.log(l)
    logp_ref[...] = target_z - lse
    if with_entropy:
        refs[0][...] = lse - s / l


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _token_logprobs_2d(logits, targets, floor, temperature, with_entropy, contract):
    rows, vocab = logits.shape
    num_out = 2 if with_entropy else 1
    if rows == 0:
        return (jnp.zeros((0,), jnp.float32),) * num_out
    block, chunk = contract.logprob_block_rows, contract.vocab_chunk
    emulated = _grid.execution(contract).emulate_grid
    if emulated:
        num_chunks, last_chunk = divmod(vocab, chunk)
    else:
        logits = _grid.pad_axis(logits, 1, chunk)
        num_chunks, last_chunk = logits.shape[1] // chunk, 0
    kernel = functools.partial(_logprob_kernel, temperature=temperature, vocab=vocab, chunk=chunk,
                               num_chunks=num_chunks, last_chunk=last_chunk,
                               has_floor=floor is not None, with_entropy=with_entropy)
    per_row = [targets.astype(jnp.int32).reshape(rows, 1)]
    if floor is not None:
        per_row.append(floor.astype(jnp.float32).reshape(rows, 1))

    def run(logits, per_row, num_tiles):
        """Rows [0, num_tiles * block) of logits / per_row -> outputs [num_tiles * block]."""
        row_tile = _grid.Tile((block, 1), lambda i: (i, 0))
        call = _grid.launch(
            kernel, grid=(num_tiles,),
            in_tiles=[_grid.Tile((block, logits.shape[1]), lambda i: (i, 0))]
            + [row_tile] * len(per_row),
            out_tiles=[row_tile] * num_out,
            out_shape=[jax.ShapeDtypeStruct((num_tiles * block, 1), jnp.float32)] * num_out,
            contract=contract, name="jrl_token_logprobs")
        return [o[:, 0] for o in call(logits, *per_row)]

    full = rows // block * block
    if not emulated or full == 0:
        outs = run(_grid.pad_axis(logits, 0, block),
                   [_grid.pad_axis(a, 0, block) for a in per_row], -(-rows // block))
    elif full == rows:
        outs = run(logits, per_row, rows // block)
    else:
        # The full row tiles read the logits in place; only the last partial tile is padded
        # (a padded copy of all logits per call was a large part of the train step's time).
        # Both launches compile the same tile, so a row's bits do not depend on which one ran it.
        head = run(logits, [_grid.pad_axis(a, 0, block) for a in per_row], full // block)
        tail = run(_grid.pad_axis(logits[full:], 0, block),
                   [_grid.pad_axis(a[full:], 0, block) for a in per_row], 1)
        outs = [jnp.concatenate([h[:full], t]) for h, t in zip(head, tail)]
    return tuple(o[:rows] for o in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _logprobs(logits, targets, floor, temperature, with_entropy, contract):
    return _logprobs_fwd(logits, targets, floor, temperature, with_entropy, contract)[0]


def _logprobs_fwd(logits, targets, floor, temperature, with_entropy, contract):
    batch = targets.shape
    outs = _token_logprobs_2d(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
        None if floor is None else floor.reshape(-1), temperature, with_entropy, contract)
    return tuple(o.reshape(batch) for o in outs), (logits, targets, floor)


def _logprobs_bwd(temperature, with_entropy, contract, residuals, cotangents):
    del contract
    logits, targets, floor = residuals

    def ref(x):
        logp, entropy = reference.token_logprobs(x, targets, temperature=temperature,
                                                 logit_floor=floor)
        return (logp, entropy) if with_entropy else (logp,)

    _, vjp = jax.vjp(ref, logits)
    (dlogits,) = vjp(tuple(cotangents))
    dfloor = None if floor is None else jnp.zeros_like(floor)
    return dlogits, None, dfloor


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd)


def token_logprobs(logits: jax.Array, targets: jax.Array, *, contract: NumericalContract,
                   temperature: float = 1.0, logit_floor: jax.Array | None = None,
                   return_entropy: bool = True) -> TokenLogprobs:
    """Per-token logprob and entropy of the tempered, optionally truncated distribution.

    logits [..., V] (any float dtype), targets [...] int in [0, V), logit_floor [...] or None.
    z = logits * f32(1 / temperature) in float32; with logit_floor only entries with z >= floor
    are kept (the trainer's replay of the sampler's top-k / top-p). Returns TokenLogprobs(logp, entropy),
    float32 [...]: logp = z[target] - logsumexp(z[kept]), entropy = -sum_kept p log p (None when
    return_entropy=False). Gradients flow to logits only (custom_vjp through the reference).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"token_logprobs: logits {logits.shape} must be targets {targets.shape} "
                         "+ [V]")
    if logit_floor is not None and logit_floor.shape != targets.shape:
        raise ValueError(f"token_logprobs: logit_floor {logit_floor.shape} must match targets "
                         f"{targets.shape}")
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature={temperature} must be > 0")
    outs = _logprobs(logits, targets, logit_floor, temperature, bool(return_entropy), contract)
    return TokenLogprobs(outs[0], outs[1] if return_entropy else None)
