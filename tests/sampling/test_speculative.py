"""Lossless speculative decoding (jrl.sampling.speculative; the n-gram lookup and the gate's
schedule alone are in test_drafts.py and test_draft_gate.py).

- the acceptance rules, in distribution: chi-square of many draws against the target q, each with
  a biased variant that the same test rejects (so the test can fail);
- end to end on a tiny model with a vocabulary of 4: the law of whole responses under
  speculative sampling against the exact law enumerated from the train forward, for
  temperature, top-k and top-p, with the n-gram draft and with a drawn (stochastic) draft;
- bitwise: with the n-gram draft, speculative decoding emits exactly what plain decoding emits
  (tokens, p_b, floors, entropies, versions), and p_b equals the train recompute (shuffled
  micro-batches, bf16, refills, weight swaps between device calls);
- a draft model inside the sampler: its cache after every step, the paused program, the gate
  switching it off, argmax and greedy drafts keeping plain decoding's samples.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import mtp, transformer
from jrl.sampling import DraftModel, Sampler, SamplingParams, SpeculativeConfig
from jrl.sampling import drafts as draft_sources
from jrl.sampling import speculative
from jrl.sampling import slots as slot_programs
from jrl.sampling.truncation import logit_floor, sample_from_floor

from .helpers import (ARCHS, CONFIG, MAX_PROMPT_LEN, NUM_SLOTS, PREFILL_BUCKETS, PROMPTS, TILES,
                      assert_same_samples, bits_equal, Case, contract, max_abs_diff, model_params,
                      poll_after, recompute_two_layouts, run, sampler, sampling, seat_prompts,
                      train_logprobs)

SPEC = SpeculativeConfig(num_draft=3)
P_VALUE = 1e-3     # a correct sampler fails one such test in a thousand runs


def test_speculative_config_validation():
    with pytest.raises(ValueError, match="draft='small'.*'ngram', 'draft_model'"):
        SpeculativeConfig(draft="small")
    with pytest.raises(ValueError, match="draft_catch_up=0"):
        SpeculativeConfig(draft="draft_model", draft_catch_up=0)
    with pytest.raises(ValueError, match="num_draft"):
        SpeculativeConfig(num_draft=0)
    with pytest.raises(ValueError, match="deltanet_rollback='undo'.*'settle', 'refeed'"):
        SpeculativeConfig(deltanet_rollback="undo")
    with pytest.raises(ValueError, match=r"draft_min_accept.*\[0, 1\]"):
        SpeculativeConfig(draft="draft_model", draft_min_accept=1.5)
    with pytest.raises(ValueError, match="draft_backoff=0"):
        SpeculativeConfig(draft="draft_model", draft_backoff=0)


# ---------------------------------------------------------------------------------------------
# The acceptance rules in distribution


def _target(temperature, top_k, top_p, vocab=12, seed=3):
    """Tempered logits z [V] of a skewed distribution, its floor and q = softmax over kept."""
    logits = jax.random.normal(jax.random.key(seed), (vocab,), jnp.float32) * 1.5
    z = logits * kernels.reference.inverse_temperature(temperature)
    floor = logit_floor(z[None], top_k=top_k, top_p=top_p)[0]
    q = np.asarray(jax.nn.softmax(jnp.where(z >= floor, z, -jnp.inf)), np.float64)
    return z, floor, q


def _chi2_p(counts, probs):
    """p-value of counts against probs (cells with expected < 5 merged into one)."""
    counts = np.asarray(counts, np.float64)
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if np.any(obs[~keep] > 0):
        return 0.0      # a draw outside the support
    obs, exp = obs[keep], exp[keep]
    return float(scipy_stats.chi2.sf(np.sum((obs - exp) ** 2 / exp), len(obs) - 1))


SAMPLING = {"t1": (1.0, 0, 1.0), "t0.7-topk5": (0.7, 5, 1.0), "t1.3-topp0.8": (1.3, 0, 0.8)}
DRAWS = 40_000


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_speculative_distribution_of_the_deterministic_rule(sampling):
    """A point-mass draft d: accept iff the sample's Gumbel-max draw x equals d, emit x. Its law
    is q whatever d is; "accept d when it is in the kept set" (a lenient rule) is not."""
    z, floor, q = _target(*sampling)
    keys = jax.random.split(jax.random.key(0), DRAWS)
    x = np.asarray(sample_from_floor(keys, jnp.broadcast_to(z, (DRAWS, z.size)),
                                     jnp.full((DRAWS,), floor)))
    draft = int(np.argsort(q)[-2])              # a likely but not the likeliest token
    accepted = x == draft
    assert abs(accepted.mean() - q[draft]) < 5 * np.sqrt(q[draft] * (1 - q[draft]) / DRAWS)
    assert _chi2_p(np.bincount(x, minlength=z.size), q) > P_VALUE
    # Control: accepting any kept draft with probability 1/2 and else emitting x is biased.
    lenient = np.where(np.random.default_rng(0).random(DRAWS) < 0.5, draft, x)
    assert _chi2_p(np.bincount(lenient, minlength=z.size), q) < P_VALUE


@pytest.mark.parametrize("sampling", SAMPLING.values(), ids=SAMPLING.keys())
def test_speculative_distribution_of_the_stochastic_rule(sampling):
    """Drafts drawn from p != q (a flatter distribution over the whole vocabulary), accepted
    by accept_stochastic: the emitted law is q. Resampling from q instead of the residual
    (a classic mistake) is biased and fails the same test."""
    z, floor, q = _target(*sampling)
    vocab = z.size
    p = np.asarray(jax.nn.softmax(z * 0.3), np.float64)
    keys = jax.random.split(jax.random.key(1), DRAWS)
    draft = np.random.default_rng(1).choice(vocab, size=DRAWS, p=p / p.sum()).astype(np.int32)
    token, accepted = speculative.accept_stochastic(
        keys, jnp.broadcast_to(z, (DRAWS, vocab)), jnp.full((DRAWS,), floor),
        jnp.asarray(draft), jnp.broadcast_to(jnp.asarray(p, jnp.float32), (DRAWS, vocab)))
    token, accepted = np.asarray(token), np.asarray(accepted)
    # P(accept) = sum_x p(x) min(1, q(x)/p(x)) = sum_x min(p(x), q(x)).
    rate = np.minimum(p, q).sum()
    assert abs(accepted.mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / DRAWS)
    assert _chi2_p(np.bincount(token, minlength=vocab), q) > P_VALUE
    # Control: on rejection draw from q itself (not the residual).
    plain = np.asarray(sample_from_floor(jax.random.split(jax.random.key(2), DRAWS),
                                         jnp.broadcast_to(z, (DRAWS, vocab)),
                                         jnp.full((DRAWS,), floor)))
    wrong = np.where(accepted, draft, plain)
    assert _chi2_p(np.bincount(wrong, minlength=vocab), q) < P_VALUE


# ---------------------------------------------------------------------------------------------
# End to end on a vocabulary of 4: the law of whole responses

SMALL = ARCHS["llama"].replace(vocab_size=4)
SMALL_PROMPT = (1, 2, 3, 1, 2)           # n-gram drafts exist from the first decode step on
SMALL_NEW = 4                            # the verify pass checks up to 2 drafts (+1 bonus)
SMALL_SAMPLES = 4096


@functools.lru_cache(maxsize=None)
def _small_params():
    params = transformer.init_params(SMALL, jax.random.key(5))
    return jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, params)


def _exact_law(temperature, top_k, top_p):
    """P(response) for every response in {0..3}^SMALL_NEW, from the train forward's logits:
    the product of each position's q = softmax of the tempered logits over {z >= floor}."""
    c = NumericalContract(**TILES)
    vocab = SMALL.vocab_size
    responses = np.stack(np.meshgrid(*[np.arange(vocab)] * SMALL_NEW, indexing="ij"),
                         -1).reshape(-1, SMALL_NEW)
    tokens = np.concatenate([np.broadcast_to(SMALL_PROMPT, (len(responses), len(SMALL_PROMPT))),
                             responses], axis=1)
    logits = transformer.forward_logits(_small_params(), SMALL, jnp.asarray(tokens), contract=c)
    p0 = len(SMALL_PROMPT) - 1
    law = np.ones(len(responses))
    for i in range(SMALL_NEW):
        z = logits[:, p0 + i] * kernels.reference.inverse_temperature(temperature)
        floor = logit_floor(z, top_k=top_k, top_p=top_p)
        q = np.asarray(jax.nn.softmax(jnp.where(z >= floor[:, None], z, -jnp.inf)), np.float64)
        law *= q[np.arange(len(responses)), responses[:, i]]
    return responses, law


