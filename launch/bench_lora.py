"""Memory of full-weight training vs LoRA vs QLoRA (int8, NF4) at one model size, in bytes
counted from the pytrees: params as stored, the projections QLoRA quantises (the embedding and
norms stay float), trainable params, optimizer state (AdamW: two
moments per trainable param), and what a weight publish copies to a rollout device (the first
publish copies everything; later ones copy the trainable params, jrl.train.publish). Ratios
are against the full-weight run in the same table.

    python -m launch.bench_lora              # SmolLM2-135M dims (abstract shapes: no weights)
    python -m launch.bench_lora --model qwen3-1.7b --compiled   # Qwen3-1.7B dims, + the step
    python -m launch.bench_lora --quick      # a tiny model, also built with real arrays
    python -m launch.bench_lora --rank 8 --param-dtype bfloat16
    python -m launch.bench_lora --quick --compiled   # + the compiled train step's memory

Abstract shapes (jax.eval_shape) give the sizes without allocating the model; QLoRA's stored
layout comes from jrl.kernels.quantize on one layer's slice of each weight, so the table does
not restate the formats. --quick also builds the tiny model for real (lora.attach, the train
state, a WeightPublisher) and checks every number against the abstract count. --compiled
adds the train step's memory analysis (jit_train_step lowered on abstract inputs and compiled
for this host with the plain-XLA kernels, a DAPO step on --rows x --seq tokens): argument,
output and temp bytes. The output is what a step writes back, so it shows the frozen base is
not copied per step. --timed N times N steps per mode with real random weights (median), as
ratios to the full-weight step in the same process.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels, losses
from jrl.kernels.contract import NumericalContract
from jrl.kernels.quantized import QuantizedWeight
from jrl.models import lora, transformer
from jrl.models.config import LoraConfig, ModelConfig
from jrl.train import (OptimizerConfig, TrainBatch, create_train_state, jit_train_step,
                       make_optimizer, make_train_step)
from jrl.train.publish import WeightPublisher

# SmolLM2-135M: 30 layers, D 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied
# (launch/bench_e2e.py's).
SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, tie_word_embeddings=True)
# Qwen3-1.7B: 28 layers, D 2048, 16 query / 8 kv heads of 128 with q/k norms, MLP 6144, vocab
# 151936, tied (its config.json).
QWEN3_1_7B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=2048,
                         intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
                         head_dim=128, qk_norm=True, tie_word_embeddings=True)
# Every input dim a multiple of NF4's block of 64.
TINY = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32)
MODELS = {"smollm2": SMOLLM2, "qwen3-1.7b": QWEN3_1_7B, "tiny": TINY}
MODES = ("full", "lora", "qlora-int8", "qlora-nf4")
COLUMNS = ("params", "base projections", "trainable", "optimizer", "first publish",
           "later publish")


def _abstract_quantized(w: jax.ShapeDtypeStruct, fmt: str) -> QuantizedWeight:
    """The stored shapes of quantize(w, fmt), from quantising one [K, N] slice of zeros."""
    *lead, k, n = w.shape
    one = kernels.quantize(np.zeros((k, n), np.float32), fmt)
    spec = lambda x: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype)
    return QuantizedWeight(spec(one.data), spec(one.scale), fmt)


def abstract_params(config: ModelConfig, mode: str, *, rank: int, dtype) -> tuple[Any, Any]:
    """(model config, params as ShapeDtypeStructs) of `mode` (MODES)."""
    base = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0), dtype))
    if mode == "full":
        return config, base
    quantize = mode.split("-")[1] if mode.startswith("qlora") else "none"
    adapted = config.replace(lora=LoraConfig(rank=rank, alpha=2.0 * rank, quantize=quantize))
    shapes = transformer.param_shapes(adapted)
    params = {}
    for key, value in base.items():
        if not isinstance(value, dict):
            params[key] = value
            continue
        layer = {name: (_abstract_quantized(w, quantize)
                        if quantize != "none" and name in lora.QUANTIZED_WEIGHTS else w)
                 for name, w in value.items()}
        for name, shape in shapes[key].items():
            if lora.is_adapter(name):
                layer[name] = jax.ShapeDtypeStruct(shape, dtype)
        params[key] = layer
    return adapted, params


def projection_bytes(params: Any) -> int:
    """Bytes of the projections QLoRA quantises (jrl.models.lora.QUANTIZED_WEIGHTS)."""
    return sum(lora.param_bytes(w) for value in params.values() if isinstance(value, dict)
               for name, w in value.items() if name in lora.QUANTIZED_WEIGHTS)


def memory_row(params: Any, optimizer) -> dict[str, int]:
    """Bytes of each COLUMNS entry for one params pytree (abstract or real)."""
    trainable, _ = lora.split_trainable(params)
    opt_state = jax.eval_shape(optimizer.init, trainable)
    return {"params": lora.param_bytes(params), "base projections": projection_bytes(params),
            "trainable": lora.param_bytes(trainable),
            "optimizer": lora.param_bytes(opt_state), "first publish": lora.param_bytes(params),
            "later publish": lora.param_bytes(trainable)}


def check_real(config: ModelConfig, rank: int, dtype, optimizer, rows: dict) -> None:
    """Builds each mode with real arrays and checks the abstract counts (quick mode only)."""
    base = transformer.init_params(config, jax.random.key(0), dtype)
    for mode in MODES:
        if mode == "full":
            params = base
        else:
            quantize = mode.split("-")[1] if mode.startswith("qlora") else "none"
            _, params = lora.attach(config, base, LoraConfig(rank=rank, alpha=2.0 * rank,
                                                             quantize=quantize), dtype=dtype)
        state = create_train_state(params, optimizer, jax.random.PRNGKey(0))
        publisher = WeightPublisher()
        device = jax.devices()[:1]
        publisher(params, device)
        first = publisher.last_bytes
        later = lora.merge_trainable(
            jax.tree.map(lambda x: x + 0, lora.split_trainable(params)[0]),
            lora.split_trainable(params)[1])
        publisher(later, device)
        real = {"params": lora.param_bytes(params), "base projections": projection_bytes(params),
                "trainable": lora.param_bytes(lora.split_trainable(params)[0]),
                "optimizer": lora.param_bytes(state.opt_state), "first publish": first,
                "later publish": publisher.last_bytes}
        if real != rows[mode]:
            raise AssertionError(f"{mode}: real arrays {real} != abstract count {rows[mode]}")


COMPILED_COLUMNS = ("step arguments", "step outputs", "step temp")


def compiled_row(config: ModelConfig, params: Any, optimizer, rows: int, seq: int
                 ) -> dict[str, int]:
    """Argument, output and temp bytes of the compiled train step (plain-XLA kernels) on a
    [rows, seq] batch, from abstract params: nothing is allocated."""
    S = jax.ShapeDtypeStruct
    f32 = lambda: S((rows, seq), jnp.float32)
    batch = TrainBatch(tokens=S((rows, seq), jnp.int32), attn_mask=S((rows, seq), bool),
                       loss_mask=S((rows, seq), bool), advantages=S((rows,), jnp.float32),
                       old_logp=f32(), behavior_logp=f32(), ref_logp=f32(), logit_floor=f32())
    state = jax.eval_shape(lambda p: create_train_state(p, optimizer, jax.random.PRNGKey(0)),
                           params)
    step = jit_train_step(make_train_step(config, NumericalContract(backend="xla"),
                                          losses.dapo(), optimizer))
    memory = step.lower(state, batch).compile().memory_analysis()
    return {"step arguments": int(memory.argument_size_in_bytes),
            "step outputs": int(memory.output_size_in_bytes),
            "step temp": int(memory.temp_size_in_bytes)}


def timed_row(config: ModelConfig, mode: str, *, rank: int, dtype, optimizer, rows: int,
              seq: int, repeats: int, backend: str) -> float:
    """Median seconds of one train step of `mode` with real (random) weights on a random
    [rows, seq] DAPO batch, after a compile + warm-up call."""
    base = transformer.init_params(config, jax.random.key(0), dtype)
    adapted, params = config, base
    if mode != "full":
        quantize = mode.split("-")[1] if mode.startswith("qlora") else "none"
        adapted, params = lora.attach(config, base, LoraConfig(rank=rank, alpha=2.0 * rank,
                                                               quantize=quantize), dtype=dtype)
    rng = np.random.default_rng(0)
    zeros = jnp.zeros((rows, seq), jnp.float32)
    response = jnp.asarray(np.arange(seq)[None, :] >= seq // 4).repeat(rows, 0)
    batch = TrainBatch(tokens=jnp.asarray(rng.integers(0, config.vocab_size, (rows, seq)),
                                          jnp.int32),
                       attn_mask=jnp.ones((rows, seq), bool), loss_mask=response,
                       advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
                       old_logp=zeros - 1.0, behavior_logp=zeros - 1.0, ref_logp=zeros,
                       logit_floor=zeros - jnp.inf)
    step = jit_train_step(make_train_step(adapted, NumericalContract(backend=backend),
                                          losses.dapo(), optimizer))
    state = create_train_state(params, optimizer, jax.random.PRNGKey(0))
    state, _ = jax.block_until_ready(step(state, batch))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, _ = jax.block_until_ready(step(state, batch))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}" if n >= 2**20 else f"{n / 2**20:.4f}"


def table(rows: dict, columns=COLUMNS) -> str:
    """A markdown table: MiB and the ratio to full weight per column."""
    full = rows["full"]
    head = "| mode | " + " | ".join(f"{c} MiB (x full)" for c in columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 1)]
    for mode, row in rows.items():
        cells = [f"{_mib(row[c])} ({row[c] / full[c]:.4f})" for c in columns]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.bench_lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, also built with real arrays to check the counts")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--compiled", action="store_true",
                        help="also compile the train step per mode and report its memory "
                             "analysis (abstract inputs: nothing is allocated)")
    parser.add_argument("--rows", type=int, default=8, help="--compiled: batch rows")
    parser.add_argument("--seq", type=int, default=256, help="--compiled: sequence length")
    parser.add_argument("--timed", type=int, default=0, metavar="N",
                        help="also time N train steps per mode with real random weights "
                             "(median; --rows x --seq tokens, --backend kernels)")
    parser.add_argument("--backend", default="xla", choices=("xla", "pallas"),
                        help="--timed: kernels (default plain XLA: Pallas runs in interpret "
                             "mode on a CPU)")
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS),
                        help="dims (default SmolLM2-135M; --quick: tiny)")
    args = parser.parse_args(argv)
    name = "tiny" if args.quick else args.model
    config = MODELS[name]
    dtype = jnp.dtype(args.param_dtype)
    optimizer = make_optimizer(OptimizerConfig())
    rows, compiled = {}, {}
    for mode in MODES:
        adapted, params = abstract_params(config, mode, rank=args.rank, dtype=dtype)
        rows[mode] = memory_row(params, optimizer)
        if args.compiled:
            compiled[mode] = compiled_row(adapted, params, optimizer, args.rows, args.seq)
    if args.quick:
        check_real(config, args.rank, dtype, optimizer, rows)
    print(f"{name} dims ({config.num_layers} layers, D {config.hidden_size}, MLP "
          f"{config.intermediate_size}, vocab {config.vocab_size}), params {args.param_dtype}, "
          f"LoRA r = {args.rank} on q/k/v/o/gate/up/down, AdamW"
          + (" (checked against real arrays)" if args.quick else ""))
    print(table(rows))
    if args.timed:
        seconds = {mode: timed_row(config, mode, rank=args.rank, dtype=dtype,
                                   optimizer=optimizer, rows=args.rows, seq=args.seq,
                                   repeats=args.timed, backend=args.backend) for mode in MODES}
        print(f"\ntrain step time ({args.backend} kernels, DAPO, {args.rows} x {args.seq} "
              f"tokens, median of {args.timed}; same process, so the ratios compare):")
        for mode, t in seconds.items():
            print(f"  {mode:<11} {t:8.3f} s  ({t / seconds['full']:.3f} x full)")
    if args.compiled:
        print(f"\nthe compiled train step (plain-XLA kernels, DAPO, {args.rows} x {args.seq} "
              "tokens):")
        print(table(compiled, COMPILED_COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
