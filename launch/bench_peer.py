"""Benchmark: the JAX peer's sampler (Tunix) on bench_e2e's sampler workload, for a same-window
comparison with `python -m launch.bench_e2e --only sampler`.

    python -m launch.bench_peer              # in a separate venv: pip install google-tunix

The workload is bench_e2e's: SmolLM2-135M dims (Tunix's Llama 3 with tied embeddings), random
float32 weights, S prompts of 32 tokens (31 drawn + BOS) on S = 8 and 32 rows, 64 new tokens at
temperature 1.0 with no truncation and no stop token, a KV cache of 128 positions; median of
--repeats timed runs after one warm-up run. tokens/s = S * 64 / seconds (prefill included, as
in bench_e2e). The peer returns no logprobs unless --logprobs; jrl always records p_b.

Tunix is not a jrl dependency: run this where it is installed, on the same machine and in the
same window as bench_e2e, and compare tokens/s there.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PROMPT_LEN, NEW_TOKENS, CACHE = 32, 64, 128


class _IdTokenizer:
    """Prompts travel as space-separated token ids; nothing is a stop token."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 0

    def eos_id(self):
        return -1

    def pad_id(self):
        return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slots", default="8,32")
    parser.add_argument("--logprobs", action="store_true", help="ask the peer for logprobs too")
    args = parser.parse_args(argv)
    try:
        import jax
        from flax import nnx
        from tunix.generate import sampler as tunix_sampler
        from tunix.models.llama3 import model as tunix_llama
    except ImportError as err:
        raise SystemExit(f"bench_peer: needs the peer installed (pip install google-tunix in a "
                         f"separate venv): {err}") from None
    # SmolLM2-135M: 30 layers, D 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152, tied.
    config = tunix_llama.ModelConfig(num_layers=30, vocab_size=49152, embed_dim=576,
                                     hidden_dim=1536, num_heads=9, head_dim=64, num_kv_heads=3,
                                     rope_theta=100000, norm_eps=1e-5, weight_tying=True)
    model = tunix_llama.Llama3(config, rngs=nnx.Rngs(0))
    print(f"== bench_peer: Tunix sampler, SmolLM2-135M dims, float32, JAX {jax.__version__} on "
          f"{jax.default_backend()}; median of {args.repeats} after warm-up", flush=True)
    for slots in (int(n) for n in args.slots.split(",") if n.strip()):
        rng = np.random.default_rng(0)
        prompts = [" ".join(map(str, rng.integers(1, config.vocab_size, PROMPT_LEN - 1)))
                   for _ in range(slots)]
        sampler = tunix_sampler.Sampler(model, _IdTokenizer(), tunix_sampler.CacheConfig(
            cache_size=CACHE, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim))

        def generate():
            out = sampler(prompts, max_generation_steps=NEW_TOKENS, max_prompt_length=PROMPT_LEN,
                          temperature=1.0, top_p=1.0, seed=0, return_logprobs=args.logprobs,
                          eos_tokens=[-1])
            jax.block_until_ready(out.tokens)
            return out

        out = generate()
        if any(len(tokens) != NEW_TOKENS for tokens in out.tokens):
            raise SystemExit(f"bench_peer: expected {NEW_TOKENS} new tokens per prompt, got "
                             f"{sorted({len(t) for t in out.tokens})}")
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            generate()
            times.append(time.perf_counter() - start)
        print(f"   peer sampler {slots:>2} slots: {slots * NEW_TOKENS / np.median(times):7.1f} "
              f"tokens/s (logprobs {args.logprobs})", flush=True)


if __name__ == "__main__":
    main()