@dataclasses.dataclass(frozen=True)
class UniformDraft:
    """A drawn draft for the tests: k tokens uniform over the vocabulary (a poor draft model),
    with their probabilities, from keys of (seed, prompt_id, sample_index, token index)."""

    vocab: int

    def propose(self, spec, params, state, num_draft, seed):
        del spec, params
        steps = state.num_generated[:, None] + jnp.arange(num_draft, dtype=jnp.int32)[None]
        slots = state.position.shape[0]
        keys = slot_programs.sample_keys(seed, jnp.repeat(state.prompt_id, num_draft),
                                       jnp.repeat(state.sample_index, num_draft),
                                       steps.reshape(-1))
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 7))(keys)
        tokens = jax.vmap(lambda k: jax.random.randint(k, (), 0, self.vocab))(keys)
        probs = jnp.full((slots, num_draft, self.vocab), 1.0 / self.vocab, jnp.float32)
        return draft_sources.Drafts(tokens.reshape(slots, num_draft).astype(jnp.int32),
                                  jnp.full((slots,), num_draft, jnp.int32), probs)


@functools.lru_cache(maxsize=None)
def _small_draft() -> DraftModel:
    """A one-layer draft for SMALL with weights of its own (scaled like the target's, so its
    distribution is peaked too, and differs from the target's: drafts are often rejected)."""
    config = SMALL.replace(num_layers=1)
    params = transformer.init_params(config, jax.random.key(9))
    return DraftModel(config, jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, params))


