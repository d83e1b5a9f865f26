"""Benchmark: Pallas kernels vs the plain-XLA backend, measured in one run (no assertions).

    python -m launch.bench_kernels                          # CPU, tiny-model shapes (~1 min)
    python -m launch.bench_kernels --size smollm            # CPU, SmolLM2-135M shapes
    python -m launch.bench_kernels --platform gpu --size large
        # on a GPU: matmul TFLOP/s vs XLA's dot at 4096^3 bf16, attention throughput vs XLA

For each kernel and each problem (train forward, sampler decode) it jits both backends with the
same contract tiles, warms up, and prints the median of several timed runs and the ratio
pallas / xla (> 1: the Pallas kernel is slower). On a CPU the Pallas kernels run in interpret
mode, so the ratio is the price of batch invariance there, not a kernel-quality measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels
from jrl.kernels import NumericalContract


@dataclasses.dataclass(frozen=True)
class Shapes:
    rows: int            # B * T of the train forward
    batch: int           # sequences in the train forward
    seq: int             # train sequence length
    dim: int             # model width
    hidden: int          # MLP width
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    slots: int           # decode batch
    cache: int           # KV cache capacity in decode
    cache_used: int      # valid keys per slot in decode


SIZES = {
    # The CPU test model: B*T = 1024 rows, D 256, V 2048.
    "small": Shapes(rows=1024, batch=8, seq=128, dim=256, hidden=1024, heads=4, kv_heads=2,
                    head_dim=64, vocab=2048, slots=32, cache=512, cache_used=300),
    # SmolLM2-135M: D 576, 9 query / 3 kv heads of 64, MLP 1536, V 49152.
    "smollm": Shapes(rows=1024, batch=2, seq=512, dim=576, hidden=1536, heads=9, kv_heads=3,
                     head_dim=64, vocab=49152, slots=32, cache=1024, cache_used=600),
    # Accelerator scale.
    "large": Shapes(rows=4096, batch=8, seq=2048, dim=4096, hidden=4096, heads=32, kv_heads=8,
                    head_dim=128, vocab=131072, slots=64, cache=8192, cache_used=6000),
}


def _time(fn: Callable, args, repeats: int) -> float:
    """Median wall time in seconds of fn(*args) after a compile and a warm-up call."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _problems(shapes: Shapes, dtype: str, rng) -> list[tuple[str, str, Callable, tuple, float]]:
    """(kernel, problem, fn(contract) -> jitted fn, args, flops) for every benchmark row."""
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    s = shapes
    x_train, x_decode = normal(s.rows, s.dim), normal(s.slots, s.dim)
    w_up, w_head, norm_scale = normal(s.dim, s.hidden), normal(s.dim, s.vocab), normal(s.dim)
    logits_train = jnp.asarray(rng.standard_normal((s.rows, s.vocab)) * 3, jnp.float32)
    logits_decode = logits_train[:s.slots]
    targets = jnp.asarray(rng.integers(0, s.vocab, s.rows), jnp.int32)
    floor = jnp.sort(logits_decode, axis=-1)[:, -50]

    q = normal(s.batch, s.seq, s.heads, s.head_dim)
    k = normal(s.batch, s.seq, s.kv_heads, s.head_dim)
    v = normal(s.batch, s.seq, s.kv_heads, s.head_dim)
    pos = jnp.broadcast_to(jnp.arange(s.seq, dtype=jnp.int32), (s.batch, s.seq))
    valid = jnp.ones((s.batch, s.seq), bool)
    q_dec = normal(s.slots, 1, s.heads, s.head_dim)
    k_cache = normal(s.slots, s.cache, s.kv_heads, s.head_dim)
    v_cache = normal(s.slots, s.cache, s.kv_heads, s.head_dim)
    cache_pos = jnp.broadcast_to(jnp.arange(s.cache, dtype=jnp.int32), (s.slots, s.cache))
    cache_valid = cache_pos < s.cache_used
    q_pos_dec = jnp.full((s.slots, 1), s.cache_used - 1, jnp.int32)

    def mm(c):
        return jax.jit(lambda x, w: kernels.matmul(x, w, contract=c))

    def mm_grad(c):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(
            kernels.matmul(x, w, contract=c).astype(jnp.float32)), (0, 1)))

    def attn(c):
        return jax.jit(lambda q, k, v, qp, kp, m: kernels.attention(
            q, k, v, q_positions=qp, kv_positions=kp, kv_valid=m, contract=c))

    def norm(c):
        return jax.jit(lambda x, g: kernels.rms_norm(x, g, eps=1e-6, contract=c))

    def logprobs(c):
        return jax.jit(lambda l, t: tuple(kernels.token_logprobs(l, t, contract=c)))

    def logprobs_floor(c):
        return jax.jit(lambda l, t, f: tuple(kernels.token_logprobs(
            l, t, contract=c, temperature=0.7, logit_floor=f)))

    train_attn_flops = 4 * s.batch * s.heads * s.seq * s.seq * s.head_dim / 2    # causal
    decode_attn_flops = 4 * s.slots * s.heads * s.cache_used * s.head_dim
    return [
        ("matmul", f"train {s.rows}x{s.dim}x{s.hidden}", mm, (x_train, w_up),
         2 * s.rows * s.dim * s.hidden),
        ("matmul", f"train lm-head {s.rows}x{s.dim}x{s.vocab}", mm, (x_train, w_head),
         2 * s.rows * s.dim * s.vocab),
        ("matmul", f"train fwd+bwd {s.rows}x{s.dim}x{s.hidden}", mm_grad, (x_train, w_up),
         6 * s.rows * s.dim * s.hidden),
        ("matmul", f"decode {s.slots}x{s.dim}x{s.hidden}", mm, (x_decode, w_up),
         2 * s.slots * s.dim * s.hidden),
        ("attention", f"train B{s.batch} T{s.seq} H{s.heads}/{s.kv_heads} D{s.head_dim}", attn,
         (q, k, v, pos, pos, valid), train_attn_flops),
        ("attention", f"decode B{s.slots} L{s.cache} used {s.cache_used}", attn,
         (q_dec, k_cache, v_cache, q_pos_dec, cache_pos, cache_valid), decode_attn_flops),
        ("rms_norm", f"train {s.rows}x{s.dim}", norm, (x_train, norm_scale), 0),
        ("rms_norm", f"decode {s.slots}x{s.dim}", norm, (x_decode, norm_scale), 0),
        ("token_logprobs", f"train {s.rows}x{s.vocab}", logprobs, (logits_train, targets), 0),
        ("token_logprobs", f"decode {s.slots}x{s.vocab} top-50", logprobs_floor,
         (logits_decode, targets[:s.slots], floor), 0),
    ]


