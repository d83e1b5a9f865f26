"""jrl.sampling.Sampler: request validation, finish reasons, stop tokens, per-request budgets,
groups, entropy, static vs continuous batching, versions. Shares the compiled sampler of
test_bitwise (helpers.run / helpers.sampler cache it)."""

import numpy as np
import pytest

from jrl import kernels
from jrl.models import transformer
from jrl.sampling import FINISH_LENGTH, FINISH_STOP, Sampler

from .helpers import (
    CONFIG, GROUP_SIZE, MAX_NEW_TOKENS, MAX_PROMPT_LEN, NUM_SLOTS, PROMPTS, STOP, Case,
    bits_equal, contract, layout, model_params, run, sampler, train_logprobs)

F32 = Case("pallas", "float32", 1.0, 1.0)


def test_prompt_longer_than_max_prompt_len_raises():
    too_long = tuple(range(2, MAX_PROMPT_LEN + 3))
    with pytest.raises(ValueError, match=f"max_prompt_len={MAX_PROMPT_LEN}"):
        sampler().generate(model_params(0), [(0, (3, 4)), (1, too_long)])


def test_serve_refuses_a_prompt_longer_than_max_prompt_len_naming_it():
    # The streaming form (the rollout worker's): one clear error before any prefill, not a
    # numpy broadcast error from inside the batched prompt array.
    too_long = np.arange(2, MAX_PROMPT_LEN + 4, dtype=np.int32)
    requests = iter([(7, 0, too_long, MAX_NEW_TOKENS)])
    with pytest.raises(ValueError, match=rf"prompt 7 has {too_long.size} tokens, more than "
                                         rf"Sampler\.max_prompt_len={MAX_PROMPT_LEN}"):
        sampler().serve(model_params(0), next_request=lambda: next(requests, None),
                        on_sample=lambda sample: None)


def test_empty_prompt_and_duplicate_prompt_ids_raise():
    with pytest.raises(ValueError, match="non-empty"):
        sampler().generate(model_params(0), [(0, ())])
    with pytest.raises(ValueError, match="prompt_id 4 appears twice"):
        sampler().generate(model_params(0), [(4, (3,)), (4, (5, 6))])


def test_finish_reason_stop_vs_length_and_stop_token_is_last():
    samples = run(F32).samples
    reasons = {s.finish_reason for s in samples}
    assert reasons == {FINISH_STOP, FINISH_LENGTH}
    for s in samples:
        if s.finish_reason == FINISH_STOP:
            # The stop token is kept as the last token (it is trained on) and appears once.
            assert s.tokens[-1] == STOP and np.sum(s.tokens == STOP) == 1
            assert 1 <= s.length <= MAX_NEW_TOKENS
        else:
            assert s.length == MAX_NEW_TOKENS and STOP not in s.tokens
        assert s.behavior_logp.shape == s.logit_floor.shape == s.versions.shape == (s.length,)


def test_samples_of_a_group_differ_and_come_back_in_prompt_order():
    samples = run(F32).samples
    assert [(s.prompt_id, s.sample_index) for s in samples] == \
           [(pid, i) for pid, _ in PROMPTS for i in range(GROUP_SIZE)]
    for g, (pid, prompt) in enumerate(PROMPTS):
        group = samples[g * GROUP_SIZE:(g + 1) * GROUP_SIZE]
        assert all(np.array_equal(s.prompt_tokens, prompt) for s in group)
        distinct = {tuple(s.tokens) for s in group}
        assert len(distinct) == GROUP_SIZE, pid