@functools.lru_cache(maxsize=None)
def _small_mtp_head() -> mtp.MtpHead:
    """A random MTP head for SMALL (scaled like the target: peaked, often rejected drafts)."""
    params = mtp.init_params(SMALL, jax.random.key(8))
    return mtp.MtpHead(jax.tree.map(lambda x: x * 6.0 if x.ndim >= 2 else x, params))


END_TO_END = {
    "ngram-t1.3-topp0.8": ("ngram", 1.3, 0, 0.8),
    # A draft model's drawn drafts through accept_stochastic: the emitted law is the target's.
    "draft_model-t0.8-topk3": ("draft_model", 0.8, 3, 1.0),
    # The MTP head's drawn drafts (its own cache, fed the target's hidden states).
    "mtp-t1.2-topp0.9": ("mtp", 1.2, 0, 0.9),
    # Each further case compiles a 256-slot sampler of its own.
    "ngram-t1": pytest.param(("ngram", 1.0, 0, 1.0), marks=pytest.mark.slow),
    "ngram-t0.7-topk3": pytest.param(("ngram", 0.7, 3, 1.0), marks=pytest.mark.slow),
    "drawn-t0.8-topp0.9": pytest.param(("drawn", 0.8, 0, 0.9), marks=pytest.mark.slow),
}
END_TO_END_IDS = list(END_TO_END)


@pytest.mark.parametrize("case", END_TO_END.values(), ids=END_TO_END_IDS)
def test_speculative_distribution_end_to_end_exact_enumeration(case):
    draft, temperature, top_k, top_p = case
    source = {"drawn": UniformDraft(SMALL.vocab_size), "draft_model": _small_draft(),
              "mtp": _small_mtp_head()}.get(draft, draft)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_new_tokens=SMALL_NEW, seed=11)
    s = Sampler(SMALL, NumericalContract(**TILES), params, num_slots=256,
                max_prompt_len=len(SMALL_PROMPT), steps_per_call=SMALL_NEW,
                speculative=SpeculativeConfig(draft=source, num_draft=3, draft_catch_up=2))
    samples = s.generate(_small_params(), [(0, SMALL_PROMPT)], group_size=SMALL_SAMPLES)
    stats = s.last_stats
    # Drafts were verified, some accepted and some rejected: the rule was exercised.
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
    responses, law = _exact_law(temperature, top_k, top_p)
    index = {tuple(r): i for i, r in enumerate(responses)}
    counts = np.zeros(len(responses))
    for x in samples:
        counts[index[tuple(x.tokens.tolist())]] += 1
    assert _chi2_p(counts, law) > P_VALUE


# ---------------------------------------------------------------------------------------------
# Bitwise: speculative == plain decoding, p_b == p_o

BITWISE = {
    "f32-t1": Case(),
    "qwen3moe-f32-topp0.9": Case(arch="qwen3_moe", top_p=0.9),
    "f32-topp0.9": Case(top_p=0.9),
    "bf16-t0.7-topk8-topp0.95": Case(dtype="bfloat16", temperature=0.7, top_k=8, top_p=0.95),
    # Qwen3.5's hybrid: the verify pass settles Gated DeltaNet's cache to the kept tokens.
    "qwen35-f32-t1": Case(arch="qwen35"),
}
# The dense f32 case and the hybrid run by default (CI time); each other case compiles samplers
# of its own, the MoE one (routes recorded by the verify pass) the costliest.
DEFAULT_TIER = ("f32-t1", "qwen35-f32-t1")
BITWISE_PARAMS = [case if name in DEFAULT_TIER else pytest.param(case, marks=pytest.mark.slow)
                  for name, case in BITWISE.items()]


