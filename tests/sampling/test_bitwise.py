"""The invariant, end to end: p_b recorded by the sampler == p_o recomputed by the train forward,
bitwise (`max|p_b - p_o| == 0.0`), with the Pallas backend; the xla backend is the control.

Setting: 4 prompts of lengths 3, 8, 1, 5, 3 samples each (12 requests) on 4 slots, a stop token,
16 new tokens at most: samples finish at different steps and freed slots are refilled (prefill
into one slot while the other slots are mid-decode). The train batch is laid out differently:
other batch sizes (12 rows; micro-batches of 5), other orders, other padding lengths (30; 24).
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels, losses
from jrl.models import transformer

from tests.conftest import _LEGACY_EMITTERS_FLAG, default_emitters_env

from .helpers import (
    CONFIG, GROUP_SIZE, NUM_SLOTS, PROMPTS, Case, bits_equal, contract,
    max_abs_diff, model_params, recompute_two_layouts, response_batch, run, sampler,
    train_logprobs)

FP8 = "float8_e4m3fn"
_SLOW = pytest.mark.slow     # make test-slow: each 1-4 minutes of interpret-mode compiles
CASES = {
    "f32-t1": pytest.param(Case("pallas", "float32", 1.0, 1.0), marks=_SLOW),
    "f32-topp0.9": Case("pallas", "float32", 1.0, 0.9),
    "bf16-t1": pytest.param(Case("pallas", "bfloat16", 1.0, 1.0), marks=_SLOW),
    "bf16-topp0.9": Case("pallas", "bfloat16", 1.0, 0.9),
    "f32-t0.7-topk8-topp0.95": Case("pallas", "float32", 0.7, 0.95, top_k=8),
    # The other families (tests/sampling/helpers.py ARCHS): Qwen3.5's hybrid Gated DeltaNet +
    # gated attention, Qwen3-MoE and the hybrid with MoE blocks, Llama 3's scaled RoPE, Qwen2's
    # biases and dense Qwen3's q/k norm, with refills, top-p and bf16.
    "qwen35-f32-topp0.9": Case("pallas", "float32", 1.0, 0.9, arch="qwen35"),
    "qwen35-bf16-t1": pytest.param(Case("pallas", "bfloat16", 1.0, 1.0, arch="qwen35"),
                                   marks=_SLOW),
    "qwen3moe-f32-topp0.9": Case("pallas", "float32", 1.0, 0.9, arch="qwen3_moe"),
    "llama3-bf16-topp0.9": Case("pallas", "bfloat16", 1.0, 0.9, arch="llama3"),
    "qwen2-f32-topp0.9": Case("pallas", "float32", 1.0, 0.9, arch="qwen2"),
    "qwen3-bf16-topp0.9": Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen3"),
    "qwen35moe-bf16-topp0.9": pytest.param(
        Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen35_moe"), marks=_SLOW),
    # An FP8 KV cache (kv_dtype; tests/sampling/test_fp8_cache.py has its other checks) for
    # every family with attention, QLoRA's quantised base beside it.
    "fp8kv-llama-bf16-topp0.9": Case("pallas", "bfloat16", 1.0, 0.9, kv_dtype=FP8),
    "fp8kv-qwen35-f32-topp0.9": Case("pallas", "float32", 1.0, 0.9, arch="qwen35",
                                     kv_dtype=FP8),
    "fp8kv-llama-f32-t1": pytest.param(Case("pallas", "float32", 1.0, 1.0, kv_dtype=FP8),
                                       marks=_SLOW),
    "fp8kv-qwen3moe-bf16-topp0.9": pytest.param(
        Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen3_moe", kv_dtype=FP8), marks=_SLOW),
    "fp8kv-qwen35moe-bf16-t1": pytest.param(
        Case("pallas", "bfloat16", 1.0, 1.0, arch="qwen35_moe", kv_dtype=FP8), marks=_SLOW),
    "fp8kv-llama_qlora-f32-topp0.9": pytest.param(
        Case("pallas", "float32", 1.0, 0.9, arch="llama_qlora", kv_dtype=FP8), marks=_SLOW),
    "fp8kv-qwen3-bf16-topp0.9": pytest.param(
        Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen3", kv_dtype=FP8), marks=_SLOW),
    # W8A8 matmuls (matmul_dtype; tests/sampling/test_w8a8.py), with an FP8 cache beside them.
    "w8a8-llama-bf16-topp0.9": Case("pallas", "bfloat16", 1.0, 0.9, matmul_dtype=FP8),
    "w8a8-qwen35-bf16-topp0.9": pytest.param(
        Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen35", matmul_dtype=FP8), marks=_SLOW),
    "w8a8-qwen35-f32-t1": pytest.param(
        Case("pallas", "float32", 1.0, 1.0, arch="qwen35", matmul_dtype=FP8), marks=_SLOW),
    "w8a8-qwen3moe-bf16-topp0.9": pytest.param(
        Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen3_moe", matmul_dtype=FP8), marks=_SLOW),
    "w8a8-qwen35moe-bf16-t1": pytest.param(
        Case("pallas", "bfloat16", 1.0, 1.0, arch="qwen35_moe", matmul_dtype=FP8),
        marks=_SLOW),
    "w8a8-llama_lora-f32-topp0.9": pytest.param(
        Case("pallas", "float32", 1.0, 0.9, arch="llama_lora", matmul_dtype=FP8), marks=_SLOW),
    "w8a8-llama-bf16-fp8kv": pytest.param(
        Case("pallas", "bfloat16", 1.0, 0.9, kv_dtype=FP8, matmul_dtype=FP8), marks=_SLOW),
}
NUM_REQUESTS = len(PROMPTS) * GROUP_SIZE


def assert_refills_happened(samples, stats):
    assert NUM_REQUESTS > NUM_SLOTS
    assert len(samples) == NUM_REQUESTS
    assert stats["prefills"] == NUM_REQUESTS
    # Requests past the first NUM_SLOTS were prefilled into a batch that was still decoding.
    assert stats["refills_while_busy"] >= 1
    assert len({s.length for s in samples}) >= 2, "samples should finish at different steps"
    assert any(s.finish_reason == "stop" for s in samples)
    assert any(s.finish_reason == "length" for s in samples)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bitwise_sampler_logprobs_equal_train_recompute(case):
    samples, stats = run(case)
    assert_refills_happened(samples, stats)
    if case.top_p < 1.0 or case.top_k:
        # Truncation was active (a finite floor per token) and is replayed by the trainer.
        assert all(np.all(np.isfinite(s.logit_floor)) for s in samples)
    else:
        assert all(np.all(s.logit_floor == -np.inf) for s in samples)
    p_b = [s.behavior_logp for s in samples]
    assert all(np.all(np.isfinite(x)) and np.all(x <= 0.0) for x in p_b)
    first, second = recompute_two_layouts(model_params(0, case.arch), samples, case.contract(),
                                          case.temperature, arch=case.arch)
    assert max_abs_diff(p_b, first) == 0.0
    assert max_abs_diff(p_b, second) == 0.0
    for i in range(len(samples)):  # bits too: -0.0 vs 0.0 or NaN would pass a diff of 0
        assert bits_equal(p_b[i], first[i]) and bits_equal(p_b[i], second[i]), i


def _step0_metrics(samples, p_c):
    """One GRPO / DAPO loss evaluation at step 0: p_old = p_b (sync RL, no trainer-side old
    recompute), p_c = the train forward's recompute."""
    logp, mask = response_batch(samples, p_c)
    old_logp, _ = response_batch(samples, [s.behavior_logp for s in samples])
    rewards = jnp.asarray([float(s.finish_reason == "stop") for s in samples])
    inputs = losses.LossInputs(logp=jnp.asarray(logp), old_logp=jnp.asarray(old_logp),
                               advantages=losses.group_advantages(rewards, GROUP_SIZE),
                               mask=jnp.asarray(mask), behavior_logp=jnp.asarray(old_logp))
    ratio = np.asarray(losses.token_ratio(inputs.logp, inputs.old_logp, inputs.mask))
    metrics = {name: jax.jit(fn)(inputs)[1] for name, fn in
               (("grpo", losses.grpo(kl_beta=0.0)), ("dapo", losses.dapo()))}
    return ratio, mask, metrics


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bitwise_grpo_step0_ratio_is_exactly_one(dtype):
    case = Case("pallas", dtype, 1.0, 0.9)
    samples, _ = run(case)
    p_c, _ = recompute_two_layouts(model_params(0), samples, contract("pallas", dtype), 1.0)
    ratio, mask, metrics = _step0_metrics(samples, p_c)
    assert np.all(ratio[mask] == 1.0)
    for name, m in metrics.items():
        assert float(m["train/ppo_kl"]) == 0.0, name
        assert float(m["train/pg_clipfrac_low"]) == 0.0, name
        assert float(m["train/pg_clipfrac_high"]) == 0.0, name
        assert float(m["train/ratio_min"]) == 1.0 == float(m["train/ratio_max"]), name


