"""jrl.kernels.attention: reference agreement, batch invariance, stage consistency (decode and
prefill against a KV cache give the train forward's bits), gradients."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, reference

from .helpers import ATOL, DTYPES, assert_bitwise_equal, normal

# jrl.kernels.attention is the dispatching function; the module holds the kernel.
attention_kernel = importlib.import_module("jrl.kernels.attention")

B, T, HQ, HKV, D = 3, 75, 6, 2, 16        # GQA group 3; T spans 5 KV blocks of 16
LENGTHS = np.array([75, 40, 61])          # right padding
CAPACITY = 96                             # KV cache capacity L > T
SMALL = dict(attn_block_q=16, attn_block_k=16)


@functools.lru_cache(maxsize=None)
def _jitted(contract):
    return jax.jit(lambda q, k, v, q_pos, kv_pos, kv_valid: kernels.attention(
        q, k, v, q_positions=q_pos, kv_positions=kv_pos, kv_valid=kv_valid, contract=contract))


def _sequence(rng, dtype):
    q, k, v = (normal(rng, (B, T, h, D), dtype) for h in (HQ, HKV, HKV))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = jnp.arange(T)[None, :] < LENGTHS[:, None]
    return q, k, v, positions, valid


def _cache(rng, k, v, dtype):
    """A cache holding k/v in [0, T) and stale nonzero data in [T, CAPACITY)."""
    stale_k, stale_v = (normal(rng, (B, CAPACITY, HKV, D), dtype) for _ in range(2))
    kv_positions = jnp.broadcast_to(jnp.arange(CAPACITY, dtype=jnp.int32), (B, CAPACITY))
    return stale_k.at[:, :T].set(k), stale_v.at[:, :T].set(v), kv_positions


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_reference(dtype):
    rng = np.random.default_rng(0)
    q, k, v, positions, valid = _sequence(rng, dtype)
    # Row 2's first keys are invalid too (left padding): its first queries see nothing -> 0.
    valid = valid.at[2, :5].set(False)
    got = _jitted(NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL))(
        q, k, v, positions, positions, valid)
    want = reference.attention(q, k, v, q_positions=positions, kv_positions=positions,
                               kv_valid=valid)
    assert got.shape == q.shape and got.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=ATOL[dtype] * 10, rtol=1e-2 if dtype == "bfloat16" else 1e-5)
    assert not np.asarray(got[2, :5], np.float32).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_and_prefill_equal_train_forward_bitwise(dtype):
    """Decode (one query at position p against the cache) and prefill (all queries against the
    cache) give row p of the full-sequence causal forward, for every p of every sequence of a
    right-padded batch, with GQA, stale cache entries and T spanning several KV blocks."""
    rng = np.random.default_rng(1)
    contract = NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL)
    f = _jitted(contract)
    q, k, v, positions, valid = _sequence(rng, dtype)
    train = np.asarray(f(q, k, v, positions, positions, valid))
    cache_k, cache_v, kv_positions = _cache(rng, k, v, dtype)
    slots = jnp.arange(CAPACITY)[None, :]

    prefill = np.asarray(f(q, cache_k, cache_v, positions, kv_positions,
                           slots < LENGTHS[:, None]))
    for b in range(B):
        assert_bitwise_equal(prefill[b, :LENGTHS[b]], train[b, :LENGTHS[b]], f"prefill row {b}")

    # One batched decode call per step, like a sampler whose slots sit at different positions:
    # slot b decodes position (p + 17 b) mod length_b, so every position of every row is hit.
    decode = jax.jit(lambda q_p, p_b: f(q_p, cache_k, cache_v, p_b[:, None], kv_positions,
                                        (slots <= p_b[:, None]) & (slots < LENGTHS[:, None])))
    rows = np.arange(B)
    for p in range(T):
        p_b = (p + 17 * rows) % LENGTHS
        step = np.asarray(decode(q[rows, p_b][:, None], jnp.asarray(p_b, jnp.int32)))
        for b in range(B):
            assert_bitwise_equal(step[b, 0], train[b, p_b[b]], f"decode row {b} position {p_b[b]}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_batch_invariant_and_deterministic_bitwise(dtype):
    rng = np.random.default_rng(2)
    q, k, v, positions, valid = _sequence(rng, dtype)
    for contract in (NumericalContract(platform="cpu", compute_dtype=dtype),
                     NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL)):
        f = _jitted(contract)
        full = f(q, k, v, positions, positions, valid)
        assert_bitwise_equal(f(q, k, v, positions, positions, valid), full, "repeat")
        for start, stop in [(0, 1), (1, 2), (2, 3), (1, 3)]:
            part = f(q[start:stop], k[start:stop], v[start:stop], positions[start:stop],
                     positions[start:stop], valid[start:stop])
            assert_bitwise_equal(part, full[start:stop], f"batch {start}:{stop}")


def test_attention_sequence_blocks_batch_invariant_bitwise():
    """The emulated (CPU) grid takes contract.emulated_attn_batch sequences per step, their dots
    batched. 7 sequences in blocks of 3 run as steps over sequences 0-2, 3-5 and 4-6 (the last
    block shifted left to end at 7, sequences 4-5 computed twice), and a batch of 2 is padded to
    3: every sequence's rows equal its rows computed alone, bit for bit, and the blocks see
    different KV lengths (the union of their visible blocks). Sequence 3 is left-padded (keys
    0-19 invalid): its first query block sees no key (output 0) and its second starts at KV
    block 1 while its block-mates start at 0 (the union's first of the firsts)."""
    rng = np.random.default_rng(5)
    lengths = np.array([75, 9, 40, 61, 17, 75, 33])
    count = len(lengths)
    q, k, v = (normal(rng, (count, T, h, D), "float32") for h in (HQ, HKV, HKV))
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (count, T))
    valid = (jnp.arange(T)[None, :] < lengths[:, None]).at[3, :20].set(False)
    contract = NumericalContract(platform="cpu", emulated_attn_batch=3, **SMALL)
    f = _jitted(contract)
    full = f(q, k, v, positions, positions, valid)
    for start, stop in [(0, 1), (4, 5), (6, 7), (3, 5), (0, 3), (2, 7)]:
        part = f(q[start:stop], k[start:stop], v[start:stop], positions[start:stop],
                 positions[start:stop], valid[start:stop])
        assert_bitwise_equal(part, full[start:stop], f"batch {start}:{stop}")
    want = reference.attention(q, k, v, q_positions=positions, kv_positions=positions,
                               kv_valid=valid)
    np.testing.assert_allclose(np.asarray(full), np.asarray(want), atol=ATOL["float32"] * 10,
                               rtol=1e-5)
    assert not np.asarray(full[3, :20]).any()


