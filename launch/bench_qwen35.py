"""Benchmark: Qwen3.5 on the bitwise path: whole-model sampler speed and the XLA control's size.

    python -m launch.bench_qwen35            # Qwen3.5-0.8B dims, random weights, f32
    python -m launch.bench_qwen35 --quick    # 8 layers instead of 24, fewer tokens

Qwen3.5-0.8B dims (24 layers, 3 Gated DeltaNet : 1 gated attention, hidden 1024, 16 linear
heads of 128, 8 attention heads of 256 on 2 kv heads, MLP 3584, vocab 248,320, tied), random
weights (the dims, not the weights, set the cost). In one run, both backends side by side:

  sampler   tokens/s of Sampler.generate: S prompts of 32 tokens on S slots (S = 8, 32), NEW
            new tokens each, prefill included; median of --repeats after a warm-up.
  mismatch  how far the train forward's p_o is from the sampler's p_b for the sampled tokens:
            max and mean |p_o - p_b| with the Pallas kernels (exactly 0) and with plain XLA
            (the control: the same formulas, not batch-invariant), in float32 and bfloat16.

The Gated DeltaNet layer alone (train forward + backward, decode, the canonical order's price)
is launch/bench_gated_delta.py. On a CPU, Pallas runs in interpret mode.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.sampling import Sampler, SamplingParams

QWEN35_08B = ModelConfig(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=1024, intermediate_size=3584,
    num_layers=24, num_heads=8, num_kv_heads=2, head_dim=256, rope_theta=10_000_000.0,
    tie_word_embeddings=True, max_position_embeddings=32768, qk_norm=True,
    attn_output_gate=True, norm_offset=1.0, partial_rotary_factor=0.25,
    layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 6,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128)
PROMPT_LEN = 32


def median_time(fn, repeats: int) -> float:
    fn()                                       # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def sampler_for(config, contract, slots, new_tokens, group_size=1):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, group_size=group_size,
                              seed=0)
    return Sampler(config, contract, sampling, num_slots=slots, max_prompt_len=PROMPT_LEN,
                   steps_per_call=new_tokens)


def prompts_for(count, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [(i, rng.integers(0, vocab, PROMPT_LEN).tolist()) for i in range(count)]


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def _train_logprobs(params, tokens, mask, *, config, contract):
    return transformer.sequence_logprobs(params, config, tokens, contract=contract,
                                         mask=mask)[0]


def mismatch(config, params, contract, slots, new_tokens):
    """(max, mean) |p_o - p_b| over the response tokens of one generate call, with the train
    batch laid out unlike the sampler (reversed order, padded to a longer length)."""
    samples = sampler_for(config, contract, slots, new_tokens).generate(
        params, prompts_for(slots, config.vocab_size, seed=1))
    length = PROMPT_LEN + new_tokens + 5
    tokens = np.zeros((slots, length), np.int32)
    mask = np.zeros((slots, length), bool)
    for row, s in enumerate(samples[::-1]):
        seq = np.concatenate([s.prompt_tokens, s.tokens])
        tokens[row, :seq.size], mask[row, :seq.size] = seq, True
    logp = np.asarray(_train_logprobs(params, jnp.asarray(tokens), jnp.asarray(mask),
                                      config=config, contract=contract))
    diffs = np.concatenate([np.abs(logp[row, PROMPT_LEN:PROMPT_LEN + s.length]
                                   - s.behavior_logp)
                            for row, s in enumerate(samples[::-1])])
    return float(diffs.max()), float(diffs.mean())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="8 layers (two periods of 3 DeltaNet + 1 attention), 8 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    config = QWEN35_08B
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    if args.quick:
        config = config.replace(num_layers=8, layer_types=config.layer_types[:8])
    print(f"== bench_qwen35: {config.num_layers} layers, {transformer.num_params(config) / 1e6:.0f}M "
          f"params, f32, {new_tokens} new tokens, median of {args.repeats}", flush=True)
    params = transformer.init_params(config, jax.random.key(0))
    contracts = {b: NumericalContract.for_platform("cpu", backend=b) for b in ("pallas", "xla")}
    rows = []
    for slots in (8, 32):
        prompts = prompts_for(slots, config.vocab_size)
        tps = {}
        for backend, contract in contracts.items():
            sampler = sampler_for(config, contract, slots, new_tokens)
            seconds = median_time(lambda: [s.tokens for s in sampler.generate(params, prompts)],
                                  args.repeats)
            tps[backend] = slots * new_tokens / seconds
            print(f"   sampler {backend:<6} {slots:>2} slots: {tps[backend]:8.2f} tokens/s",
                  flush=True)
        rows.append((slots, tps["pallas"], tps["xla"]))
    print("\n| slots | Pallas tokens/s | XLA tokens/s | Pallas / XLA |\n|---|---|---|---|")
    for slots, p, x in rows:
        print(f"| {slots} | {p:.2f} | {x:.2f} | {p / x:.2f} |")
    print("\n| backend | dtype | max abs(p_o - p_b) | mean abs(p_o - p_b) |\n|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        cast = jax.tree.map(lambda x: x.astype(dtype), params)
        for backend in ("pallas", "xla"):
            contract = NumericalContract.for_platform("cpu", backend=backend,
                                                      compute_dtype=dtype, param_dtype=dtype)
            worst, mean = mismatch(config, cast, contract, 8, new_tokens)
            print(f"| {backend} | {dtype} | {worst:.3g} | {mean:.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