def test_per_request_max_new_tokens():
    s = sampler()
    limits = [3, MAX_NEW_TOKENS, 1, 6]
    samples = s.generate(model_params(0), PROMPTS, max_new_tokens=limits)
    reference = run(F32).samples
    for x, ref in zip(samples, reference):
        limit = limits[[pid for pid, _ in PROMPTS].index(x.prompt_id)]
        assert x.length <= limit
        assert x.finish_reason == (FINISH_STOP if x.tokens[-1] == STOP else FINISH_LENGTH)
        if x.finish_reason == FINISH_LENGTH:
            assert x.length == limit
        # A budget only cuts the sample short: the tokens drawn are those of the full run.
        assert np.array_equal(x.tokens, ref.tokens[:x.length])
        assert bits_equal(x.behavior_logp, ref.behavior_logp[:x.length])
    for bad in ([3, 0, 1, 1], [3, MAX_NEW_TOKENS + 1, 1, 1], [3.0, 1, 1, 1]):
        with pytest.raises(ValueError, match="max_new_tokens"):
            s.generate(model_params(0), PROMPTS, max_new_tokens=bad)
    with pytest.raises(ValueError, match="one per prompt"):
        s.generate(model_params(0), PROMPTS, max_new_tokens=[3])


def test_entropy_returned_when_asked_and_equals_reference():
    samples = run(F32).samples  # helpers.sampler sets return_entropy=True
    params = model_params(0)
    # Reference: float64 entropy of softmax over the kept set, from the logits the sampler saw
    # (the train forward's logits are bitwise the sampler's, so the kept set z >= floor is too).
    lay = layout(samples, range(len(samples)), len(samples), 30)
    logits = np.asarray(transformer.forward_logits(params, CONFIG, lay.tokens,
                                                   contract=contract(), mask=lay.mask),
                        np.float64)
    _, train_entropy = train_logprobs(params, samples, contract(), 1.0, order=range(len(samples)),
                                      batch=len(samples), length=30, return_entropy=True)
    for i, s in enumerate(samples):
        assert s.entropy is not None and s.entropy.shape == (s.length,)
        p = s.prompt_tokens.size
        z = logits[i, p - 1:p - 1 + s.length]                      # predicts tokens p .. p+N-1
        kept = z >= s.logit_floor[:, None]
        zk = np.where(kept, z, -np.inf)
        logq = zk - (np.log(np.sum(np.exp(zk - zk.max(1, keepdims=True)), 1, keepdims=True))
                     + zk.max(1, keepdims=True))
        reference = -np.sum(np.where(kept, np.exp(logq) * logq, 0.0), axis=1)
        np.testing.assert_allclose(s.entropy, reference, rtol=1e-5, atol=1e-5)
        # The sampler's entropy comes from the same kernel as the train step's: same bits.
        assert bits_equal(s.entropy, train_entropy[i])
    assert 0.5 < np.mean(np.concatenate([s.entropy for s in samples])) < np.log(CONFIG.vocab_size)
    quiet = Sampler(CONFIG, contract(), sampler().sampling, num_slots=NUM_SLOTS,
                    max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4)
    assert all(s.entropy is None for s in quiet.generate(params, PROMPTS[:1]))


def test_static_batching_gives_the_same_samples_with_more_decode_steps():
    # Long-tailed budgets: one prompt's samples may run 16 tokens, the others at most 2-3.
    limits = [2, MAX_NEW_TOKENS, 3, 2]
    continuous, static = sampler(), sampler(continuous_batching=False)
    expected = continuous.generate(model_params(0), PROMPTS, max_new_tokens=limits)
    samples = static.generate(model_params(0), PROMPTS, max_new_tokens=limits)
    for a, b in zip(expected, samples):
        assert np.array_equal(a.tokens, b.tokens)
        assert bits_equal(a.behavior_logp, b.behavior_logp)
    assert continuous.last_stats["refills_while_busy"] > 0
    assert static.last_stats["refills_while_busy"] == 0
    assert static.last_stats["tokens"] == continuous.last_stats["tokens"]
    # A static batch decodes until its longest sample ends: more steps for the same tokens.
    assert static.last_stats["decode_steps"] > continuous.last_stats["decode_steps"]


def test_every_token_carries_the_version_it_was_generated_with():
    samples = sampler().generate(model_params(0), PROMPTS[:2], version=7)
    assert all(np.all(s.versions == 7) for s in samples)