def test_bitwise_control_xla_backend_differs():
    """The same check with the plain-XLA kernels: p_b != p_o, so the test above can fail.

    float32, because there XLA's differences are not rounded away: every layout differs (in
    bfloat16 the 5-row micro-batches happened to agree bitwise on this model)."""
    case = Case("xla", "float32", 1.0, 0.9)
    samples, stats = run(case)
    assert_refills_happened(samples, stats)
    p_b = [s.behavior_logp for s in samples]
    first, second = recompute_two_layouts(model_params(0), samples, contract("xla", "float32"),
                                          1.0)
    assert max_abs_diff(p_b, first) > 0.0
    assert max_abs_diff(p_b, second) > 0.0
    ratio, mask, metrics = _step0_metrics(samples, first)
    assert np.any(ratio[mask] != 1.0)
    assert float(metrics["grpo"]["train/ppo_kl"]) != 0.0


@pytest.mark.parametrize("arch", ["qwen35", pytest.param("qwen35_moe", marks=_SLOW)])
def test_bitwise_control_xla_backend_differs_for_hybrid_models(arch):
    """The control for the hybrid families: with plain-XLA kernels (the same chunked formula,
    not batch-invariant) the train recompute does not reproduce the sampler's p_b."""
    case = Case("xla", "float32", 1.0, 0.9, arch=arch)
    samples, _ = run(case)
    first, second = recompute_two_layouts(model_params(0, arch), samples,
                                          contract("xla", "float32"), 1.0, arch=arch)
    p_b = [s.behavior_logp for s in samples]
    assert max(max_abs_diff(p_b, first), max_abs_diff(p_b, second)) > 0.0