@functools.lru_cache(maxsize=None)
def _speculative_run(case: Case, spec: SpeculativeConfig = SPEC):
    s = sampler(case.backend, case.dtype, temperature=case.temperature, top_p=case.top_p,
                top_k=case.top_k, arch=case.arch, speculative=spec)
    samples = s.generate(model_params(0, case.arch), PROMPTS)
    return samples, dict(s.last_stats)


@pytest.mark.parametrize("case", BITWISE_PARAMS, ids=BITWISE.keys())
def test_bitwise_speculative_same_samples_as_plain_decoding(case):
    plain, plain_stats = run(case)
    samples, stats = _speculative_run(case)
    assert_same_samples(plain, samples)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
    # Each slot step emits one token plus its accepted drafts, and the batch never runs more
    # steps than plain decoding. (Whether the batch's own count drops depends on where the
    # few acceptances fall: random weights accept few n-gram drafts, 3 of 63 in f32-t1.)
    assert stats["spec_slot_steps"] == stats["spec_emitted"] - stats["spec_accepted"]
    assert stats["decode_steps"] <= plain_stats["decode_steps"]
    assert stats["refills_while_busy"] >= 1
    for x in samples:
        assert x.spec is not None and x.spec.accepted <= x.spec.drafted
        # Every token after the prefill's first came from a decode step.
        assert x.spec.emitted == x.length - 1


@pytest.mark.slow
def test_bitwise_speculative_hybrid_refeed_and_a_window_wider_than_a_delta_chunk():
    # k + 1 = delta_chunk + 1 (9 on a CPU): the DeltaNet window cannot be settled, so the step
    # feeds the kept tokens again; the samples are still plain decoding's.
    case = BITWISE["qwen35-f32-t1"]
    plain, _ = run(case)
    samples, stats = _speculative_run(case, SpeculativeConfig(num_draft=TILES["delta_chunk"]))
    assert_same_samples(plain, samples)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
    # The refeed asked for at a settleable width: the same samples again.
    refed, _ = _speculative_run(case, dataclasses.replace(SPEC, deltanet_rollback="refeed"))
    assert_same_samples(plain, refed)


@pytest.mark.parametrize("case", [BITWISE["f32-t1"], pytest.param(
    BITWISE["bf16-t0.7-topk8-topp0.95"], marks=pytest.mark.slow)], ids=["f32", "bf16"])
def test_bitwise_speculative_logprobs_equal_train_recompute(case):
    samples, _ = _speculative_run(case)
    first, second = recompute_two_layouts(model_params(0, case.arch), samples,
                                          contract(case.backend, case.dtype), case.temperature,
                                          arch=case.arch)
    p_b = [s.behavior_logp for s in samples]
    assert max_abs_diff(p_b, first) == 0.0 and max_abs_diff(p_b, second) == 0.0
    for i in range(len(samples)):
        assert bits_equal(p_b[i], first[i]) and bits_equal(p_b[i], second[i]), i


# The settle test's geometry, in units of the delta chunk C (8 on a CPU, 16 on a GPU): prompts
# of up to 2C tokens, then 5 more.
CHUNK = TILES["delta_chunk"]
CAPACITY = 4 * CHUNK


