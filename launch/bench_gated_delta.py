"""Benchmark: the gated delta rule's canonical chunked order (Pallas) vs plain XLA, one run.

    python -m launch.bench_gated_delta            # Qwen3.5-0.8B core dims, train 16 x 512 tokens
    python -m launch.bench_gated_delta --quick    # train 4 x 256 tokens

The Gated DeltaNet core only (random q, k, v, g, beta; the projections and the conv are not
timed), at Qwen3.5-0.8B's linear-attention dims: 16 key and 16 value heads of 128, float32:
  train   forward + backward (jax.grad w.r.t. q, k, v, g, beta) of B x T tokens: Pallas (the
          kernel's forward, the reference's backward) vs the plain-XLA chunked implementation.
  decode  one token on S slots (S = 8, 32), mid-chunk: the Pallas canonical window (C rows from
          the chunk-start state) vs the same window in plain XLA vs an engine's recurrent
          single-token update (the per-token rule on the running state, not stage-consistent):
          what the canonical order costs a sampler.
Each function is jitted, compiled and warmed up, then timed as the median of --repeats runs. On a
CPU the Pallas kernel runs in interpret mode: the ratios are the CPU price of the canonical order
and of batch invariance, not kernel quality. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels
from jrl.kernels import NumericalContract, gated_delta

HEADS, HEAD_DIM = 16, 128        # Qwen3.5-0.8B: linear_num_{key,value}_heads, head dims


def _time(fn: Callable, args, repeats: int) -> float:
    """Median seconds of fn(*args) after a compile and a warm-up call."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inputs(rng, batch: int, length: int):
    """Raw q, k, v [B, T, 16, 128], g < 0 and beta in (0, 1) [B, T, 16], float32."""
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v = (normal(batch, length, HEADS, HEAD_DIM) for _ in range(3))
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (batch, length, HEADS)), jnp.float32)
    beta = jax.nn.sigmoid(normal(batch, length, HEADS))
    return q, k, v, g, beta


def _train(contract: NumericalContract):
    """jitted grad of sum(out * w) w.r.t. q, k, v, g, beta (full valid rows, zero state)."""
    def loss(q, k, v, g, beta, weight):
        batch = q.shape[0]
        out, _ = kernels.gated_delta_rule(
            q, k, v, g, beta, valid=jnp.ones(q.shape[:2], bool),
            initial_state=jnp.zeros((batch, HEADS, HEAD_DIM, HEAD_DIM), jnp.float32),
            state_chunk=jnp.zeros((batch,), jnp.int32), contract=contract)
        return jnp.sum(out * weight)
    return jax.jit(jax.grad(loss, argnums=range(5)))


def _window_decode(contract: NumericalContract, offset: int):
    """jitted canonical decode step: a C-row window whose rows <= offset are valid."""
    def step(q, k, v, g, beta, state):
        valid = jnp.broadcast_to(jnp.arange(q.shape[1]) <= offset, q.shape[:2])
        return tuple(kernels.gated_delta_rule(
            q, k, v, g, beta, valid=valid, initial_state=state,
            state_chunk=jnp.zeros((q.shape[0],), jnp.int32), contract=contract))
    return jax.jit(step)


def _recurrent_decode():
    """jitted engine-style update (what vLLM / FLA's fused recurrent kernel compute): one token
    through the per-token rule on the running state, plain XLA, no stage consistency.
    q, k [S, 1, H, dk], v [S, 1, H, dv], g, beta [S, 1, H], state [S, H, dk, dv]."""
    def unit(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + gated_delta.L2NORM_EPS)

    def step(q, k, v, g, beta, state):
        q, k = unit(q[:, 0]) * HEAD_DIM ** -0.5, unit(k[:, 0])
        state = state * jnp.exp(g[:, 0])[..., None, None]
        delta = (v[:, 0] - jnp.einsum("shkv,shk->shv", state, k)) * beta[:, 0, :, None]
        state = state + k[..., :, None] * delta[..., None, :]
        return jnp.einsum("shkv,shk->shv", state, q), state
    return jax.jit(step)


def run(batch: int, length: int, slots: tuple[int, ...], repeats: int) -> None:
    pallas = NumericalContract.for_platform("cpu")
    xla = pallas.replace(backend="xla")
    chunk = pallas.delta_chunk
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"gated delta core, {HEADS} heads of {HEAD_DIM}, float32, delta_chunk {chunk}; "
          f"median of {repeats}")
    header = (f"{'problem':<34} {'pallas ms':>10} {'xla ms':>9} {'recur ms':>9} "
              f"{'pallas/xla':>10} {'pallas/recur':>12}")
    print(header)
    print("-" * len(header))

    train_args = (*_inputs(rng, batch, length),
                  jnp.asarray(rng.standard_normal((batch, length, HEADS, HEAD_DIM)), jnp.float32))
    t_pallas = _time(_train(pallas), train_args, repeats)
    t_xla = _time(_train(xla), train_args, repeats)
    train_ratio = t_pallas / t_xla
    print(f"{f'train fwd+bwd {batch}x{length}':<34} {t_pallas * 1e3:>10.1f} {t_xla * 1e3:>9.1f} "
          f"{'-':>9} {train_ratio:>10.2f} {'-':>12}", flush=True)

    offset = chunk // 2          # mid-chunk: rows 0..offset of the window are valid
    decode = {}
    for n in slots:
        window = _inputs(rng, n, chunk)
        state = jnp.asarray(rng.standard_normal((n, HEADS, HEAD_DIM, HEAD_DIM)) * 0.1,
                            jnp.float32)
        token = tuple(x[:, offset:offset + 1] for x in window)
        t_pallas = _time(_window_decode(pallas, offset), (*window, state), repeats)
        t_xla = _time(_window_decode(xla, offset), (*window, state), repeats)
        t_recur = _time(_recurrent_decode(), (*token, state), repeats)
        decode[n] = (t_pallas / t_xla, t_pallas / t_recur, t_xla / t_recur)
        print(f"{f'decode 1 token, {n} slots':<34} {t_pallas * 1e3:>10.2f} {t_xla * 1e3:>9.2f} "
              f"{t_recur * 1e3:>9.2f} {decode[n][0]:>10.2f} {decode[n][1]:>12.2f}", flush=True)
    n = max(slots)
    print(f"summary: train fwd+bwd pallas/xla {train_ratio:.2f}; decode {n} slots: canonical "
          f"window pallas/xla {decode[n][0]:.2f}, pallas/recurrent {decode[n][1]:.2f}, "
          f"xla window/recurrent {decode[n][2]:.2f} (the canonical order's price)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="train 4 x 256 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    batch, length = (4, 256) if args.quick else (16, 512)
    run(batch, length, (8, 32), args.repeats)


if __name__ == "__main__":
    main()
