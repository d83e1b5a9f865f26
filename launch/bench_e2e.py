"""Benchmark: end-to-end RL costs at SmolLM2-135M dims, Pallas (bitwise path) vs plain XLA.

    python -m launch.bench_e2e                 # all sections, SmolLM2-135M dims, random weights
    python -m launch.bench_e2e --quick         # one timed repeat, fewer sections' sizes
    python -m launch.bench_e2e --only sampler  # one section: sampler, prefill, grpo, train
    python -m launch.bench_e2e --out docs/results/bench_e2e_cpu.json   # also a result file
    python -m launch.bench_e2e --render docs/results/bench_e2e_cpu.json

Every figure is measured in this one run, both backends side by side, each compiled and warmed up
first, then the median of --repeats timed runs; the report gives pallas/xla ratios (>= 1 means
Pallas is at least as fast). Random weights in float32 (the model's dims, not its weights, set
the cost), no stop token, so every configuration generates exactly the same tokens.

Sections:
  sampler  tokens/s of `Sampler.generate`: S prompts of 32 tokens on S slots, 64 new tokens each
           (S = 8 and 32), prefill included.
  prefill  seconds to prefill 32 prompts of 32 tokens (waiting prompts go in batched calls).
  grpo     one synchronous GRPO step, 2 prompts x 4 samples, 64 new tokens: generate, p_o (train
           engine logprobs), p_ref (reference model), update (forward + backward + AdamW).
  train    train step alone (forward + backward + optimizer update), 16 sequences x 256 tokens.

On a CPU, Pallas runs in interpret mode: the ratio is the CPU price of batch invariance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrl import losses
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.sampling import Sampler, SamplingParams
from jrl.train.optimizer import OptimizerConfig, make_optimizer
from jrl.train.state import TrainBatch, create_train_state
from jrl.train.step import make_logprob_fn, make_train_step

# SmolLM2-135M: 30 layers, D 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied.
SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, tie_word_embeddings=True, rope_theta=100000.0,
                      max_position_embeddings=2048)
PROMPT_LEN = 32
NEW_TOKENS = 64
BACKENDS = ("pallas", "xla")


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of fn() over `repeats` runs after one warm-up (compilation) run."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def prompts_for(count: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(i, rng.integers(0, vocab, PROMPT_LEN).tolist()) for i in range(count)]


def sampler_for(config, contract, slots, group_size=1):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, group_size=group_size,
                              seed=0)
    return Sampler(config, contract, sampling, num_slots=slots, max_prompt_len=PROMPT_LEN,
                   steps_per_call=NEW_TOKENS)


def bench_sampler(config, params, contracts, repeats, slot_counts=(8, 32)):
    rows = []
    for slots in slot_counts:
        prompts = prompts_for(slots, config.vocab_size)
        tps = {}
        for backend, contract in contracts.items():
            sampler = sampler_for(config, contract, slots)
            seconds = median_time(lambda: [s.tokens for s in sampler.generate(params, prompts)],
                                  repeats)
            tps[backend] = slots * NEW_TOKENS / seconds
            print(f"   sampler {backend:<6} {slots:>2} slots: {tps[backend]:7.1f} tokens/s",
                  flush=True)
        rows.append((f"sampler tokens/s, {slots} slots x {NEW_TOKENS} new", tps["pallas"],
                     tps["xla"], tps["pallas"] / tps["xla"]))
        # Per-token latency, the unit inference engines report: a sequence's time per output
        # token, slots / (tokens/s) (prefill included, as in the tokens/s above).
        latency = {b: 1000.0 * slots / tps[b] for b in tps}
        rows.append((f"  per-token latency, {slots} slots, ms", latency["pallas"],
                     latency["xla"], latency["xla"] / latency["pallas"]))
    return rows


def bench_prefill(config, params, contracts, repeats, count=32):
    """Prefill only: max_new_tokens=1, so each request is one prefill (and its first token)."""
    prompts = prompts_for(count, config.vocab_size)
    seconds = {}
    for backend, contract in contracts.items():
        sampling = SamplingParams(max_new_tokens=1, group_size=1, seed=0)
        sampler = Sampler(config, contract, sampling, num_slots=count, max_prompt_len=PROMPT_LEN)
        seconds[backend] = median_time(lambda: [s.tokens for s in sampler.generate(params,
                                                                                   prompts)],
                                       repeats)
        print(f"   prefill {backend:<6} {count} prompts: {seconds[backend]:6.2f} s", flush=True)
    return [(f"prefill of {count} prompts x {PROMPT_LEN} tokens, s", seconds["pallas"],
             seconds["xla"], seconds["xla"] / seconds["pallas"])]


def make_batch(tokens: np.ndarray, prompt_len: int, rng) -> TrainBatch:
    """A train batch of whole sequences: the first prompt_len tokens are the prompt."""
    batch, seq = tokens.shape
    attn = np.ones((batch, seq), bool)
    loss = np.zeros((batch, seq), bool)
    loss[:, prompt_len:] = True
    zeros = np.zeros((batch, seq), np.float32)
    return TrainBatch(tokens=jnp.asarray(tokens, jnp.int32), attn_mask=jnp.asarray(attn),
                      loss_mask=jnp.asarray(loss),
                      advantages=jnp.asarray(rng.standard_normal(batch).astype(np.float32)),
                      old_logp=jnp.asarray(zeros), behavior_logp=jnp.asarray(zeros),
                      ref_logp=jnp.asarray(zeros),
                      logit_floor=jnp.full((batch, seq), -np.inf, jnp.float32))


def train_parts(config, contract, params):
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6))
    step = jax.jit(make_train_step(config, contract, losses.dapo(), optimizer,
                                   with_reference=True), donate_argnums=(0,))
    logprob = jax.jit(make_logprob_fn(config, contract))
    state = create_train_state(jax.tree.map(jnp.copy, params), optimizer, jax.random.key(0))
    return step, logprob, state


def bench_train(config, params, contracts, repeats, batch=16, seq=256):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq))
    data = make_batch(tokens, seq // 4, rng)
    seconds = {}
    for backend, contract in contracts.items():
        step, _, state = train_parts(config, contract, params)
        holder = [state]

        def once():
            holder[0], metrics = step(holder[0], data)
            return metrics["train/loss"]
        seconds[backend] = median_time(once, repeats)
        print(f"   train  {backend:<6} {batch} x {seq}: {seconds[backend]:6.2f} s", flush=True)
    return [(f"train step, {batch} seqs x {seq} tokens, s", seconds["pallas"], seconds["xla"],
             seconds["xla"] / seconds["pallas"])]


def bench_grpo(config, params, contracts, repeats, num_prompts=2, group=4):
    rows = []
    parts = {}
    for backend, contract in contracts.items():
        sampler = sampler_for(config, contract, num_prompts * group, group_size=group)
        step, logprob, state = train_parts(config, contract, params)
        prompts = prompts_for(num_prompts, config.vocab_size)
        rng = np.random.default_rng(0)
        holder = [state]
        timings = {"generate": [], "p_o": [], "p_ref": [], "update": []}

        def once(record: bool):
            t0 = time.perf_counter()
            samples = sampler.generate(holder[0].params, prompts)
            t1 = time.perf_counter()
            tokens = np.stack([np.concatenate([s.prompt_tokens, s.tokens]) for s in samples])
            data = make_batch(tokens, PROMPT_LEN, rng)
            p_o, _ = logprob(holder[0].params, data.tokens, data.attn_mask, data.logit_floor)
            jax.block_until_ready(p_o)
            t2 = time.perf_counter()
            p_ref, _ = logprob(params, data.tokens, data.attn_mask, data.logit_floor)
            jax.block_until_ready(p_ref)
            t3 = time.perf_counter()
            holder[0], metrics = step(holder[0], data._replace(old_logp=p_o, ref_logp=p_ref))
            jax.block_until_ready(metrics["train/loss"])
            t4 = time.perf_counter()
            if record:
                for name, value in zip(timings, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    timings[name].append(value)

        once(False)
        for _ in range(repeats):
            once(True)
        parts[backend] = {k: float(np.median(v)) for k, v in timings.items()}
        total = sum(parts[backend].values())
        print(f"   grpo   {backend:<6} step {total:6.2f} s: " + " / ".join(
            f"{k} {v:.2f}" for k, v in parts[backend].items()), flush=True)
    totals = {b: sum(p.values()) for b, p in parts.items()}
    rows.append((f"GRPO step, {num_prompts} prompts x {group} samples, s", totals["pallas"],
                 totals["xla"], totals["xla"] / totals["pallas"]))
    for name in ("generate", "p_o", "p_ref", "update"):
        rows.append((f"  of which {name}, s", parts["pallas"][name], parts["xla"][name],
                     parts["xla"][name] / parts["pallas"][name]))
    return rows


# Token batches whose backward the calibration traces: the grpo section's update (8 samples of
# 32 + 64 tokens) and the train section's (16 x 256).
CALIBRATION_BATCHES = ((8, PROMPT_LEN + NEW_TOKENS), (16, 256))


def with_calibrated_row_tiles(contract: NumericalContract, config: ModelConfig,
                              params) -> NumericalContract:
    """contract with a matmul_row_tiles table measured here for the (K, N) of every matmul in
    the model's forward and backward (traced, not compiled) at CALIBRATION_BATCHES."""
    from jrl.kernels.matmul import calibrate_row_tiles, recording_shapes

    def loss(p, tokens):
        return transformer.forward_logits(p, config, tokens, contract=contract).sum()

    with recording_shapes() as shapes:
        for batch in CALIBRATION_BATCHES:
            jax.make_jaxpr(jax.grad(loss))(params, jnp.zeros(batch, jnp.int32))
    return contract.replace(matmul_row_tiles=calibrate_row_tiles(contract, shapes))