def test_bitwise_same_seed_same_samples_any_num_slots():
    """The PRNG stream of a sample is a function of (seed, prompt_id, sample_index, step), and
    the kernels are batch-invariant, so slot count, prompt order, refill pattern and prefill
    batch sizes change no bit of any token, p_b or floor. (The reference prefills every batch
    as all 4 slots, prefill_buckets="one"; the 3-slot sampler in power-of-two buckets of 1, 2
    and 3 rows.)"""
    case = Case("pallas", "float32", 1.0, 0.9)
    reference, reference_stats = run(case)

    def same(a_list, b_list):
        assert [(a.prompt_id, a.sample_index) for a in a_list] == \
               [(b.prompt_id, b.sample_index) for b in b_list]
        for a, b in zip(a_list, b_list):
            assert np.array_equal(a.tokens, b.tokens)
            assert bits_equal(a.behavior_logp, b.behavior_logp)
            assert bits_equal(a.logit_floor, b.logit_floor)
            assert a.finish_reason == b.finish_reason

    params = model_params(0)
    again = sampler(top_p=0.9).generate(params, PROMPTS)
    same(reference, again)
    three_slots = sampler(top_p=0.9, num_slots=3, steps_per_call=5,
                          prefill_buckets="powers_of_two")
    same(reference, three_slots.generate(params, PROMPTS))
    # Some refill ran fewer than 3 rows (a smaller bucket, another program), while the
    # reference ran all 4 rows in every prefill call.
    stats = three_slots.last_stats
    assert stats["prefill_batch_rows"] < 3 * stats["prefill_calls"]
    assert reference_stats["prefill_batch_rows"] == 4 * reference_stats["prefill_calls"]
    # Prompts in reverse order: other slots, other refill times; results come back in the
    # order of the prompts given.
    backwards = sampler(top_p=0.9).generate(params, PROMPTS[::-1])
    by_id = {(s.prompt_id, s.sample_index): s for s in backwards}
    same(reference, [by_id[(s.prompt_id, s.sample_index)] for s in reference])
    # Another seed: other samples (the seed is a runtime argument: nothing recompiles).
    other = sampler(top_p=0.9, seed=8).generate(params, PROMPTS)
    assert sum(not np.array_equal(a.tokens, b.tokens) for a, b in zip(reference, other)) >= 6