@functools.lru_cache(maxsize=None)
def _hybrid_calls(dtype: str):
    """Jitted (prefill, verify with a pending DeltaNet window + settle, masked verify) on the
    tiny hybrid (delta_chunk CHUNK)."""
    config, c = ARCHS["qwen35"], contract("pallas", dtype)

    @jax.jit
    def prefill(params, prompt, lengths):
        positions = jnp.broadcast_to(jnp.arange(prompt.shape[1], dtype=jnp.int32), prompt.shape)
        cache = transformer.init_cache(config, prompt.shape[0], CAPACITY, c)
        return transformer.forward(params, config, prompt, contract=c, positions=positions,
                                   mask=positions < lengths[:, None], cache=cache).cache

    def feed(params, cache, tokens, keep, pending):
        offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return transformer.forward(params, config, tokens, contract=c,
                                   positions=cache.lengths[:, None] + offsets,
                                   mask=offsets < keep[:, None], cache=cache, pending=pending)

    @jax.jit
    def settled(params, cache, tokens, keep):
        full = jnp.full(keep.shape, tokens.shape[1], jnp.int32)
        return transformer.settle_cache(config, feed(params, cache, tokens, full, True).cache,
                                        cache, keep)

    @jax.jit
    def masked(params, cache, tokens, keep):
        return feed(params, cache, tokens, keep, False).cache

    return prefill, settled, masked


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_bitwise_speculative_settled_deltanet_cache_equals_feeding_the_kept_tokens(dtype):
    """The verify pass's rollback: feeding T = 5 tokens with the DeltaNet window pending, then
    keeping the first `keep` of them, leaves the DeltaNet cache (conv inputs, chunk-start
    state, current chunk rows) of feeding only those `keep` tokens, bit for bit, for every
    keep in 0..5. Prompt lengths C, 2C - 5, 2C - 3, 2C - 1 (8, 11, 13, 15 for delta_chunk
    C = 8) put the verify window at chunk offsets 0, C - 5, C - 3, C - 1: the second ends
    exactly at the boundary (C - 5 + 5 = C), and the last two cross it, so keep < 3 (offset
    C - 3) or keep < 1 (offset C - 1) needs the pre-verify state back, while larger keeps need
    the state the pass itself computed."""
    prefill, settled, masked = _hybrid_calls(dtype)
    params = model_params(0, "qwen35")
    lengths = jnp.asarray([CHUNK, 2 * CHUNK - 5, 2 * CHUNK - 3, 2 * CHUNK - 1], jnp.int32)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(2, ARCHS["qwen35"].vocab_size, (4, 2 * CHUNK)), jnp.int32)
    cache = prefill(params, prompt, lengths)
    tokens = jnp.asarray(rng.integers(2, ARCHS["qwen35"].vocab_size, (4, 5)), jnp.int32)
    deltanet_keys = [transformer.KIND_PARAM_KEYS[kind] for kind in ARCHS["qwen35"].kinds
                     if kind[0] == "deltanet"]
    assert deltanet_keys
    for keep in range(6):
        # Every row keeps a different count (keep, keep+1, .. mod 6), so rows of one call
        # disagree on which state they take.
        keeps = jnp.asarray([(keep + i) % 6 for i in range(4)], jnp.int32)
        got, want = settled(params, cache, tokens, keeps), masked(params, cache, tokens, keeps)
        for key in deltanet_keys:
            for name in want.layers[key]:
                assert bits_equal(np.asarray(got.layers[key][name]),
                                  np.asarray(want.layers[key][name])), (keep, key, name)
    # A window wider than one chunk cannot be settled this way (the verify step feeds again).
    with pytest.raises(ValueError, match="delta_chunk"):
        transformer.forward(params, ARCHS["qwen35"], jnp.zeros((4, CHUNK + 1), jnp.int32),
                            contract=contract("pallas", dtype), cache=cache, pending=True)


@pytest.mark.parametrize("recompute_kv", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["keep_kv", "recompute_kv"])
def test_bitwise_speculative_weight_swap(recompute_kv):
    """New weights arrive between device calls, i.e. between two speculative steps (a step
    drafts and verifies under one set of weights). Tokens before the swap are those of the
    unswapped run; version-0 tokens are the old weights' full forward; samples started after
    the swap are the new weights' full forward; with recompute_kv_on_swap so is every
    version-1 token. The same holds for plain decoding with the same swap (its call
    boundaries differ, so its samples do)."""
    old, new = model_params(0), model_params(1)
    f32 = contract("pallas", "float32")
    s = sampler(recompute_kv_on_swap=recompute_kv, speculative=SPEC)
    samples = s.generate(old, PROMPTS, poll_weights=poll_after(3, new))
    spanning = [x for x in samples if 0 < np.sum(x.versions == 1) < x.length]
    assert spanning and any(np.all(x.versions == 1) for x in samples)
    unswapped = {(x.prompt_id, x.sample_index): x for x in _speculative_run(Case())[0]}
    order = range(len(samples))
    full_old = train_logprobs(old, samples, f32, 1.0, order=order, batch=len(samples), length=30)
    full_new = train_logprobs(new, samples, f32, 1.0, order=order, batch=len(samples), length=30)
    for x, lp_old, lp_new in zip(samples, full_old, full_new):
        v0, v1 = x.versions == 0, x.versions == 1
        assert np.all(np.diff(x.versions) >= 0)
        ref = unswapped[(x.prompt_id, x.sample_index)]
        n0 = int(v0.sum())
        assert np.array_equal(x.tokens[:n0], ref.tokens[:n0])
        assert bits_equal(x.behavior_logp[v0], lp_old[v0])
        if np.all(v1):
            assert bits_equal(x.behavior_logp, lp_new)
        elif recompute_kv and v1.any():
            assert bits_equal(x.behavior_logp[v1], lp_new[v1])