SECTIONS = {"sampler": bench_sampler, "prefill": bench_prefill, "grpo": bench_grpo,
            "train": bench_train}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one timed repeat")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--matmul-block-m", type=int, default=None,
                        help="the Pallas contract's matmul row tile (default: the platform's)")
    parser.add_argument("--row-tiles", choices=("none", "calibrate"), default="none",
                        help="CPU only: 'calibrate' measures a matmul_row_tiles table on this "
                             "machine for the shapes of the model's forward and backward at "
                             "the sections' batch sizes (as jrl calibrate-tiles does for a "
                             "config), and the Pallas contract runs with it; 'none': the "
                             "contract's block_m rows everywhere (a run's default)")
    parser.add_argument("--attn-block-k", type=int, default=None,
                        help="the Pallas contract's attention KV tile (default: the platform's); "
                             "a KV cache holds whole tiles")
    parser.add_argument("--slots", default="8,32",
                        help="comma-separated slot counts of the sampler section")
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="also write the figures as a JSON result file (with the inputs, "
                             "commit, date and machine)")
    parser.add_argument("--render", metavar="FILE", help="print FILE's markdown table and exit")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f)))
        return
    repeats = 1 if args.quick else args.repeats
    config = SMOLLM2
    params = transformer.init_params(config, jax.random.key(0), dtype=jnp.dtype(args.dtype))
    # Pallas with the platform's tiles (for_platform); XLA ignores tiles.
    tile = {name: value for name, value in (("matmul_block_m", args.matmul_block_m),
                                            ("attn_block_k", args.attn_block_k))
            if value is not None}
    contracts = {b: NumericalContract.for_platform(jax.default_backend(), backend=b,
                                                   compute_dtype=args.dtype,
                                                   param_dtype=args.dtype,
                                                   **(tile if b == "pallas" else {}))
                 for b in BACKENDS}
    if args.row_tiles == "calibrate":
        contracts["pallas"] = with_calibrated_row_tiles(contracts["pallas"], config, params)
    slot_counts = tuple(int(n) for n in args.slots.split(",") if n.strip())
    print(f"== bench_e2e: SmolLM2-135M dims ({transformer.num_params(config) / 1e6:.1f}M params, random "
          f"weights, {args.dtype}), JAX {jax.__version__} on {jax.default_backend()} "
          f"({jax.device_count()} device(s)); median of {repeats} after warm-up; Pallas matmul "
          f"row tile {contracts['pallas'].matmul_block_m} "
          f"({len(contracts['pallas'].matmul_row_tiles)} shapes with calibrated row tiles), KV "
          f"tile {contracts['pallas'].attn_block_k}", flush=True)
    rows = []
    for name in args.only or list(SECTIONS):
        if name == "sampler":
            rows += bench_sampler(config, params, contracts, repeats, slot_counts)
        else:
            rows += SECTIONS[name](config, params, contracts, repeats)
    print(f"\n   {'measure':<48} {'pallas':>9} {'xla':>9} {'pallas/xla speed':>17}")
    for label, pallas, xla, ratio in rows:
        print(f"   {label:<48} {pallas:>9.2f} {xla:>9.2f} {ratio:>16.2f}x")
    if args.out:
        from launch.result_file import commit, machine
        result = dict(tool="bench_e2e", jax=jax.__version__, commit=commit(), machine=machine(),
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                          timespec="seconds"),
                      inputs=dict(dtype=args.dtype, repeats=repeats, slots=slot_counts,
                                  row_tiles=args.row_tiles,
                                  sections=args.only or list(SECTIONS),
                                  contract=contracts["pallas"].to_dict()),
                      rows=[dict(measure=label.strip(), pallas=pallas, xla=xla,
                                 pallas_over_xla_speed=ratio)
                            for label, pallas, xla, ratio in rows])
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


def render(result: dict) -> str:
    """The markdown table of a result file."""
    from launch.result_file import ratio_table
    machine = result["machine"]
    lines = [f"JAX {result['jax']}, commit {result['commit'][:10]}, {result['date']}; "
             f"{machine.get('cpu_model') or machine['processor']}, {machine['cpu_count']} "
             f"cores ({machine['platform']}); {result['inputs']['dtype']}, median of "
             f"{result['inputs']['repeats']}; CPU row tiles: "
             f"{result['inputs'].get('row_tiles', 'probed while tracing')}.", ""]
    return "\n".join(lines + ratio_table(result["rows"], "measure", "", 2))


if __name__ == "__main__":
    main()