def test_attention_grads_match_reference():
    rng = np.random.default_rng(3)
    q, k, v, positions, valid = _sequence(rng, "float32")
    q, k, v, positions, valid = (a[:, :20] for a in (q, k, v, positions, valid))
    dout = normal(rng, q.shape)
    contract = NumericalContract(platform="cpu", **SMALL)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * dout)

    ours = jax.jit(jax.grad(loss(lambda q, k, v: kernels.attention(
        q, k, v, q_positions=positions, kv_positions=positions, kv_valid=valid,
        contract=contract)), (0, 1, 2)))
    ref = jax.grad(loss(lambda q, k, v: reference.attention(
        q, k, v, q_positions=positions, kv_positions=positions, kv_valid=valid)), (0, 1, 2))
    for got, want in zip(ours(q, k, v), ref(q, k, v)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["pallas", "xla"])
@pytest.mark.parametrize("batch", [3, 8])
def test_attention_over_cache_stack_equals_its_layer_bitwise(dtype, backend, batch):
    """attention(..., layer=l) over [L, B, C, Hkv, D] stacks gives attention over stack[l]'s
    bits, for a decode query and a 5-token append, whether the kernel reads the stack in place
    (8 sequences in float32: one emulated block, whole KV blocks) or slices the layer out (3
    sequences, fewer than a block, or bfloat16)."""
    rng = np.random.default_rng(7)
    layers = 3
    contract = NumericalContract(platform="cpu", compute_dtype=dtype, backend=backend, **SMALL)
    stack_k, stack_v = (normal(rng, (layers, batch, CAPACITY, HKV, D), dtype) for _ in range(2))
    kv_pos = jnp.broadcast_to(jnp.arange(CAPACITY, dtype=jnp.int32), (batch, CAPACITY))
    if backend == "pallas":
        assert attention_kernel.reads_stack_in_place(contract, stack_k.shape[1:], dtype) == (
            batch == 8 and dtype == "float32")
    for width in (1, 5):
        q = normal(rng, (batch, width, HQ, D), dtype)
        q_pos = jnp.asarray(rng.integers(20, CAPACITY - width, (batch, 1)), jnp.int32) + \
            jnp.arange(width, dtype=jnp.int32)
        valid = kv_pos < (q_pos[:, -1:] + 1)
        stacked = jax.jit(lambda q, k, v, layer: kernels.attention(
            q, k, v, q_positions=q_pos, kv_positions=kv_pos, kv_valid=valid, contract=contract,
            layer=layer))
        sliced = _jitted(contract)
        for layer in range(layers):
            assert_bitwise_equal(stacked(q, stack_k, stack_v, jnp.int32(layer)),
                                 sliced(q, stack_k[layer], stack_v[layer], q_pos, kv_pos, valid))