# ---------------------------------------------------------------------------------------------
# A draft model (SpeculativeConfig(draft=DraftModel(config, params)))

# Pauses of 2, 4, 8 .. steps: the few steps of a test see drafts switched off and probed again.
DRAFT_SPEC = SpeculativeConfig(draft="draft_model", num_draft=3, draft_catch_up=4,
                               draft_backoff=2)
# Drafting at every step, however poor the draft (the tests of the rules, not of the gate).
ALWAYS_DRAFT = dataclasses.replace(DRAFT_SPEC, draft_min_accept=0.0)
# A one-layer draft of the tiny Llama with weights of its own: its drafts are often rejected.
DRAFT_CONFIG = CONFIG.replace(num_layers=1)


@functools.lru_cache(maxsize=None)
def _other_draft(arch: str = "llama") -> DraftModel:
    """A draft with weights of its own: the one-layer Llama, or the tiny Qwen3.5 hybrid (a Gated
    DeltaNet draft, rolled back by feeding its kept tokens again)."""
    if arch == "llama":
        params = transformer.init_params(DRAFT_CONFIG, jax.random.key(3))
        return DraftModel(DRAFT_CONFIG, jax.tree.map(
            lambda x: x * 15.0 if x.ndim >= 2 else x, params))
    return DraftModel(ARCHS[arch], model_params(3, arch))


def _draft_sampler(draft: DraftModel, target: str = "llama",
                   spec: SpeculativeConfig = DRAFT_SPEC, **sampling_changes) -> Sampler:
    return Sampler(ARCHS[target], contract(arch=target), sampling(**sampling_changes),
                   num_slots=NUM_SLOTS,
                   max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4, return_entropy=True,
                   speculative=dataclasses.replace(spec, draft=draft),
                   prefill_buckets=PREFILL_BUCKETS)


def test_speculative_draft_model_validation():
    make = functools.partial(Sampler, CONFIG, contract(), sampling(), num_slots=2,
                             max_prompt_len=4)
    with pytest.raises(ValueError, match=r"names a kind of draft; give the draft itself: "
                                         r"SpeculativeConfig\(draft=DraftModel"):
        make(speculative=DRAFT_SPEC)
    with pytest.raises(ValueError, match="SpeculativeConfig.draft: a tuple is none of"):
        dataclasses.replace(DRAFT_SPEC, draft=(DRAFT_CONFIG, None))
    with pytest.raises(ValueError, match="vocab_size 48 differs from the target's 32"):
        make(speculative=dataclasses.replace(
            DRAFT_SPEC, draft=DraftModel(DRAFT_CONFIG.replace(vocab_size=48), None)))


@functools.lru_cache(maxsize=None)
def _draft_run(draft_name: str, target: str = "llama", spec: SpeculativeConfig = DRAFT_SPEC,
               **sampling_changes):
    draft = _other_draft() if draft_name == "other" else DraftModel(CONFIG, model_params(0))
    s = _draft_sampler(draft, target, spec, **sampling_changes)
    samples = s.generate(model_params(0, target), PROMPTS)
    return samples, dict(s.last_stats)


def test_bitwise_speculative_draft_model_that_is_the_target_accepts_every_draft():
    """The target drafting for itself: the draft's p at every drafted token is computed from
    the draft cache (prompt fed in chunks of draft_catch_up = 4 < 8 tokens, then one token at a
    time, with the bonus token of every fully accepted step fed on the next), the target's q
    from its own verify pass. The kernels are stage consistent, so p == q bit for bit exactly
    when that cache holds the slot's history, and then u * p(d) < q(d) accepts every draft:
    one wrong position would make p != q and reject some. No stop tokens, so no sample stops
    inside a step's drafts (which would count its later drafts as not accepted)."""
    samples, stats = _draft_run("self", stop_tokens=())
    assert stats["spec_drafted"] > 0
    assert stats["spec_accepted"] == stats["spec_drafted"]
    for x in samples:
        # 15 tokens after the prefill's first, k + 1 = 4 per step but the last (room 3 at 12).
        assert x.spec.emitted == x.length - 1 == 15 and x.spec.steps == 4