# ---------------------------------------------------------------------------------------------
# Weight swap mid-generation

SWAP_AT_CALL = 3


def _poll_after(calls_before_swap, new_params, new_version=1):
    calls = [0]

    def poll():
        calls[0] += 1
        return (new_params, new_version) if calls[0] == calls_before_swap else None
    return poll


@functools.partial(jax.jit, static_argnames=("contract",))
def _mixed_prefix_logprobs(old_params, new_params, tokens, split, end, floor, *, contract):
    """What keep-KV decoding computes: K/V of positions [0, split) from old_params, of
    [split, end) from new_params, all queries from new_params. tokens/floor [1, C] ->
    logp [1, C] (logp[:, t] of token t, 0 at t = 0)."""
    capacity = tokens.shape[1]
    positions = jnp.arange(capacity, dtype=jnp.int32)[None]
    cache = transformer.init_cache(CONFIG, 1, capacity, contract)
    _, cache = transformer.forward_hidden(old_params, CONFIG, tokens, contract=contract,
                                          positions=positions, mask=positions < split,
                                          cache=cache)
    hidden, _ = transformer.forward_hidden(new_params, CONFIG, tokens, contract=contract,
                                           positions=positions,
                                           mask=(positions >= split) & (positions < end),
                                           cache=cache)
    logits = transformer.logits_from_hidden(new_params, hidden[:, :-1], contract=contract)
    logp, _ = kernels.token_logprobs(logits, tokens[:, 1:], contract=contract,
                                     logit_floor=floor[:, 1:])
    return jnp.concatenate([jnp.zeros((1, 1), jnp.float32), logp], axis=1)


def _split_by_version(samples):
    before = [s for s in samples if np.all(s.versions == 0)]
    after = [s for s in samples if np.all(s.versions == 1)]
    spanning = [s for s in samples if 0 < np.sum(s.versions == 1) < s.length]
    return before, after, spanning


