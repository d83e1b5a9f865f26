"""Benchmark: the exact rollout speedups, as ratios measured in one run (no assertions).

    python -m launch.bench_speed                 # CPU, tiny model, a few minutes
    python -m launch.bench_speed --quick         # smaller sizes, one timed run each
    python -m launch.bench_speed --only speculative --dims smollm2   # at SmolLM2-135M dims

Three comparisons, each compiled and warmed up first, then timed (best of --repeats), same
weights, same seed, Pallas backend (the bitwise path):

  shared prefill   G samples of each prompt (--group, default 8) on a long prompt
                   (--prompt-len); plain prefills every sample's prompt, shared prefills each
                   prompt once into a pool row and copies it into the G slots
                   (Sampler(share_prefill=True)). Few new tokens, so prefill dominates.
  speculative      plain decoding vs Sampler(speculative=SpeculativeConfig(num_draft=k)) at
                   --temperature, on two workloads: low entropy, a peaked bigram policy
                   (`bigram_params`: responses fall into short loops the n-gram draft
                   predicts), and high entropy, the same random model with its attention
                   (drafts mostly rejected: the price of trying).
  hybrid rollback  speculative decoding on a Qwen3.5-style hybrid (Gated DeltaNet + gated
                   attention, mixer outputs zeroed: a low-entropy policy): the verify pass
                   settles the DeltaNet cache to the kept tokens (one forward per step) vs
                   feeding them again (SpeculativeConfig(deltanet_rollback="refeed"), two),
                   and plain decoding.
  draft model      a 4-layer bigram target (layers 2-4 scaled by --refine: they refine the
                   first) decoded plainly, with a draft model (its own first layer: a
                   layer-skip draft; drawn drafts accepted by rejection sampling), the same
                   with the per-slot off-switch disabled (draft_min_accept=0: the baseline of
                   the switch), with n-gram drafts, and with an MTP head built from the same
                   first layer (draft="mtp": drawn drafts, and argmax drafts, which keep plain
                   decoding's samples, timed without the off-switch).

The hybrid and draft-model pairs time their variants in turn, round by round (best of
--repeats each), so that a slow spell of a shared machine falls on all of them. All variants of
a comparison give bit-for-bit the same samples
(tests/sampling/test_shared_prefill.py, test_speculative.py), except the draft model's, whose drawn
drafts give other samples of the same law; the bench checks it again on the samples it times. tok/s
is generated tokens over the wall time of `generate`; prefill s is the time in the programs that
start samples (slots.prefill, or prefix.fill + prefix.start). The speculative pair runs at each of
--temperatures (default 0.6 and 1.0). The last line reads
`shared_prefill_speedup=<tok/s ratio> prefill_time_ratio=<plain / shared prefill s>
prefill_rows=<plain>/<shared> spec_speedup=<y> accept_rate=<z> tokens_per_step=<w>
spec_step_ratio=<plain / speculative decode steps> high_entropy_spec_speedup=<u>
high_entropy_accept_rate=<v> temperature=<t>` (spec_*: the low-entropy workload at the first
temperature), then `hybrid_rollback_speedup=<refeed / settle s> hybrid_spec_speedup=<plain /
settle s> hybrid_accept_rate=<a> hybrid_spec_step_ratio=<s>` (the hybrid pair, at the first
temperature), then `draft_spec_speedup=<plain / draft-model s> draft_accept_rate=<a>
draft_spec_step_ratio=<s> draft_ngram_speedup=<plain / n-gram s> draft_gate_gain=<no switch /
switch s> mtp_spec_speedup=<plain / MTP s> mtp_accept_rate=<a> mtp_spec_step_ratio=<s>`;
`--only` keeps one pair's
fields, and `python -m launch.bench_sampler --speculative` is `--only speculative`.

On a CPU the Pallas kernels run in interpret mode (about 1 ms per grid step), so these ratios
price the saved *calls and grid steps* there, not an accelerator's memory-bound decode. On the
tiny models a step's own logic (drafting, acceptance, recording) costs about as much as its
forward; `--dims smollm2` runs the shared-prefill, speculative and draft-model pairs at
SmolLM2-135M dims (random weights, the same bigram construction; the draft-model target has
SmolLM2's 30 layers, its draft the first), where the forward dominates as it does on real
models.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from jrl.kernels.contract import NumericalContract
from launch.bench_e2e import SMOLLM2
from jrl.models import mtp, transformer
from jrl.models.config import ModelConfig
from jrl.sampling import DraftModel, Sampler, SamplingParams, SpeculativeConfig, prefix, slots
from jrl.sampling.speculative import speculative_metrics

# Demo-sized model: hidden 64, 2 layers, vocab 64.
TINY = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=2, num_kv_heads=1, head_dim=32)


class Timed:
    """Wraps a device function of the engine: waits for its result and adds up the time."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        out = jax.block_until_ready(self.fn(*args))
        self.seconds += time.perf_counter() - start
        return out