@pytest.mark.parametrize("target", ["llama", pytest.param("qwen35", marks=pytest.mark.slow)])
def test_bitwise_speculative_draft_model_logprobs_equal_train_recompute(target):
    # The hybrid target settles its DeltaNet cache to the accepted drafts inside verify.
    samples, stats = _draft_run("other", target)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]      # rejections happened
    assert stats["refills_while_busy"] >= 1                        # the cache restarted
    first, second = recompute_two_layouts(model_params(0, target), samples,
                                          contract(arch=target), 1.0, arch=target)
    p_b = [x.behavior_logp for x in samples]
    for i in range(len(samples)):
        assert bits_equal(p_b[i], first[i]) and bits_equal(p_b[i], second[i]), i


@pytest.mark.parametrize("draft_arch", ["llama", "qwen35"])
def test_bitwise_speculative_draft_model_cache_holds_the_history_after_every_step(draft_arch):
    """The draft cache after each speculative step of a draft that is often rejected: for
    every decoding slot, lengths is its position or one less (a fully accepted step's bonus
    token is fed on the next step), and its cache equals, bit for bit, one forward of the
    draft over the slot's history (attention K/V below lengths; Gated DeltaNet's conv inputs,
    chunk-start state and chunk rows whole): rejected drafts were rolled back (by length, or
    for the hybrid draft by feeding the kept tokens again), catch-up filled the rest."""
    draft = _other_draft(draft_arch)
    draft_config = draft.config
    s = _draft_sampler(draft)
    spec, params = s.programs.spec, model_params(0)
    state = seat_prompts(s, params)

    @jax.jit
    def fresh_cache(history, lengths):
        positions = jnp.broadcast_to(jnp.arange(spec.capacity, dtype=jnp.int32), history.shape)
        cache = transformer.init_cache(draft_config, NUM_SLOTS, spec.capacity, spec.contract)
        return transformer.forward(draft.params, draft_config, history, contract=spec.contract,
                                   positions=positions, mask=positions < lengths[:, None],
                                   cache=cache).cache

    deltanet = {transformer.KIND_PARAM_KEYS[kind] for kind in draft_config.kinds
                if kind[0] == "deltanet"}

    rejected = paused = resumed = free = 0
    was_paused = np.zeros(NUM_SLOTS, bool)
    for _ in range(16):
        active = np.asarray(state.active)
        if not active.any():
            break
        # Once some slot's gate is open, every active slot drafts (draft_gate.step_drafters).
        gated = active & (np.asarray(state.draft_gate.skip) == 0)
        drafting = active & gated.any()
        free += int(np.sum(drafting & ~gated))
        resumed += int(np.sum(drafting & was_paused))
        lengths_before = np.asarray(state.draft_cache.lengths)
        state, _, counts = speculative.decode(spec, DRAFT_SPEC, params, draft.params, state,
                                              jnp.int32(0), jnp.uint32(7), jnp.int32(1),
                                              jnp.bool_(False))
        drafted, accepted = np.asarray(counts.drafted), np.asarray(counts.accepted)
        rejected += int(np.sum(active & (accepted < drafted)))
        lengths = np.asarray(state.draft_cache.lengths)
        position = np.asarray(state.position)
        live = np.asarray(state.active) & drafting
        assert np.all((position[live] - lengths[live] >= 0)
                      & (position[live] - lengths[live] <= 1))
        # In a step where every slot's draft is switched off (the gate: paused_decode), no
        # slot drafted and every draft cache was left as it was; each catches up when it
        # drafts again.
        off = active & ~drafting
        paused += int(np.sum(off))
        was_paused = (was_paused | off) & ~drafting
        assert np.all(drafted[off] == 0) and np.all(lengths[off] == lengths_before[off])
        want = fresh_cache(state.history, state.draft_cache.lengths)
        for key, layer in want.layers.items():
            for name, value in layer.items():
                got = np.asarray(state.draft_cache.layers[key][name])
                for slot in np.flatnonzero(active):
                    n = None if key in deltanet else lengths[slot]
                    assert bits_equal(got[:, slot, :n], np.asarray(value)[:, slot, :n]), (
                        key, name, slot)
    # Rollbacks happened. (The bonus token's lag is what the self-draft test checks: this
    # draft seldom has all of a step's drafts accepted.)
    assert rejected > 0
    # The gate switched this poor draft off for the whole batch (paused_decode steps), slots
    # drafted again after a pause, catching up on the history they had not seen (checked
    # above), and paused slots drafted in steps that another slot's open gate made drafting
    # steps (step_drafters).
    assert paused > 0 and resumed > 0 and free > 0, (paused, resumed, free)


