"""Benchmark: where the train update's time goes, exact (Pallas) against plain XLA, at SmolLM2 dims.

    python -m launch.bench_update                      # SmolLM2-135M dims, 8 x 96 tokens
    python -m launch.bench_update --layers 4 --out docs/results/bench_update_cpu.json
    python -m launch.bench_update --render docs/results/bench_update_cpu.json

Each row times one program for both backends in this one run (compiled and warmed up first,
then the median of --repeats runs, the backends interleaved), and gives exact/XLA as a speed
ratio (>= 1: the exact path is at least as fast):

  forward        the model's logits on the batch
  forward+grad   jax.grad of a token-logprob loss (no optimizer)
  train step     the whole update of jrl.train.step (DAPO loss, AdamW)
  matmul bwd     one [T, 576] x [576, 1536] projection's backward alone (dx and dw)
  attention bwd  one layer's causal attention backward alone
  logprob bwd    the LM head's token-logprob backward alone ([T, 576] -> vocab 49152)

The rows say which kernels' backward the exact path pays for. On a CPU the Pallas kernels run
in interpret mode; on a GPU or TPU the same script measures the native kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels, losses
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.train.optimizer import OptimizerConfig, make_optimizer
from jrl.train.state import create_train_state
from jrl.train.step import make_train_step
from launch.bench_e2e import SMOLLM2, make_batch
from launch.result_file import commit, machine, ratio_table

BACKENDS = ("pallas", "xla")


def _timed(fns: dict, repeats: int) -> dict:
    """{backend: median seconds} of each fn(), interleaved, after one warm-up run each."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def rows_for(config, contracts, batch: int, seq: int, repeats: int) -> list[tuple]:
    rng = np.random.default_rng(0)
    params = transformer.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch, seq)), jnp.int32)
    train_batch = make_batch(np.asarray(tokens), 32, rng)
    t, d, f = batch * seq, config.hidden_size, config.intermediate_size
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((d, f)) / np.sqrt(d), jnp.float32)
    heads, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, hd)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, seq, kv, hd)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, seq, kv, hd)), jnp.float32)
    embed = params["embed"]
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    valid = jnp.ones((batch, seq), bool)
    targets = tokens.reshape(-1)
    programs = {}
    for backend, contract in contracts.items():
        def logits(p, c=contract):
            return transformer.forward_logits(p, config, tokens, contract=c)

        def loss(p, c=contract):
            out = transformer.forward_logits(p, config, tokens, contract=c)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), tokens[..., None],
                                                 -1))
        optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6))
        step = jax.jit(make_train_step(config, contract, losses.dapo(), optimizer))
        state = create_train_state(jax.tree.map(jnp.copy, params), optimizer,
                                   jax.random.key(0))
        matmul_bwd = jax.jit(jax.grad(
            lambda x, w, c=contract: jnp.sum(kernels.matmul(x, w, contract=c)), (0, 1)))
        attention_bwd = jax.jit(jax.grad(
            lambda q, k, v, c=contract: jnp.sum(kernels.attention(
                q, k, v, q_positions=positions, kv_positions=positions, kv_valid=valid,
                contract=c)), (0, 1, 2)))
        logprob_bwd = jax.jit(jax.grad(
            lambda h, e, c=contract: jnp.sum(kernels.token_logprobs(
                kernels.matmul(h, e, contract=c, transpose_w=True), targets,
                contract=c).logp), (0, 1)))
        programs[backend] = {
            "forward": (jax.jit(logits), (params,)),
            "forward+grad": (jax.jit(jax.grad(loss)), (params,)),
            "train step": (lambda s=state, fn=step: fn(s, train_batch)[1], ()),
            "matmul bwd": (matmul_bwd, (x, w)),
            "attention bwd": (attention_bwd, (q, k, v)),
            "logprob bwd": (logprob_bwd, (x, embed)),
        }
    rows = []
    for name in programs["pallas"]:
        fns = {b: (lambda fn=programs[b][name][0], args=programs[b][name][1]: fn(*args))
               for b in BACKENDS}
        seconds = _timed(fns, repeats)
        rows.append((name, seconds["pallas"], seconds["xla"],
                     seconds["xla"] / seconds["pallas"]))
        print(f"   {name:<16} exact {seconds['pallas']:8.3f} s   xla {seconds['xla']:8.3f} s"
              f"   exact/xla speed {rows[-1][3]:.2f}x", flush=True)
    return rows


def render(result: dict) -> str:
    m = result["machine"]
    inputs = result["inputs"]
    lines = [f"JAX {result['jax']}, commit {result['commit'][:10]}, {result['date']}; "
             f"{m.get('cpu_model') or m['processor']}, {m['cpu_count']} cores "
             f"({m['platform']}); {inputs['layers']} layers of SmolLM2-135M, {inputs['batch']} x "
             f"{inputs['seq']} tokens, float32, median of {inputs['repeats']}.", ""]
    return "\n".join(lines + ratio_table(result["rows"], "program", ", s", 3))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=SMOLLM2.num_layers)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, metavar="FILE")
    parser.add_argument("--render", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return
    config = SMOLLM2.replace(num_layers=args.layers)
    contracts = {b: NumericalContract.for_platform(jax.default_backend(), backend=b)
                 for b in BACKENDS}
    print(f"== bench_update: {args.layers} layers of SmolLM2-135M, {args.batch} x {args.seq} "
          f"tokens, JAX {jax.__version__} on {jax.default_backend()}", flush=True)
    rows = rows_for(config, contracts, args.batch, args.seq, args.repeats)
    if args.out:
        result = dict(tool="bench_update", jax=jax.__version__, commit=commit(),
                      machine=machine(),
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                          timespec="seconds"),
                      inputs=dict(layers=args.layers, batch=args.batch, seq=args.seq,
                                  repeats=args.repeats),
                      rows=[dict(program=name, pallas=p, xla=x, pallas_over_xla_speed=r)
                            for name, p, x, r in rows])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