# The programs that start samples: per-sample prefill, or pool fill + start from a row.
_STARTS = ((slots, "prefill"), (prefix, "fill"), (prefix, "start"))


def timed_generate(sampler: Sampler, params, prompts, repeats: int, warm_up: bool = True):
    """(best wall seconds, prefill seconds of that run, samples, last_stats) after one compile
    + warm-up call (unless warm_up=False). Prefill seconds: time in the programs that start
    samples (_STARTS)."""
    if warm_up:
        sampler.generate(params, prompts)
    best, samples = (float("inf"), 0.0), None
    for _ in range(repeats):
        timers = [Timed(getattr(module, name)) for module, name in _STARTS]
        for (module, name), timer in zip(_STARTS, timers):
            setattr(module, name, timer)
        try:
            start = time.perf_counter()
            samples = sampler.generate(params, prompts)
            wall = time.perf_counter() - start
        finally:
            for (module, name), timer in zip(_STARTS, timers):
                setattr(module, name, timer.fn)
        best = min(best, (wall, sum(t.seconds for t in timers)))
    return best[0], best[1], samples, dict(sampler.last_stats)


def same_samples(a, b) -> bool:
    return all(np.array_equal(x.tokens, y.tokens) and
               np.array_equal(x.behavior_logp.view(np.int32), y.behavior_logp.view(np.int32))
               for x, y in zip(a, b)) and len(a) == len(b)


def bench_shared_prefill(params, config: ModelConfig, contract, args) -> float:
    rng = np.random.default_rng(0)
    prompts = [(i, rng.integers(2, config.vocab_size, args.prompt_len).tolist())
               for i in range(args.prompts)]
    sampling = SamplingParams(max_new_tokens=args.prefill_new_tokens, group_size=args.group,
                              seed=0)
    results = {}
    for shared in (False, True):
        sampler = Sampler(config, contract, sampling, num_slots=args.slots,
                          max_prompt_len=args.prompt_len, steps_per_call=16,
                          share_prefill=shared)
        results[shared] = timed_generate(sampler, params, prompts, args.repeats)
    (plain_s, plain_pre, plain, plain_stats) = results[False]
    (shared_s, shared_pre, shared, shared_stats) = results[True]
    tokens = plain_stats["tokens"]
    print(f"== shared prefill: {transformer.num_params(config) / 1e6:.2f}M params, "
          f"{args.prompts} prompts x G={args.group} on {args.slots} slots, "
          f"prompt {args.prompt_len} tokens, {args.prefill_new_tokens} new tokens each")
    for label, seconds, pre, stats in (("plain", plain_s, plain_pre, plain_stats),
                                       ("shared", shared_s, shared_pre, shared_stats)):
        print(f"   {label:<7} {seconds:7.3f} s  {tokens / seconds:8.1f} tok/s  prefill "
              f"{pre:7.3f} s  prompts run through the model: {stats['prefill_rows']}")
    print(f"   identical samples: {same_samples(plain, shared)}")
    return (plain_s / shared_s, plain_pre / shared_pre, plain_stats["prefill_rows"],
            shared_stats["prefill_rows"])


