"""Benchmark: tensor parallelism with TP-invariant row-parallel projections
(NumericalContract.tensor_shards, jrl.parallel.tensor) on the 8 host CPU devices.

    python -m launch.bench_tensor_parallel                   # ~2 min
    python -m launch.bench_tensor_parallel --render FILE     # the markdown table of a result

A small dense model (random weights) is scored (the train engine's p_o and entropy,
make_tensor_parallel_score_fn) on one device and at TP = 2 and 4, four ways:

  invariant   Pallas kernels, V = tensor_shards virtual shards: each device computes its V / T
              shard products, all-gathers the float32 partials and sums all V in shard order;
  psum        the same Pallas kernel on each device's K / T rows, one product, then a psum of
              it (plain TP with the same kernel: the fair baseline for the invariant path's
              cost). The library has no such path on purpose (it is not invariant): this script
              swaps it in for jrl.kernels.row_parallel's across-device function while compiling;
  xla         the xla backend's plain TP (XLA's dot, then a psum): the control, another kernel;
  one device  the same contract without a mesh.

Per variant: (a) the bytes one device sends per row-parallel layer per token, from the shapes
(ring algorithms, float32 partials of width N = hidden size):

    psum (all-reduce):          2 (T - 1) / T * N * 4
    invariant (all-gather):     (T - 1) / T * V * N * 4   = (T - 1) * (V / T) * N * 4

so the invariant path sends V / 2 times the bytes of a psum, whatever T; and the collectives
the compiled program holds (their result shapes, read from its HLO), as a check of the formula's
inputs; (b) the step time, the median of --repeats calls of the compiled score fn after a
warm-up, and invariant / psum; (c) the max |logit difference| against one device running the
same contract (0: bitwise).

On a CPU the "devices" share one memory and the collectives are copies, so the time ratio says
what the extra kernel calls and the V-fold gather cost in compute and copies, not on a network.

Writes the result (figures, inputs, commit, date, machine) as JSON to --out (default
docs/results/tensor_parallel_cpu.json).
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import datetime  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

from jrl.kernels import row_parallel  # noqa: E402
from jrl.kernels.contract import NumericalContract  # noqa: E402
from jrl.kernels.matmul import matmul_2d  # noqa: E402
from jrl.models import transformer  # noqa: E402
from jrl.models.config import ModelConfig  # noqa: E402
from jrl.parallel.tensor import (TENSOR_AXIS, local_config, make_tensor_mesh,  # noqa: E402
                                 make_tensor_parallel_score_fn, tensor_param_specs)
from jrl.train import make_score_fn  # noqa: E402
from launch.result_file import add_result_arguments, commit, machine, rendered, write_result  # noqa: E402

# 8 query heads on 4 KV heads of 32 (the attention output's K = 256), MLP 768: TP = 4 leaves a
# device 2 query heads, 1 KV head and 192 MLP columns.
MODEL = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=2,
                    num_heads=8, num_kv_heads=4, head_dim=32)
VARIANTS = ("invariant", "psum", "xla")
ALL_GATHER = r"all-gather(?:-start)?"
ALL_REDUCE = r"all-reduce(?:-start)?"


def _pallas_psum(x, w, contract, axis):
    """Plain TP with the Pallas kernel: this device's K / T rows as one product, float32 out,
    then a psum (the baseline; replaces row_parallel._across while compiling)."""
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    y = jax.lax.psum(matmul_2d(x2, w.astype(compute), contract=contract, out_dtype=jnp.float32),
                     axis)
    y = y.astype(compute)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _tp_logits(config: ModelConfig, contract: NumericalContract, mesh):
    """(params, tokens, mask) -> logits [B, T, vocab] float32 under TP (the score fn's forward)."""
    specs = tensor_param_specs(config, mesh)
    shard_config = local_config(config, mesh.shape[TENSOR_AXIS])
    rows = PartitionSpec("data")

    def local(params, tokens, mask):
        out = transformer.forward(params, shard_config, tokens, contract=contract, mask=mask,
                                  tensor_axis=TENSOR_AXIS)
        return transformer.logits_from_hidden(params, out.hidden, contract=contract)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, rows, rows), out_specs=rows,
                         check_vma=False)