def test_sampled_tokens_lie_in_the_kept_set_the_trainer_replays():
    """With temperature != 1 the floor is computed from z = logits / T by XLA in the sampler,
    while the token-logprob kernel recomputes z itself. Their z of the boundary token (the one
    AT the floor) must agree, or the kernel drops that token from the kept set and p_b is no
    longer the logprob of the distribution sampled from (p_b would still equal p_o bitwise).
    Check: lowering each floor by one ulp changes no logprob (nothing new enters the set)."""
    case = Case("pallas", "float32", 0.7, 0.95, top_k=8)
    samples = run(case).samples
    lay = layout(samples, range(len(samples)), len(samples), 30)
    logits = transformer.forward_logits(model_params(0), CONFIG, lay.tokens, contract=contract(),
                                        mask=lay.mask)
    rows = [(i, s.prompt_tokens.size - 1 + j) for i, s in enumerate(samples)
            for j in range(s.length)]
    picked = logits[np.array([r for r, _ in rows]), np.array([c for _, c in rows])]   # [N, V]
    targets = np.concatenate([s.tokens for s in samples])
    floor = np.concatenate([s.logit_floor for s in samples])
    p_b = np.concatenate([s.behavior_logp for s in samples])
    replay = lambda f: np.asarray(kernels.token_logprobs(
        picked, targets, contract=contract(), temperature=0.7, logit_floor=f).logp)
    assert bits_equal(replay(floor), p_b)
    assert bits_equal(replay(np.nextafter(floor, np.float32(-np.inf))), p_b)
    # And the kept set is a real truncation: at most top_k = 8 of 32 tokens.
    z = np.asarray(picked) / np.float32(0.7)
    assert np.all(np.sum(z >= np.nextafter(floor, np.float32(-np.inf))[:, None], axis=1) <= 8)


def test_group_size_override_per_call():
    """generate(group_size=1) (evaluation) gives sample 0 of each prompt of the full-group run."""
    reference = {(s.prompt_id, s.sample_index): s for s in run(F32).samples}
    samples = sampler().generate(model_params(0), PROMPTS, group_size=1)
    assert [(s.prompt_id, s.sample_index) for s in samples] == [(pid, 0) for pid, _ in PROMPTS]
    for s in samples:
        assert np.array_equal(s.tokens, reference[(s.prompt_id, 0)].tokens)
    with pytest.raises(ValueError, match="group_size=0"):
        sampler().generate(model_params(0), PROMPTS, group_size=0)


def test_precompile_compiles_every_program_serve_uses():
    from jrl.sampling import slots as slot_programs
    programs = (slot_programs.prefill, slot_programs.decode, slot_programs.refresh)
    # A spec no other test uses (steps_per_call=5), so nothing of it is compiled yet.
    s = sampler("xla", steps_per_call=5, recompute_kv_on_swap=True,
                prefill_buckets="powers_of_two")
    params = model_params(0)
    before = [p._cache_size() for p in programs]
    # Prefill buckets of a 4-slot sampler: 1, 2, 4 rows; then decode and refresh: 5 programs.
    assert s.precompile(params) == 5
    assert [p._cache_size() - b for p, b in zip(programs, before)] == [3, 1, 1]
    compiled = [p._cache_size() for p in programs]
    # Serving now compiles nothing: 12 requests fill 4 slots (bucket 4), refills take 1-2 at a
    # time, and a weight swap mid-generation runs refresh.
    polls = []

    def swap_once():   # the first poll comes before any slot is busy; swap at the second
        polls.append(True)
        return (params, 1) if len(polls) == 2 else None
    samples = s.generate(params, PROMPTS, poll_weights=swap_once)
    assert len(samples) == len(PROMPTS) * GROUP_SIZE and s.last_stats["refreshes"] == 1
    assert [p._cache_size() for p in programs] == compiled
    assert s.precompile(params) == 0   # once per sampler
