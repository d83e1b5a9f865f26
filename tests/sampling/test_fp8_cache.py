"""An FP8 KV cache on the one numerical path (NumericalContract.kv_dtype="float8_e4m3fn").

The sampler's cache stores each token's keys and values of each KV head as float8_e4m3fn with a
power-of-two scale (jrl.kernels.fp8), and attends over them read back in the compute dtype; the
train forward passes its keys and values through the same quantise-and-read-back. So p_b == p_o
bit for bit holds as with a compute-dtype cache: for every family with attention with slot
refills (tests/sampling/test_bitwise.py's fp8kv cases), and here with shared prefill,
self-speculation, a weight swap with the KV recomputed, and multi-turn appends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.sampling import Sampler, SpeculativeConfig

from .helpers import (ARCHS, CONFIG, MAX_PROMPT_LEN, PREFILL_BUCKETS, PROMPTS, Case,
                      assert_same_samples, bits_equal, max_abs_diff, model_params, poll_after,
                      recompute_two_layouts, run, sampler, sampling, train_logprobs)
from .test_multiturn import MAX_NEW, MAX_OBS, STOPS, Tools

FP8 = "float8_e4m3fn"
DENSE = Case("pallas", "bfloat16", 1.0, 0.9, kv_dtype=FP8)


def test_fp8_cache_changes_the_numbers_it_attends_over():
    """The quantisation acts: the same samples' train forward over an FP8 cache's tokens gives
    other logprobs than over compute-dtype keys and values (so test_bitwise.py's fp8kv cases
    are not the compute-dtype path's)."""
    samples, _ = run(DENSE)
    params = model_params(0)
    order = range(len(samples))
    fp8 = train_logprobs(params, samples, DENSE.contract(), 1.0, order=order,
                         batch=len(samples), length=30)
    plain = train_logprobs(params, samples, DENSE._replace(kv_dtype="compute").contract(), 1.0,
                           order=order, batch=len(samples), length=30)
    assert max_abs_diff(fp8, plain) > 0.0


def test_fp8_cache_holds_one_byte_per_entry_and_one_exponent_per_token_and_head():
    """The tiny Llama (2 layers, 1 KV head of 16) on 4 slots of capacity 16 (two 8-position
    KV tiles): per layer, slot and position, k and v take 16 bytes each plus a 1-byte exponent,
    2 * (16 + 1) = 34 bytes, against 2 * 16 * 2 = 64 in bfloat16 and 128 in float32."""
    def cache_bytes(contract):
        cache = transformer.init_cache(CONFIG, 4, 16, contract)
        return sum(x.nbytes for x in jax.tree.leaves(cache.layers))

    fp8 = DENSE.contract()
    assert cache_bytes(fp8) == 2 * 4 * 16 * 34             # layers x slots x positions x bytes
    assert cache_bytes(fp8.replace(kv_dtype="compute")) == 2 * 4 * 16 * 64
    assert cache_bytes(fp8.replace(kv_dtype="compute", compute_dtype="float32")) == \
        2 * 4 * 16 * 128
    layers = transformer.init_cache(CONFIG, 4, 16, fp8).layers["layers"]
    assert layers["k"].dtype == jnp.float8_e4m3fn and layers["k_exp"].dtype == jnp.int8
    assert layers["k_exp"].shape == layers["k"].shape[:-1]


def test_fp8_cache_shared_prefill_gives_identical_samples():
    reference, _ = run(DENSE)
    shared = sampler("pallas", "bfloat16", top_p=0.9, kv_dtype=FP8, share_prefill=True,
                     prefix_pool_rows=len(PROMPTS))
    assert_same_samples(reference, shared.generate(model_params(0), PROMPTS))
    assert shared.last_stats["prefix_hits"] > 0


def test_fp8_cache_self_speculative_samples_are_plain_exact_decodings():
    """The fast path drafts over the same FP8 cache layout (its contract keeps kv_dtype) and the
    exact pass overwrites every entry it verifies: the samples are plain FP8 decoding's."""
    reference, _ = run(DENSE)
    fast = SpeculativeConfig(draft="fast_path", num_draft=3, draft_min_accept=0.0)
    s = sampler("pallas", "bfloat16", top_p=0.9, kv_dtype=FP8, speculative=fast)
    assert_same_samples(reference, s.generate(model_params(0), PROMPTS))
    assert s.last_stats["spec_accepted"] > 0


def test_fp8_cache_weight_swap_with_recomputed_kv_is_each_versions_forward():
    """A swap mid-generation with the KV recomputed: version-0 tokens are the old weights'
    train forward, version-1 tokens the new weights' (over the new weights' FP8 keys)."""
    old, new = model_params(0), model_params(1)
    c = DENSE.contract()
    s = sampler("pallas", "bfloat16", top_p=0.9, kv_dtype=FP8, recompute_kv_on_swap=True)
    samples = s.generate(old, PROMPTS, poll_weights=poll_after(3, new))
    assert s.last_stats["refreshes"] == 1
    assert any(0 < np.sum(x.versions == 1) < x.length for x in samples), "swap mid-sample"
    order = range(len(samples))
    full_old = train_logprobs(old, samples, c, 1.0, order=order, batch=len(samples), length=30)
    full_new = train_logprobs(new, samples, c, 1.0, order=order, batch=len(samples), length=30)
    for x, lp_old, lp_new in zip(samples, full_old, full_new):
        v0, v1 = x.versions == 0, x.versions == 1
        assert bits_equal(x.behavior_logp[v0], lp_old[v0])
        assert bits_equal(x.behavior_logp[v1], lp_new[v1])


def test_fp8_cache_multiturn_model_tokens_equal_train_forward_bitwise():
    """Observations appended into an FP8 cache between turns: each model token's p_b is the
    train forward's over the whole episode."""
    c = DENSE.contract()
    s = Sampler(CONFIG, c, sampling(max_new_tokens=MAX_NEW, stop_tokens=STOPS),
                num_slots=4, max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4,
                max_observation_len=MAX_OBS, prefill_buckets=PREFILL_BUCKETS)
    samples = s.generate(model_params(0), PROMPTS, on_turn=Tools())
    assert s.last_stats["appends"] >= 4
    logp = train_logprobs(model_params(0), samples, c, 1.0, order=range(len(samples))[::-1],
                          batch=len(samples), length=40)
    for i, x in enumerate(samples):
        mask = x.model_token_mask()
        assert bits_equal(x.behavior_logp[mask], logp[i][mask]), i


def test_fp8_cache_xla_control_differs():
    """The plain-XLA kernels with the same FP8 cache: the quantised numbers agree (the same
    quantiser), the reductions do not, and p_b != p_o."""
    case = Case("xla", "float32", 1.0, 0.9, kv_dtype=FP8)
    samples, _ = run(case)
    first, second = recompute_two_layouts(model_params(0), samples, case.contract(), 1.0)
    p_b = [s.behavior_logp for s in samples]
    assert max(max_abs_diff(p_b, first), max_abs_diff(p_b, second)) > 0.0


def test_fp8_kv_dtype_is_a_validated_contract_field():
    with pytest.raises(ValueError, match=r"NumericalContract.kv_dtype.*float8_e4m3fn"):
        NumericalContract(kv_dtype="float8_e5m2")
    c = NumericalContract(kv_dtype=FP8)
    assert NumericalContract.from_dict(c.to_dict()) == c
    # A contract recorded before the field existed reads as the compute-dtype cache.
    old = {k: v for k, v in c.to_dict().items() if k != "kv_dtype"}
    assert NumericalContract.from_dict(old).kv_dtype == "compute"
    with pytest.raises(ValueError, match=r"kv_dtype: 'float8_e4m3fn' != 'compute'"):
        c.check_compatible(NumericalContract())
    assert ARCHS["llama"].num_kv_heads == 1        # the bytes test's arithmetic