def bigram_params(params):
    """A low-entropy policy without training: every mixer's output projection zeroed (attention
    "wo", Gated DeltaNet "w_out"), so each token's logits depend on that token alone, a peaked
    random bigram map. Sampled at a low temperature it falls into short loops, which the n-gram
    draft then predicts (as it would a policy that echoes its input)."""
    def zeroed(path, x):
        name = jax.tree_util.keystr(path)
        return x * 0.0 if "wo" in name or "w_out" in name else x
    return jax.tree_util.tree_map_with_path(zeroed, params)


ACTIVE_VOCAB = 64      # the tokens a large-vocabulary bigram policy is concentrated on


def concentrated(params, vocab_size: int):
    """A large vocabulary's bigram policy, concentrated on its first ACTIVE_VOCAB tokens: the
    tied embedding rows of the others x 0.01, so their logits are about 0 beside the active
    tokens' peaked ones (their use as inputs is unchanged: the first norm rescales them). A
    random bigram map over 49152 tokens loops only after hundreds of tokens; over 64 it loops
    as soon as the tiny model's does, while every forward still costs the full model's."""
    if vocab_size <= ACTIVE_VOCAB:
        return params
    rows = np.where(np.arange(vocab_size) < ACTIVE_VOCAB, 1.0, 0.01).astype(np.float32)
    return {**params, "embed": params["embed"] * rows[:, None]}


