"""Speculative decoding with the target's multi-token-prediction head (draft="mtp").

With draft_pick="argmax" the head's drafts are a point mass, so the samples must be plain
decoding's bit for bit; drawn drafts (the default) give other samples of the same law (the
exact-enumeration test in test_speculative.py), and p_b is the train recompute's either way.
The head's bits never reach a sample, so a bookkeeping bug (a wrong hidden state, a stale
cache entry, a draft fed at the wrong position) would only lower the acceptance rate: the cache test below checks the head's inputs and cache against a
fresh full pass after every step, through a refill, an appended observation and a weight swap.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import mtp, transformer
from jrl.sampling import Sampler, SpeculativeConfig, speculative
from jrl.sampling import drafts as draft_sources
from jrl.sampling import slots as slot_programs

from .helpers import (ARCHS, MAX_PROMPT_LEN, NUM_SLOTS, PREFILL_BUCKETS, PROMPTS, Case,
                      assert_same_samples, bits_equal, contract, model_params,
                      recompute_two_layouts, run, sampling, seat_prompts)

# Drafting at every step (the gate is the draft model's tests' subject), k = 3.
MTP_SPEC = SpeculativeConfig(draft="mtp", num_draft=3, draft_catch_up=4, draft_min_accept=0.0,
                             draft_pick="argmax")
DRAWN = dataclasses.replace(MTP_SPEC, draft_pick="draw")


@functools.lru_cache(maxsize=None)
def _head(arch: str = "llama", seed: int = 5) -> mtp.MtpHead:
    """A random head, its weights scaled up like model_params' (peaked, position-dependent
    drafts; a vocabulary of 32 gives some by chance)."""
    params = mtp.init_params(ARCHS[arch], jax.random.key(seed))
    return mtp.MtpHead(jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, params))


def _sampler(arch="llama", spec=MTP_SPEC, share_prefill=False, **changes) -> Sampler:
    return Sampler(ARCHS[arch], contract(arch=arch), sampling(**changes), num_slots=NUM_SLOTS,
                   max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4, return_entropy=True,
                   speculative=None if spec is None else dataclasses.replace(
                       spec, draft=_head(arch)), share_prefill=share_prefill,
                   prefill_buckets=PREFILL_BUCKETS)


@functools.lru_cache(maxsize=None)
def _mtp_run(arch: str, share_prefill: bool = False, spec: SpeculativeConfig = MTP_SPEC):
    s = _sampler(arch, spec, share_prefill=share_prefill)
    samples = s.generate(model_params(0, arch), PROMPTS)
    return samples, dict(s.last_stats)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_bitwise_speculative_mtp_same_samples_as_plain_decoding(arch):
    plain, plain_stats = run(Case(arch=arch))
    samples, stats = _mtp_run(arch)
    assert_same_samples(plain, samples)
    # A random head's drafts are accepted by chance (a vocabulary of 32): fewer steps for the
    # dense model; the hybrid's samples are as long as the longest plain one allows.
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
    assert stats["decode_steps"] <= plain_stats["decode_steps"]
    assert stats["refills_while_busy"] >= 1
    for x in samples:
        assert x.spec.emitted == x.length - 1
    first, second = recompute_two_layouts(model_params(0, arch), samples, contract(arch=arch),
                                          1.0, arch=arch)
    for i, x in enumerate(samples):
        assert bits_equal(x.behavior_logp, first[i]) and bits_equal(x.behavior_logp, second[i])


def test_bitwise_speculative_mtp_drawn_drafts_logprobs_equal_train_recompute():
    """Drawn drafts, accepted by rejection sampling: other samples than plain decoding's (the
    same law), each token's p_b the trainer's, bit for bit."""
    samples, stats = _mtp_run("llama", spec=DRAWN)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
    plain = run(Case()).samples
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(plain, samples))
    first, second = recompute_two_layouts(model_params(0), samples, contract(), 1.0)
    for i, x in enumerate(samples):
        assert bits_equal(x.behavior_logp, first[i]) and bits_equal(x.behavior_logp, second[i])


@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype", [("qwen35_moe", "float32"), ("qwen3_moe", "float32"),
                                         ("llama", "bfloat16")])
def test_bitwise_speculative_mtp_moe_targets_and_bf16(arch, dtype):
    """MoE targets (the head's block is an MoE block) and bf16 weights and compute: argmax
    drafts give plain decoding's samples, drawn drafts the train recompute's p_b."""
    cast = (lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree))
    params, head = cast(model_params(0, arch)), mtp.MtpHead(cast(_head(arch).params))

    def make(spec):
        return Sampler(ARCHS[arch], contract("pallas", dtype, arch), sampling(),
                       num_slots=NUM_SLOTS, max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4,
                       return_entropy=True,
                       speculative=None if spec is None else dataclasses.replace(
                           spec, draft=head),
                       prefill_buckets=PREFILL_BUCKETS)

    argmax = make(MTP_SPEC)
    assert_same_samples(make(None).generate(params, PROMPTS), argmax.generate(params, PROMPTS))
    drawn = make(DRAWN)
    samples = drawn.generate(params, PROMPTS)
    assert drawn.last_stats["spec_accepted"] > 0
    first, second = recompute_two_layouts(params, samples, contract("pallas", dtype, arch), 1.0,
                                          arch=arch)
    for i, x in enumerate(samples):
        assert bits_equal(x.behavior_logp, first[i]) and bits_equal(x.behavior_logp, second[i])


def test_bitwise_speculative_mtp_shared_prefill_same_samples():
    samples, stats = _mtp_run("llama", share_prefill=True)
    assert_same_samples(run(Case()).samples, samples)
    assert stats["spec_drafted"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_bitwise_speculative_mtp_cache_and_drafts_follow_the_history(arch):
    """After every speculative step: the recorded target hidden states at positions < p equal
    one train-style forward over the slot's history; the head's cache below its lengths (= the
    step's starting position, every drafted entry rolled back) equals one fresh head pass over
    the pairs (h_i, x_{i+1}); and the next step's drafts are the argmax chain of a fresh pass:
    d_1 from the pair at p - 1, d_2 from (o_{p-1}, d_1) at p. The same holds through an
    appended observation (slot 1, 3 tokens, mid-run) and a weight swap with KV refresh (the
    head catches up again from the new weights' hidden states)."""
    config = ARCHS[arch]
    s = _sampler(arch)
    spec, params, head = s.programs.spec, model_params(0, arch), _head(arch).params
    state = seat_prompts(s, params)

    @jax.jit
    def reference(params, history, upto):
        """(hidden [S, C, D] of one forward, head outputs [S, C, D] over the pairs at
        positions < upto[s])."""
        positions = jnp.broadcast_to(jnp.arange(spec.capacity, dtype=jnp.int32), history.shape)
        hidden = transformer.forward(params, config, history, contract=spec.contract,
                                     positions=positions).hidden
        tokens = jnp.concatenate([history[:, 1:], history[:, -1:]], axis=1)
        cache = mtp.init_cache(config, NUM_SLOTS, spec.capacity, spec.contract)
        out, cache = mtp.forward(head, params, config, tokens, hidden, contract=spec.contract,
                                 positions=positions, mask=positions < upto[:, None], cache=cache)
        return hidden, out, cache

    @jax.jit
    def reference_drafts(params, history, hidden, position):
        """(d_1, d_2) [S] each: the argmax chain of a fresh head pass (no cache) over the pairs
        (hidden[i], history[i+1]), read at p - 1, then again with (o_{p-1}, d_1) placed at p
        (the head is causal: later pairs do not reach positions <= p)."""
        slots = jnp.arange(NUM_SLOTS)
        tokens = jnp.concatenate([history[:, 1:], history[:, -1:]], axis=1)
        out, _ = mtp.forward(head, params, config, tokens, hidden, contract=spec.contract)
        o = out[slots, position - 1]
        d1 = jnp.argmax(mtp.logits(params, o, contract=spec.contract), axis=-1)
        out, _ = mtp.forward(head, params, config, tokens.at[slots, position].set(d1),
                             hidden.at[slots, position].set(o), contract=spec.contract)
        return d1, jnp.argmax(mtp.logits(params, out[slots, position],
                                          contract=spec.contract), axis=-1)

    @jax.jit
    def next_drafts(params, state, drafting):
        return draft_sources.mtp_drafts(spec, MTP_SPEC, head, params, state, drafting,
                                      jnp.uint32(7))[0].tokens

    def check(state, params, drafting):
        position = np.asarray(state.position)
        hidden, out, cache = reference(params, state.history, state.draft_cache.lengths)
        got_hidden = np.asarray(state.target_hidden)
        for slot in np.flatnonzero(drafting):
            p = position[slot]
            assert bits_equal(got_hidden[slot, :p], np.asarray(hidden)[slot, :p]), slot
            n = int(state.draft_cache.lengths[slot])
            for key, layer in cache.layers.items():
                for name, value in layer.items():
                    got = np.asarray(state.draft_cache.layers[key][name])[:, slot, :n]
                    assert bits_equal(got, np.asarray(value)[:, slot, :n]), (key, name, slot)
        # The next drafts, against the argmax chain of the fresh pass.
        drafts = next_drafts(params, state, jnp.asarray(drafting))
        d1, d2 = reference_drafts(params, state.history, hidden, state.position)
        for slot in np.flatnonzero(drafting):
            assert (int(drafts[slot, 0]), int(drafts[slot, 1])) == (int(d1[slot]),
                                                                    int(d2[slot])), slot

    drafted = steps_checked = 0
    for step in range(6):
        active = np.asarray(state.active)
        if not active.any():
            break
        if step == 2 and active[1]:
            observation = np.zeros((1, 4), np.int32)
            observation[0, :3] = (4, 6, 8)
            state = slot_programs.append(spec, params, state, jnp.asarray([1], jnp.int32),
                                         jnp.asarray(observation), jnp.asarray([3], jnp.int32),
                                         jnp.int32(0), jnp.uint32(7))
            active = np.asarray(state.active)
        if step == 4:
            params = model_params(1, arch)
            state = slot_programs.refresh(spec, params, state, jnp.asarray(active))
            assert np.all(np.asarray(state.draft_cache.lengths)[active] == 0)
        check(state, params, active)
        before = np.asarray(state.position)
        state, _, counts = speculative.decode(spec, MTP_SPEC, params, head, state, jnp.int32(0),
                                              jnp.uint32(7), jnp.int32(1), jnp.bool_(False))
        drafted += int(np.sum(np.asarray(counts.drafted)))
        np.testing.assert_array_equal(np.asarray(state.draft_cache.lengths)[active],
                                      before[active])
        steps_checked += 1
    # Every step drafted (and fed the head its own outputs past p - 1, all rolled back).
    assert steps_checked >= 5 and drafted > 0


def test_shared_prefill_mtp_records_the_prompt_hidden_states_bitwise():
    s = _sampler("llama", share_prefill=True)
    params = model_params(0)
    direct = seat_prompts(s, params)
    pooled = seat_prompts(s, params, shared=True)
    for slot, (_, tokens) in enumerate(PROMPTS):
        n = len(tokens)
        assert bits_equal(np.asarray(direct.target_hidden)[slot, :n],
                          np.asarray(pooled.target_hidden)[slot, :n]), slot
        assert np.abs(np.asarray(direct.target_hidden)[slot, :n]).max() > 0


def test_speculative_mtp_validation():
    make = functools.partial(Sampler, ARCHS["llama"], contract(), sampling(), num_slots=2,
                             max_prompt_len=4)
    with pytest.raises(ValueError, match=r"speculative.draft='mtp' names a kind of draft; "
                                         r"give the draft itself: SpeculativeConfig\("
                                         r"draft=MtpHead\(params\)"):
        make(speculative=MTP_SPEC)
    with pytest.raises(ValueError, match=r"SpeculativeConfig.draft: a dict is none of"):
        dataclasses.replace(MTP_SPEC, draft=_head().params)
    wrong = mtp.init_params(ARCHS["llama"].replace(hidden_size=48, head_dim=24),
                            jax.random.key(0))
    with pytest.raises(ValueError, match=r"MtpHead.params\['layers'\]\['attn_norm'\] has shape "
                                         r"\[1, 48\], expected \[1, 32\] for hidden_size 32"):
        make(speculative=dataclasses.replace(MTP_SPEC, draft=mtp.MtpHead(wrong)))
    with pytest.raises(ValueError, match=r"keeps a cache of its own"):
        draft_sources.model_free_source(MTP_SPEC)
    with pytest.raises(ValueError, match=r"draft_pick='best': allowed values are "
                                         r"\['draw', 'argmax', 'target_key'\]"):
        SpeculativeConfig(draft="mtp", draft_pick="best")
    with pytest.raises(ValueError, match=r"draft_pick='argmax' is for draft='draft_model', "
                                         r"'mtp' or 'fast_path' .*got draft='ngram'"):
        SpeculativeConfig(draft_pick="argmax")
    with pytest.raises(ValueError, match=r"MtpHead.params\['fc'\]: expected an array of shape "
                                         r"\[64, 32\], got list"):
        mtp.check_params({**_head().params, "fc": [1.0]}, ARCHS["llama"])
