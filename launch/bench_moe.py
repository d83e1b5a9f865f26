"""Benchmark: the MoE layer (route + dispatch + experts + combine), Pallas vs the plain-XLA path.

    python -m launch.bench_moe            # CPU, scaled Qwen3-30B-A3B: 64 experts, top-8,
                                          # hidden 1024, expert ffn 384, float32 (~4 min)
    python -m launch.bench_moe --quick    # 16 experts, top-4, hidden 256, ffn 128 (~1 min)

Problems: the train forward+backward over batch x seq tokens (value_and_grad w.r.t. the input,
the router and the three expert weights), and decode forwards for 8 and 32 tokens. Each is
jitted per backend with the same contract, compiled, warmed up once, then timed as the median of
`--repeats` runs; the table prints pallas / xla (> 1: Pallas is slower). On a CPU the Pallas
kernels run in interpret mode and the backward of both backends is the XLA path, so the ratio
is the price of batch invariance there. No assertions on time.
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
    experts: int
    top_k: int
    dim: int            # hidden size
    ffn: int            # expert intermediate size
    batch: int          # train sequences
    seq: int            # train sequence length
    decode: tuple[int, ...]


# Qwen3-30B-A3B is 128 experts, top-8, hidden 2048, expert ffn 768: halved to fit this CPU.
FULL = Shapes(experts=64, top_k=8, dim=1024, ffn=384, batch=16, seq=256, decode=(8, 32))
QUICK = Shapes(experts=16, top_k=4, dim=256, ffn=128, batch=4, seq=128, decode=(8, 32))


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


def _layer(contract: NumericalContract, top_k: int):
    """y [N, D] = the MoE layer: f32 router logits (matmul kernel), top-k routing, experts."""
    router_contract = contract.replace(compute_dtype="float32")

    def layer(x, w_router, w_gate, w_up, w_down):
        logits = kernels.matmul(x, w_router, contract=router_contract)
        r = kernels.route(logits, top_k=top_k, norm_topk_prob=True, contract=contract)
        return kernels.moe_experts(x, r.experts, r.weights, w_gate, w_up, w_down,
                                   contract=contract)
    return layer


def _problems(s: Shapes, rng):
    """(name, make(contract) -> jitted fn, args) for every row."""
    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    params = (normal(s.dim, s.experts, scale=s.dim ** -0.5),
              normal(s.experts, s.dim, s.ffn, scale=s.dim ** -0.5),
              normal(s.experts, s.dim, s.ffn, scale=s.dim ** -0.5),
              normal(s.experts, s.ffn, s.dim, scale=s.ffn ** -0.5))
    tokens = s.batch * s.seq
    x_train, dy = normal(tokens, s.dim), normal(tokens, s.dim)

    def train(c):
        layer = _layer(c, s.top_k)
        return jax.jit(jax.value_and_grad(
            lambda x, *p: jnp.sum(layer(x, *p) * dy), argnums=tuple(range(5))))

    def decode(c):
        return jax.jit(_layer(c, s.top_k))

    problems = [(f"train fwd+bwd {s.batch}x{s.seq} tokens", train, (x_train, *params))]
    for n in s.decode:
        problems.append((f"decode {n} tokens", decode, (normal(n, s.dim), *params)))
    return problems


def run(shapes: Shapes, repeats: int) -> None:
    pallas = NumericalContract.for_platform("cpu")
    xla = pallas.replace(backend="xla")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
          f"{shapes.experts} experts, top-{shapes.top_k}, hidden {shapes.dim}, expert ffn "
          f"{shapes.ffn}, float32; expert row tile {pallas.matmul_block_m}; median of {repeats}")
    header = f"{'problem':<34} {'pallas ms':>10} {'xla ms':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    ratios = []
    for name, make, args in _problems(shapes, np.random.default_rng(0)):
        t_pallas = _time(make(pallas), args, repeats)
        t_xla = _time(make(xla), args, repeats)
        ratios.append((name, t_pallas / t_xla))
        print(f"{name:<34} {t_pallas * 1e3:>10.1f} {t_xla * 1e3:>10.1f} "
              f"{t_pallas / t_xla:>6.2f}", flush=True)
    print("summary: pallas / xla " + ", ".join(f"{name.split()[0]} {name.split()[-2]}: "
                                                f"{ratio:.2f}x" for name, ratio in ratios))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes (about a minute)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if jax.default_backend() != "cpu":
        parser.error(f"this benchmark is sized for a CPU; JAX's default backend here is "
                     f"{jax.default_backend()!r}")
    run(QUICK if args.quick else FULL, args.repeats)


if __name__ == "__main__":
    main()