def motif_prompts(args, vocab_size: int, temperature: float):
    """--spec-prompts prompts of --spec-prompt-len tokens, each a repeated random 4-token motif
    (of the first ACTIVE_VOCAB tokens), and their SamplingParams (one sample per prompt)."""
    rng = np.random.default_rng(1)
    prompts = []
    for i in range(args.spec_prompts):
        motif = rng.integers(2, min(vocab_size, ACTIVE_VOCAB), 4).tolist()
        prompts.append((i, (motif * (args.spec_prompt_len // 4 + 1))[:args.spec_prompt_len]))
    sampling = SamplingParams(max_new_tokens=args.spec_new_tokens, group_size=1, seed=0,
                              temperature=temperature)
    return prompts, sampling


def bench_speculative(workloads, config, contract, args, temperature: float):
    """{workload: (speedup, accept rate, tokens per step, plain / speculative decode steps)}
    for each (name, params). The step ratio counts device steps, so it does not depend on the
    machine's load; on a busy CPU the tok/s ratio of short runs is mostly noise."""
    prompts, sampling = motif_prompts(args, config.vocab_size, temperature)
    print(f"== speculative: {transformer.num_params(config) / 1e6:.2f}M params, {args.spec_prompts} prompts of {args.spec_prompt_len} tokens "
          f"(a repeated 4-token motif), {args.spec_new_tokens} new tokens, temperature "
          f"{temperature}, k={args.num_draft}")
    out = {}
    for name, params in workloads:
        results = {}
        for spec in (None, SpeculativeConfig(num_draft=args.num_draft)):
            sampler = Sampler(config, contract, sampling, num_slots=args.spec_prompts,
                              max_prompt_len=args.spec_prompt_len, steps_per_call=16,
                              speculative=spec)
            results[spec is not None] = timed_generate(sampler, params, prompts, args.repeats)
        (plain_s, _, plain, plain_stats), (spec_s, _, fast, spec_stats) = \
            results[False], results[True]
        metrics = speculative_metrics(fast)
        accept = metrics["rollout/spec_accept_rate"]
        per_step = metrics["rollout/spec_tokens_per_step"]
        tokens = plain_stats["tokens"]
        print(f"   {name}: plain {plain_s:7.3f} s {tokens / plain_s:8.1f} tok/s, "
              f"{plain_stats['decode_steps']} decode steps | spec {spec_s:7.3f} s "
              f"{tokens / spec_s:8.1f} tok/s, {spec_stats['decode_steps']} decode steps, "
              f"accept rate {accept:.2f}, tokens/step {per_step:.2f} | speedup "
              f"{plain_s / spec_s:.2f}x | identical samples: {same_samples(plain, fast)}")
        out[name] = (plain_s / spec_s, accept, per_step,
                     plain_stats["decode_steps"] / spec_stats["decode_steps"])
    return out


def timed_variants(config, contract, sampling, args, params, prompts, variants) -> dict:
    """{label: (seconds, samples, stats)} for each (label, SpeculativeConfig or None,
    DraftModel, MtpHead or None) of `variants`, one line each: every variant is compiled and warmed
    up, then the variants are timed in turn, --repeats rounds, best of each. Interleaved so
    that a slow spell of a shared machine slows every variant of the pair, not the one that
    happened to be timing then."""
    samplers = {}
    for label, spec, draft in variants:
        if draft is not None:
            spec = dataclasses.replace(spec, draft=draft)
        samplers[label] = Sampler(config, contract, sampling, num_slots=args.spec_prompts,
                                  max_prompt_len=args.spec_prompt_len, steps_per_call=16,
                                  speculative=spec)
        samplers[label].generate(params, prompts)
    runs = {}
    for _ in range(args.repeats):
        for label, sampler in samplers.items():
            seconds, _, samples, stats = timed_generate(sampler, params, prompts, 1,
                                                        warm_up=False)
            if label not in runs or seconds < runs[label][0]:
                runs[label] = (seconds, samples, stats)
    for label, (seconds, samples, stats) in runs.items():
        accept = (f", accept rate {speculative_metrics(samples)['rollout/spec_accept_rate']:.2f}"
                  if samplers[label].speculative is not None else "")
        print(f"   {label:<7} {seconds:7.3f} s {stats['tokens'] / seconds:8.1f} tok/s, "
              f"{stats['decode_steps']} decode steps{accept}")
    return runs


# The demo-sized model as Qwen3.5's hybrid: Gated DeltaNet, gated attention, twice.
HYBRID = TINY.replace(model_type="qwen3_5_text", num_layers=4,
                      layer_types=("linear_attention", "full_attention") * 2,
                      linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=32, partial_rotary_factor=0.5,
                      attn_output_gate=True, norm_offset=1.0, qk_norm=True)


def hybrid_bigram_params(args):
    """bigram_params of HYBRID's random weights scaled by --scale (the decay parameters A_log
    and dt_bias kept)."""
    params = transformer.init_params(HYBRID, jax.random.key(0))

    def scaled(path, x):
        name = jax.tree_util.keystr(path)
        keep = x.ndim < 2 or "A_log" in name or "dt_bias" in name
        return x if keep else x * args.scale
    return bigram_params(jax.tree_util.tree_map_with_path(scaled, params))


def bench_hybrid_rollback(contract, args, temperature: float):
    """Speculative decoding on HYBRID: the verify pass settles Gated DeltaNet's cache to the
    kept tokens ("settle", one forward per step) vs feeding them again ("refeed", two), with
    plain decoding as the reference. Returns (refeed / settle s, plain / settle s, accept rate,
    plain / speculative decode steps)."""
    prompts, sampling = motif_prompts(args, HYBRID.vocab_size, temperature)
    params = hybrid_bigram_params(args)
    print(f"== hybrid rollback: {transformer.num_params(HYBRID) / 1e6:.2f}M-param Gated "
          f"DeltaNet hybrid, {args.spec_prompts} prompts, {args.spec_new_tokens} new tokens, "
          f"temperature {temperature}, k={args.num_draft}, delta_chunk {contract.delta_chunk}")
    runs = timed_variants(HYBRID, contract, sampling, args, params, prompts, (
        ("plain", None, None),
        ("refeed", SpeculativeConfig(num_draft=args.num_draft, deltanet_rollback="refeed"),
         None),
        ("settle", SpeculativeConfig(num_draft=args.num_draft), None)))
    plain, refeed, settle = runs["plain"], runs["refeed"], runs["settle"]
    accept = speculative_metrics(settle[1])["rollout/spec_accept_rate"]
    print(f"   accept rate {accept:.2f} | settle vs refeed {refeed[0] / settle[0]:.2f}x, settle vs "
          f"plain {plain[0] / settle[0]:.2f}x | identical samples: "
          f"{same_samples(plain[1], settle[1]) and same_samples(plain[1], refeed[1])}")
    return (refeed[0] / settle[0], plain[0] / settle[0], accept,
            plain[2]["decode_steps"] / settle[2]["decode_steps"])


# The draft-model pair: a deep target (4 layers; SmolLM2's 30 with --dims smollm2) and, as its
# draft, its own first layer (embedding, first layer and head shared: a layer-skip draft, with
# no training).
DEEP = TINY.replace(num_layers=4)
# --dims: (the speculative pair's model, the draft-model pair's target)
DIMS = {"tiny": (TINY, DEEP), "smollm2": (SMOLLM2, SMOLLM2)}


def layer_skip_draft(deep: ModelConfig, params) -> DraftModel:
    """deep cut to its first layer, with deep's embedding, first layer, final norm and head."""
    return DraftModel(deep.replace(num_layers=1),
                      {**params, "layers": jax.tree.map(lambda x: x[:1], params["layers"])})


def layer_skip_mtp_head(deep: ModelConfig, params) -> mtp.MtpHead:
    """An MTP head for deep made of its own parts, with no training: fc passes the normed
    embedding of x_{t+1} through and drops the hidden state ([I; 0]), the block is deep's
    first layer and the final norm deep's, so the head predicts x_{t+2} as the layer-skip
    draft would from x_{t+1}. (A bigram policy's next token depends on its input token only;
    a trained head also reads h_t.)"""
    d = deep.hidden_size
    head = mtp.init_params(deep, jax.random.key(0))
    fc = np.concatenate([np.eye(d, dtype=np.float32), np.zeros((d, d), np.float32)])
    return mtp.MtpHead({**head, "fc": jax.numpy.asarray(fc),
                        "layers": jax.tree.map(lambda x: x[:1], params["layers"]),
                        "final_norm": params["final_norm"]})


def bench_draft_model(deep: ModelConfig, contract, args, temperature: float):
    """Plain decoding of deep (a bigram policy: mixer outputs zeroed, so its MLPs make the
    logits) vs speculative decoding with the layer-skip draft (drawn drafts, rejection
    sampling), with the off-switch disabled, with n-gram drafts, and with an MTP head built
    from the same first layer (layer_skip_mtp_head), its drafts drawn and argmax.
    Returns (plain / draft s, accept rate, plain / draft decode steps, plain / n-gram s,
    no-switch / draft s, plain / MTP s, MTP accept rate, plain / MTP decode steps)."""
    prompts, sampling = motif_prompts(args, deep.vocab_size, temperature)
    params = transformer.init_params(deep, jax.random.key(0))
    params = bigram_params(jax.tree.map(lambda x: x * args.scale if x.ndim >= 2 else x, params))
    params = concentrated(params, deep.vocab_size)
    # Layers 2.. refine the first one's output (their MLP outputs x --refine), so the draft
    # agrees with the target often but not always, as a distilled draft would.
    factor = np.asarray([1.0] + [args.refine] * (deep.num_layers - 1), np.float32)
    layers = dict(params["layers"], w_down=params["layers"]["w_down"] * factor[:, None, None])
    params = {**params, "layers": layers}
    draft = layer_skip_draft(deep, params)
    head = layer_skip_mtp_head(deep, params)
    print(f"== draft model: {transformer.num_params(deep) / 1e6:.2f}M-param target, "
          f"{transformer.num_params(draft.config) / 1e6:.2f}M-param layer-skip draft, "
          f"{args.spec_prompts} prompts, {args.spec_new_tokens} new tokens, temperature "
          f"{temperature}, k={args.num_draft}")
    runs = timed_variants(deep, contract, sampling, args, params, prompts, (
        ("plain", None, None),
        ("draft", SpeculativeConfig(draft="draft_model", num_draft=args.num_draft), draft),
        ("no-switch", SpeculativeConfig(draft="draft_model", num_draft=args.num_draft,
                                        draft_min_accept=0.0), draft),
        ("ngram", SpeculativeConfig(num_draft=args.num_draft), None),
        ("mtp", SpeculativeConfig(draft="mtp", num_draft=args.num_draft), head),
        # Argmax drafts without the off-switch: their acceptance alone, not the gate's.
        ("mtp-argmax", SpeculativeConfig(draft="mtp", num_draft=args.num_draft,
                                         draft_pick="argmax", draft_min_accept=0.0), head)))
    plain, drafted, ngram, head = runs["plain"], runs["draft"], runs["ngram"], runs["mtp"]
    argmax = runs["mtp-argmax"]
    ungated = runs["no-switch"]
    accept = speculative_metrics(drafted[1])["rollout/spec_accept_rate"]
    print(f"   draft model vs plain {plain[0] / drafted[0]:.2f}x (without the off-switch "
          f"{plain[0] / ungated[0]:.2f}x, accept rate "
          f"{speculative_metrics(ungated[1])['rollout/spec_accept_rate']:.2f}), n-gram vs plain "
          f"{plain[0] / ngram[0]:.2f}x | n-gram samples identical to plain: "
          f"{same_samples(plain[1], ngram[1])} (draft-model samples follow the same law, "
          "not the same draws)")
    head_accept = speculative_metrics(head[1])["rollout/spec_accept_rate"]
    print(f"   MTP head vs plain {plain[0] / head[0]:.2f}x, accept rate {head_accept:.2f} (drawn "
          f"drafts: the same law); argmax drafts (no switch) {plain[0] / argmax[0]:.2f}x, "
          f"{argmax[2]['decode_steps']} steps, accept rate "
          f"{speculative_metrics(argmax[1])['rollout/spec_accept_rate']:.2f}, samples identical "
          f"to plain: {same_samples(plain[1], argmax[1])}")
    return (plain[0] / drafted[0], accept,
            plain[2]["decode_steps"] / drafted[2]["decode_steps"], plain[0] / ngram[0],
            ungated[0] / drafted[0], plain[0] / head[0], head_accept,
            plain[2]["decode_steps"] / head[2]["decode_steps"])


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one timed run")
    parser.add_argument("--only", choices=["shared_prefill", "speculative", "hybrid_rollback",
                                           "draft_model"],
                        default=None,
                        help="run one pair (the last line then has its fields only)")
    parser.add_argument("--dims", choices=sorted(DIMS), default="tiny",
                        help="model dims of the shared-prefill, speculative and draft-model "
                             "pairs (the hybrid pair runs its tiny model)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--slots", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--prefill-new-tokens", type=int, default=4)
    parser.add_argument("--spec-prompts", type=int, default=4)
    parser.add_argument("--spec-prompt-len", type=int, default=16)
    parser.add_argument("--spec-new-tokens", type=int, default=None)
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--temperatures", default="0.6,1.0",
                        help="comma-separated sampling temperatures of the speculative pair; "
                             "the last line's spec_* fields are the first one's")
    parser.add_argument("--scale", type=float, default=40.0,
                        help="weights x scale: a peaked random model")
    parser.add_argument("--refine", type=float, default=0.02,
                        help="the draft-model pair's target: MLP outputs of layers 2-4 x refine "
                             "(small: the first layer, the draft, decides most tokens)")
    return parser


LOW, HIGH = "low-entropy (bigram policy)", "high-entropy (random policy)"


def main(argv=None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    if args.dims != "tiny" and args.only not in ("shared_prefill", "speculative", "draft_model"):
        cli.error(f"--dims {args.dims} applies to the shared_prefill, speculative and "
                  "draft_model pairs: add --only with one of them")
    spec_model, deep = DIMS[args.dims]
    quick = args.quick
    args.repeats = args.repeats or (1 if quick else 3)
    args.prompts = args.prompts or (2 if quick else 4)
    args.slots = args.slots or (8 if quick else 16)
    args.prompt_len = args.prompt_len or (64 if quick else 256)
    args.spec_new_tokens = args.spec_new_tokens or (32 if quick else 64)
    temperatures = [float(t) for t in args.temperatures.split(",") if t.strip()]

    contract = NumericalContract.for_platform(jax.default_backend(), backend="pallas")
    params = transformer.init_params(spec_model, jax.random.key(0))
    params = jax.tree.map(lambda x: x * args.scale if x.ndim >= 2 else x, params)
    print(f"backend {jax.default_backend()}, {args.dims} dims, f32, pallas"
          + (" (interpret mode)" if jax.default_backend() == "cpu" else ""))
    fields = []
    if args.only in (None, "shared_prefill"):
        prefill_speedup, prefill_time_ratio, rows_plain, rows_shared = bench_shared_prefill(
            params, spec_model, contract, args)
        fields += [f"shared_prefill_speedup={prefill_speedup:.2f}",
                   f"prefill_time_ratio={prefill_time_ratio:.2f}",
                   f"prefill_rows={rows_plain}/{rows_shared}"]
    if args.only in (None, "speculative"):
        low_entropy = concentrated(bigram_params(params), spec_model.vocab_size)
        by_temperature = {t: bench_speculative([(LOW, low_entropy), (HIGH, params)],
                                               spec_model, contract, args, t)
                          for t in temperatures}
        low, high = by_temperature[temperatures[0]][LOW], by_temperature[temperatures[0]][HIGH]
        fields += [f"spec_speedup={low[0]:.2f}", f"accept_rate={low[1]:.2f}",
                   f"tokens_per_step={low[2]:.2f}", f"spec_step_ratio={low[3]:.2f}",
                   f"high_entropy_spec_speedup={high[0]:.2f}",
                   f"high_entropy_accept_rate={high[1]:.2f}",
                   f"temperature={temperatures[0]}"]
    if args.only in (None, "hybrid_rollback"):
        rollback, versus_plain, accept, steps = bench_hybrid_rollback(contract, args,
                                                                      temperatures[0])
        fields += [f"hybrid_rollback_speedup={rollback:.2f}",
                   f"hybrid_spec_speedup={versus_plain:.2f}",
                   f"hybrid_accept_rate={accept:.2f}", f"hybrid_spec_step_ratio={steps:.2f}"]
    if args.only in (None, "draft_model"):
        (speedup, accept, steps, ngram, gain, mtp_speedup, mtp_accept,
         mtp_steps) = bench_draft_model(deep, contract, args, temperatures[0])
        fields += [f"draft_spec_speedup={speedup:.2f}", f"draft_accept_rate={accept:.2f}",
                   f"draft_spec_step_ratio={steps:.2f}", f"draft_ngram_speedup={ngram:.2f}",
                   f"draft_gate_gain={gain:.2f}", f"mtp_spec_speedup={mtp_speedup:.2f}",
                   f"mtp_accept_rate={mtp_accept:.2f}", f"mtp_spec_step_ratio={mtp_steps:.2f}"]
    print(" ".join(fields))


if __name__ == "__main__":
    main()