def test_bitwise_speculative_draft_model_paused_slots_run_the_plain_program():
    """While every active slot is paused, speculative.decode runs paused_decode: plain steps
    up to the first pause's end, the draft model not run, its caches untouched; then the
    drafting program, which returns once every slot is paused again.

    Skips [3, 5, 7, 9, ...] (slot i: 3 + 2i): a call of 16 steps runs min = 3 plain steps,
    each slot emits 3 tokens and drafts none, skips become [0, 2, 4, 6, ...]. The tokens and
    p_b are those of 3 steps of slots.decode from the same state, bit for bit. The next call
    drafts (slot 0's skip is 0) with draft_min_accept = 1 (any rejected draft pauses the
    slot): slot 0's open gate makes each step a drafting step for every active slot, and the
    call ends, before its 16 steps, at the step where no gate is open again, or at a finish.
    The gates' shared clock counts both calls' steps."""
    draft = _other_draft()
    spec_config = dataclasses.replace(DRAFT_SPEC, draft_min_accept=1.0)
    s = _draft_sampler(draft, spec=spec_config)
    spec, params = s.programs.spec, model_params(0)
    seated = seat_prompts(s, params)
    skips = 3 + 2 * jnp.arange(NUM_SLOTS, dtype=jnp.int32)
    seated = seated._replace(draft_gate=seated.draft_gate._replace(skip=skips))
    host = jax.device_get(seated)
    version, seed = jnp.int32(0), jnp.uint32(7)

    assert not speculative.any_drafting(seated)
    state, steps, counts = speculative.decode(spec, spec_config, params, draft.params,
                                              jax.device_put(host), version, seed,
                                              jnp.int32(16), jnp.bool_(False))
    assert int(steps) == 3
    np.testing.assert_array_equal(np.asarray(counts.drafted), 0)
    np.testing.assert_array_equal(np.asarray(counts.emitted), 3)
    np.testing.assert_array_equal(np.asarray(counts.steps), 3)
    np.testing.assert_array_equal(np.asarray(state.draft_gate.skip), np.asarray(skips) - 3)
    assert int(state.draft_gate.clock) == 3
    for key, layer in host.draft_cache.layers.items():
        for name, value in layer.items():
            assert bits_equal(np.asarray(state.draft_cache.layers[key][name]), value), name
    plain, plain_steps = slot_programs.decode(spec, params, jax.device_put(host), version, seed,
                                              jnp.int32(3), jnp.bool_(False))
    assert int(plain_steps) == 3
    for field in ("history", "tokens", "logp", "floor", "num_generated", "position"):
        assert bits_equal(np.asarray(getattr(state, field)), np.asarray(getattr(plain, field))), \
            field

    assert speculative.any_drafting(state)
    state, steps, counts = speculative.decode(spec, spec_config, params, draft.params, state,
                                              version, seed, jnp.int32(16), jnp.bool_(False))
    steps, drafted = int(steps), np.asarray(counts.drafted)
    # Slot 0's open gate makes every step a drafting step, for the paused slots too
    # (draft_gate.step_drafters): each drafted 3 per step it was active.
    assert drafted[0] == 3 * steps and np.all(drafted[1:] <= 3 * steps), (steps, drafted)
    assert np.all(drafted[1:] > 0), drafted
    assert 1 <= steps < 16
    finished = not bool(np.asarray(state.active)[0])
    assert finished or not speculative.any_drafting(state)
    # Paused again with P = draft_backoff = 2 (its first miss): until the clock's next even
    # step at least ceil(2 / 2) = 1 step on, so 1 or 2 steps.
    skip, clock = int(np.asarray(state.draft_gate.skip)[0]), int(state.draft_gate.clock)
    assert clock == 3 + steps
    assert finished or (skip in (1, 2) and (clock + skip) % 2 == 0), (skip, clock)


def test_bitwise_speculative_draft_model_argmax_drafts_same_samples_as_plain_decoding():
    # draft_pick="argmax" at temperature 1: a point mass accepted by the sample's own draw.
    samples, stats = _draft_run("other", spec=dataclasses.replace(ALWAYS_DRAFT,
                                                                  draft_pick="argmax"))
    assert_same_samples(run(Case()).samples, samples)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]


def test_bitwise_speculative_draft_model_greedy_same_samples_as_plain_decoding():
    # Greedy: the draft proposes its argmax (a point mass) and the target's own argmax decides,
    # so speculative decoding emits plain decoding's samples, bit for bit.
    plain = sampler(greedy=True)
    want = plain.generate(model_params(0), PROMPTS)
    samples, stats = _draft_run("other", spec=ALWAYS_DRAFT, greedy=True)
    assert_same_samples(want, samples)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