def run(platform: str, size: str, dtype: str, repeats: int, only: str | None) -> None:
    pallas = NumericalContract.for_platform(platform, compute_dtype=dtype)
    xla = pallas.replace(backend="xla")
    shapes = SIZES[size]
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"platform={platform} size={size} dtype={dtype}; median of {repeats}")
    print(f"tiles: matmul {pallas.matmul_block_m}/{pallas.matmul_block_n}/"
          f"{pallas.matmul_block_k}, attention {pallas.attn_block_q}/{pallas.attn_block_k}, "
          f"rms_norm {pallas.norm_block_rows}, logprobs {pallas.logprob_block_rows}/"
          f"{pallas.vocab_chunk}")
    header = f"{'kernel':<15} {'problem':<38} {'pallas ms':>10} {'xla ms':>9} {'ratio':>6}"
    show_flops = platform != "cpu"
    if show_flops:
        header += f" {'pallas TF/s':>11} {'xla TF/s':>9}"
    print(header)
    print("-" * len(header))
    for kernel, problem, make, args, flops in _problems(shapes, dtype, rng):
        if only and kernel != only:
            continue
        t_pallas = _time(make(pallas), args, repeats)
        t_xla = _time(make(xla), args, repeats)
        line = (f"{kernel:<15} {problem:<38} {t_pallas * 1e3:>10.2f} {t_xla * 1e3:>9.2f} "
                f"{t_pallas / t_xla:>6.2f}")
        if show_flops and flops:
            line += f" {flops / t_pallas / 1e12:>11.1f} {flops / t_xla / 1e12:>9.1f}"
        print(line, flush=True)
    if platform != "cpu" and size == "large" and only in (None, "matmul"):
        n = 4096
        a, b = (jnp.asarray(rng.standard_normal((n, n)), jnp.bfloat16) for _ in range(2))
        t_pallas = _time(jax.jit(lambda a, b: kernels.matmul(a, b, contract=pallas.replace(
            compute_dtype="bfloat16"))), (a, b), repeats)
        t_xla = _time(jax.jit(lambda a, b: jnp.dot(a, b)), (a, b), repeats)
        flops = 2 * n ** 3
        print(f"matmul {n}^3 bf16: pallas {flops / t_pallas / 1e12:.1f} TFLOP/s, "
              f"XLA dot {flops / t_xla / 1e12:.1f} TFLOP/s, ratio {t_pallas / t_xla:.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"])
    parser.add_argument("--size", default=None, choices=sorted(SIZES),
                        help="problem shapes (default: small on cpu, large elsewhere)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: float32 on cpu, bfloat16 elsewhere)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--kernel", default=None,
                        choices=["matmul", "attention", "rms_norm", "token_logprobs"])
    args = parser.parse_args(argv)
    on_cpu = args.platform == "cpu"
    if jax.default_backend() != args.platform:
        parser.error(f"--platform {args.platform}: JAX's default backend here is "
                     f"{jax.default_backend()!r}")
    run(args.platform, args.size or ("small" if on_cpu else "large"),
        args.dtype or ("float32" if on_cpu else "bfloat16"),
        args.repeats or (5 if on_cpu else 20), args.kernel)


if __name__ == "__main__":
    main()