@pytest.mark.parametrize("recompute_kv", [False, True], ids=["keep_kv", "recompute_kv"])
def test_bitwise_weight_swap_versions_and_logprobs(recompute_kv):
    old, new = model_params(0), model_params(1)
    f32 = contract("pallas", "float32")
    s = sampler(recompute_kv_on_swap=recompute_kv)
    samples = s.generate(old, PROMPTS, poll_weights=_poll_after(SWAP_AT_CALL, new))
    assert s.last_stats["refreshes"] == (1 if recompute_kv else 0)
    before, after, spanning = _split_by_version(samples)
    assert after and spanning, "the swap should fall mid-generation"
    for x in samples:
        # A prefix of version 0, then version 1.
        assert set(np.unique(x.versions)) <= {0, 1}
        assert np.all(np.diff(x.versions) >= 0)
    # Tokens drawn before the swap are those of an unswapped run (same PRNG stream, same
    # weights): the swap changes nothing in the past.
    unswapped = {(x.prompt_id, x.sample_index): x for x in run(Case()).samples}
    for x in samples:
        n0 = int(np.sum(x.versions == 0))
        ref = unswapped[(x.prompt_id, x.sample_index)]
        assert np.array_equal(x.tokens[:n0], ref.tokens[:n0])
        assert bits_equal(x.behavior_logp[:n0], ref.behavior_logp[:n0])

    order = range(len(samples))
    full_old = train_logprobs(old, samples, f32, 1.0, order=order, batch=len(samples), length=30)
    full_new = train_logprobs(new, samples, f32, 1.0, order=order, batch=len(samples), length=30)
    for x, lp_old, lp_new in zip(samples, full_old, full_new):
        v0, v1 = x.versions == 0, x.versions == 1
        # (b) version-0 tokens: the old weights, whose K/V they were computed on.
        assert bits_equal(x.behavior_logp[v0], lp_old[v0])
        # (a) samples prefilled after the swap: the new weights throughout.
        if np.all(v1):
            assert bits_equal(x.behavior_logp, lp_new)
    for x in spanning:
        v1 = x.versions == 1
        lp_new = full_new[samples.index(x)]
        if recompute_kv:
            # (c) with recompute_kv_on_swap: every token is a full forward of its version.
            assert bits_equal(x.behavior_logp[v1], lp_new[v1])
        else:
            # (c) keep-KV: new weights on top of the old-weights K/V of the prefix. Exactly
            # reproducible too, by building the cache the same way.
            p, first_new = x.prompt_tokens.size, int(np.argmax(v1))
            capacity = 30
            tokens = np.zeros((1, capacity), np.int32)
            floor = np.full((1, capacity), -np.inf, np.float32)
            tokens[0, :p], tokens[0, p:p + x.length] = x.prompt_tokens, x.tokens
            floor[0, p:p + x.length] = x.logit_floor
            mixed = np.asarray(_mixed_prefix_logprobs(
                old, new, jnp.asarray(tokens), jnp.int32(p + first_new - 1),
                jnp.int32(p + x.length), jnp.asarray(floor), contract=f32))[0, p:p + x.length]
            assert bits_equal(x.behavior_logp[v1], mixed[v1])
    if not recompute_kv:
        # ... and that is not the full new-weights forward: the stale prefix is visible.
        assert any(not bits_equal(x.behavior_logp[x.versions == 1],
                                  full_new[samples.index(x)][x.versions == 1])
                   for x in spanning)


def test_bitwise_at_full_optimization():
    """The suite compiles with XLA's backend optimizations off and its older CPU fusion emitters
    (tests/conftest.py); production does neither. The core case runs again in a child process
    with XLA's defaults: its p_b == p_o holds there too."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys; sys.path.insert(0, 'tests'); from jax._src import compiler; "
            "assert not compiler._DISABLE_MOST_OPTIMIZATIONS.value; "
            "from sampling.test_bitwise import CASES, "
            "test_bitwise_sampler_logprobs_equal_train_recompute as check; "
            "check(CASES['f32-topp0.9']); print('full optimization: bitwise')")
    env = default_emitters_env(JAX_DISABLE_MOST_OPTIMIZATIONS="0",
                               JRL_TEST_FULL_OPTIMIZATION="1")
    assert _LEGACY_EMITTERS_FLAG not in env["XLA_FLAGS"].split()
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "full optimization: bitwise" in result.stdout
