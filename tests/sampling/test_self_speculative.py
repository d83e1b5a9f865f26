"""Self-speculative exact decoding (SpeculativeConfig(draft="fast_path")): the policy drafts on the
plain-XLA contract with the exact path's own sampling keys, the exact path verifies. The samples
are plain exact decoding's bit for bit (tokens, p_b, floors, entropies, versions, routes) for
every family; a draft that disagrees more (perturbed weights, drawn with the same target keys)
is rejected often and changes nothing either."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jrl.sampling import DraftModel, Sampler, SpeculativeConfig
from jrl.sampling.speculative_config import fast_path_contract

from .helpers import (ARCHS, MAX_PROMPT_LEN, NUM_SLOTS, PREFILL_BUCKETS, PROMPTS,
                      assert_same_samples, Case, contract, model_params, poll_after, run, sampler,
                      sampling)

FAST = SpeculativeConfig(draft="fast_path", num_draft=3, draft_min_accept=0.0)


def test_fast_path_config_defaults_to_target_key_point_masses():
    assert FAST.draft_pick == "target_key" and FAST.keeps_draft_state
    assert SpeculativeConfig(draft="draft_model").draft_pick == "draw"
    assert fast_path_contract(contract()).backend == "xla"
    with pytest.raises(ValueError, match="draft_pick='target_key' is for"):
        SpeculativeConfig(draft="ngram", draft_pick="target_key")
    with pytest.raises(ValueError, match=r"names a kind of draft; give the draft itself: "
                                         r"SpeculativeConfig\(draft=DraftModel"):
        Sampler(ARCHS["llama"], contract(), sampling(), num_slots=2, max_prompt_len=4,
                speculative=SpeculativeConfig(draft="draft_model"))


@functools.lru_cache(maxsize=None)
def _self_speculative(case: Case, spec: SpeculativeConfig = FAST):
    s = sampler(case.backend, case.dtype, temperature=case.temperature, top_p=case.top_p,
                top_k=case.top_k, arch=case.arch, speculative=spec)
    samples = s.generate(model_params(0, case.arch), PROMPTS)
    return samples, dict(s.last_stats)


FAMILIES = {
    "llama-f32-t1": Case(),
    "qwen35-f32-t1": Case(arch="qwen35"),              # Gated DeltaNet settled to kept tokens
    "llama_lora-f32-t1": Case(arch="llama_lora"),
    "qwen3_moe-f32-topp0.9": Case(arch="qwen3_moe", top_p=0.9),   # routes from the exact pass
    "llama_qlora-f32-t1": Case(arch="llama_qlora"),
    "llama-bf16-t0.7-topk8": Case(dtype="bfloat16", temperature=0.7, top_k=8),
}
DEFAULT_TIER = ("llama-f32-t1", "qwen35-f32-t1", "qwen3_moe-f32-topp0.9")


@pytest.mark.parametrize("case", [c if n in DEFAULT_TIER else pytest.param(
    c, marks=pytest.mark.slow) for n, c in FAMILIES.items()], ids=FAMILIES.keys())
def test_self_speculative_samples_are_plain_exact_decodings(case):
    plain, plain_stats = run(case)
    samples, stats = _self_speculative(case)
    assert_same_samples(plain, samples)
    # The fast path's logits differ from the exact path's in rounding only: the two draws
    # with the same key part on near ties alone. Drafts past a drawn stop token count as
    # rejected too (these 32-token vocabularies stop often), hence 0.8 rather than ~1; the
    # perturbed draft below stays under it.
    assert stats["spec_drafted"] > 0
    assert stats["spec_accepted"] >= 0.8 * stats["spec_drafted"], stats
    assert stats["decode_steps"] < plain_stats["decode_steps"]
    assert stats["refills_while_busy"] >= 1


def _perturbed_draft(arch: str = "llama") -> DraftModel:
    """The policy's own config with its weights scaled and shifted: a draft that often parts
    from the target, still drawn with the target's keys and proposed as a point mass."""
    params = model_params(0, arch)
    noise = model_params(5, arch)
    return DraftModel(ARCHS[arch], jax.tree.map(
        lambda x, n: x * 1.5 + n if x.ndim >= 2 else x, params, noise))


def test_a_disagreeing_draft_is_rejected_often_and_changes_no_bit():
    case = Case()
    plain, _ = run(case)
    spec = SpeculativeConfig(draft=_perturbed_draft(), draft_pick="target_key", num_draft=3,
                             draft_min_accept=0.0)
    s = Sampler(ARCHS["llama"], contract(), sampling(), num_slots=NUM_SLOTS,
                max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4, return_entropy=True,
                speculative=spec, prefill_buckets=PREFILL_BUCKETS)
    samples = s.generate(model_params(0), PROMPTS)
    assert_same_samples(plain, samples)
    stats = s.last_stats
    assert 0 < stats["spec_accepted"] < 0.8 * stats["spec_drafted"], stats


def test_a_weight_swap_swaps_the_draft_too():
    """New weights arrive between device calls: the fast path then drafts with them (its params
    are the target's own, not a copy), so drafts stay accepted after the swap."""
    old, new = model_params(0), model_params(1)
    spec_sampler = sampler(speculative=FAST)
    samples = spec_sampler.generate(old, PROMPTS, poll_weights=poll_after(3, new))
    plain = sampler().generate(old, PROMPTS, poll_weights=poll_after(3, new))
    assert any(np.any(x.versions == 1) for x in samples)
    stats = spec_sampler.last_stats
    assert stats["spec_accepted"] >= 0.8 * stats["spec_drafted"], stats
    # Version-0 prefixes are the unswapped run's (the call boundaries of plain decoding and
    # speculation differ, so where the swap lands differs).
    unswapped = {(x.prompt_id, x.sample_index): x for x in _self_speculative(Case())[0]}
    for x in samples:
        n0 = int(np.sum(x.versions == 0))
        assert np.array_equal(x.tokens[:n0], unswapped[(x.prompt_id, x.sample_index)].tokens[:n0])
    assert len(plain) == len(samples)


def test_self_speculative_shared_prefill_is_plain_exact_decodings():
    plain, _ = run(Case())
    s = sampler(share_prefill=True, speculative=FAST)
    assert_same_samples(plain, s.generate(model_params(0), PROMPTS))


def test_greedy_self_speculation_is_plain_greedy_decoding():
    plain = sampler(greedy=True).generate(model_params(0), PROMPTS)
    s = sampler(greedy=True, speculative=dataclasses.replace(FAST, num_draft=4))
    assert_same_samples(plain, s.generate(model_params(0), PROMPTS))
    assert s.last_stats["spec_accepted"] >= 0.8 * s.last_stats["spec_drafted"]