def _one_logits(config, contract):
    def logits(params, tokens, mask):
        return transformer.forward_logits(params, config, tokens, contract=contract, mask=mask)
    return logits


def _compile(fn, args, variant: str):
    """fn jitted and compiled for args; the psum variant with the baseline swapped in."""
    if variant == "psum":
        with mock.patch.object(row_parallel, "_across", _pallas_psum):
            return jax.jit(fn).lower(*args).compile()
    return jax.jit(fn).lower(*args).compile()


def _time(programs: dict, args, repeats: int) -> dict:
    """Median wall seconds of each compiled program(*args) after a warm-up call, the programs
    called in turn within each repeat (a slow spell of the machine hits them all alike)."""
    times = {name: [] for name in programs}
    for compiled in programs.values():
        jax.block_until_ready(compiled(*args))
    for _ in range(repeats):
        for name, compiled in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def collectives(compiled) -> list[dict]:
    """The all-gathers and all-reduces of a compiled program: op and result shape (the layers
    are scanned, so each row-parallel projection kind appears once)."""
    found = []
    for line in compiled.as_text().splitlines():
        for op, pattern in (("all-gather", ALL_GATHER), ("all-reduce", ALL_REDUCE)):
            match = re.search(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+" + pattern + r"\(", line)
            if match:
                found.append(dict(op=op, dtype=match.group(1),
                                  shape=[int(d) for d in match.group(2).split(",") if d]))
    return found


def bytes_per_token(variant: str, tp: int, shards: int, width: int) -> float:
    """Bytes one device sends per row-parallel layer per token (ring algorithms, float32)."""
    if variant == "invariant":
        return (tp - 1) / tp * shards * width * 4
    return 2 * (tp - 1) / tp * width * 4


def run(args) -> dict:
    config = MODEL
    # matmul_block_n = 32 divides every device's columns of q, k, v, gate and up at TP = 2 and
    # 4 (the smallest: 4 KV heads of 32 over 4 devices), as TP requires (check_column_tiles);
    # one KV head per attention step on the CPU (check_emulated_heads).
    exact = NumericalContract(platform="cpu", tensor_shards=args.shards, matmul_block_n=32,
                              emulated_heads=1)
    contracts = {"invariant": exact, "psum": exact, "xla": exact.replace(backend="xla")}
    rng = np.random.default_rng(0)
    params = transformer.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (args.batch, args.seq)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    floor = jnp.full(tokens.shape, -jnp.inf, jnp.float32)
    score_args, logit_args = (params, tokens, mask, floor), (params, tokens, mask)
    backends = {"pallas": contracts["invariant"], "xla": contracts["xla"]}
    seconds = _time({backend: _compile(make_score_fn(config, c), score_args, backend)
                     for backend, c in backends.items()}, score_args, args.repeats)
    one = {backend: dict(seconds=seconds[backend],
                         logits=np.asarray(jax.jit(_one_logits(config, c))(*logit_args)))
           for backend, c in backends.items()}
    print(f"  one device: {seconds['pallas'] * 1e3:.1f} ms (Pallas), "
          f"{seconds['xla'] * 1e3:.1f} ms (XLA)", flush=True)
    rows = []
    for tp in (2, 4):
        mesh = make_tensor_mesh(tp)
        programs = {variant: _compile(make_tensor_parallel_score_fn(config, contracts[variant],
                                                                    mesh), score_args, variant)
                    for variant in VARIANTS}
        seconds = _time(programs, score_args, args.repeats)
        for variant in VARIANTS:
            c = contracts[variant]
            logits = np.asarray(_compile(_tp_logits(config, c, mesh), logit_args,
                                         variant)(*logit_args))
            reference = one["xla" if variant == "xla" else "pallas"]
            difference = float(np.max(np.abs(logits - reference["logits"])))
            rows.append(dict(tp=tp, variant=variant, seconds=seconds[variant],
                             over_one_device=seconds[variant] / reference["seconds"],
                             max_abs_logit_diff=difference,
                             bytes_per_token=bytes_per_token(variant, tp, args.shards,
                                                             config.hidden_size),
                             collectives=collectives(programs[variant])))
            print(f"  TP {tp} {variant:<9}: {seconds[variant] * 1e3:.1f} ms, max |d logit| "
                  f"{difference:.3g}, {rows[-1]['bytes_per_token']:.0f} B/token/layer, "
                  f"{[(x['op'], x['shape']) for x in rows[-1]['collectives']]}", flush=True)
    for row in rows:
        if row["variant"] == "invariant":
            base = next(r for r in rows if r["tp"] == row["tp"] and r["variant"] == "psum")
            row["over_psum"] = row["seconds"] / base["seconds"]
    return dict(rows=rows, one_device={k: dict(seconds=v["seconds"]) for k, v in one.items()},
                inputs=dict(model=dict(hidden_size=config.hidden_size,
                                       intermediate_size=config.intermediate_size,
                                       num_layers=config.num_layers, num_heads=config.num_heads,
                                       num_kv_heads=config.num_kv_heads,
                                       head_dim=config.head_dim, vocab_size=config.vocab_size),
                            tensor_shards=args.shards, batch=args.batch, seq=args.seq,
                            repeats=args.repeats, compute_dtype=exact.compute_dtype,
                            matmul_block_n=exact.matmul_block_n,
                            emulated_heads=exact.emulated_heads),
                commit=commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=machine())


def render(result: dict) -> str:
    m, inputs, model = result["machine"], result["inputs"], result["inputs"]["model"]
    names = {"invariant": "invariant (Pallas, all-gather)", "psum": "plain TP (Pallas, psum)",
             "xla": "plain TP (XLA, psum)"}
    lines = ["| TP | row-parallel reduction | collectives in the program (result shape) | "
             "bytes sent / device / layer / token | step ms | x one device (same kernels) | "
             "invariant / psum | max abs(logit - one device) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = f"{r['over_psum']:.2f}x" if "over_psum" in r else ""
        ops = ", ".join(f"{op['op']} {op['dtype']}[{', '.join(map(str, op['shape']))}]"
                        for op in r["collectives"])
        lines.append(f"| {r['tp']} | {names[r['variant']]} | {ops} | "
                     f"{r['bytes_per_token']:.0f} | {r['seconds'] * 1e3:.1f} | "
                     f"{r['over_one_device']:.2f}x | {ratio} | {r['max_abs_logit_diff']:.3g} |")
    one = result["one_device"]
    lines += ["", f"One device: {one['pallas']['seconds'] * 1e3:.1f} ms (Pallas), "
              f"{one['xla']['seconds'] * 1e3:.1f} ms (XLA). Dense model, hidden "
              f"{model['hidden_size']}, {model['num_heads']} heads on {model['num_kv_heads']} KV "
              f"heads of {model['head_dim']}, MLP {model['intermediate_size']}, "
              f"{model['num_layers']} layers, vocab {model['vocab_size']}, random weights; "
              f"tensor_shards = {inputs['tensor_shards']}; {inputs['batch']} x {inputs['seq']} "
              f"tokens, {inputs['compute_dtype']}, median of {inputs['repeats']}; "
              f"{m['platform']} ({m['cpu_count']} cores, 8 host devices), JAX {m['jax']}; "
              f"commit {result['commit'][:10]}, {result['date']}."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=4, help="tensor_shards (V)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    add_result_arguments(parser)
    args = parser.parse_args(argv)
    if rendered(args, render):
        return
    if len(jax.devices()) < 4:
        raise SystemExit("bench_tensor_parallel: needs 4 devices (XLA_FLAGS "
                         "--xla_force_host_platform_device_count=8 on a CPU)")
    result = run(args)
    write_result(result, "tensor_parallel", render, args.out)


if __name__ == "__main__":
    main()
