"""The sampler records every token's experts (per MoE layer) and they are the train forward's:
routing agreement is exactly 1.0 on the Pallas path, prompt, response and observations alike.

Setting: the tiny MoE models of helpers.ARCHS (Qwen3-MoE with a dense layer 0; the Qwen3.5
hybrid with MoE blocks and the shared expert), the refilling run of test_bitwise, and train
batches laid out unlike the sampler's slots (reverse order, other padding).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import transformer
from jrl.sampling import Sampler

from .helpers import (ARCHS, MAX_PROMPT_LEN, PREFILL_BUCKETS, PROMPTS, Case, contract, layout,
                      model_params, run, sampling)
from .test_multiturn import Tools

CASES = {"qwen3_moe": Case("pallas", "float32", 1.0, 0.9, arch="qwen3_moe"),
         "qwen35_moe": Case("pallas", "bfloat16", 1.0, 0.9, arch="qwen35_moe")}


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def _train_routes(params, tokens, mask, *, config, contract):
    return transformer.sequence_scores(params, config, tokens, contract=contract,
                                       mask=mask).routes


def train_routes(samples, arch, case_contract, *, length):
    """[N + P, L_moe, k] router choices of the train forward per sample, from one batch with
    the samples in reverse order padded to `length`."""
    order = list(range(len(samples)))[::-1]
    lay = layout(samples, order, len(samples), length)
    routes = np.asarray(_train_routes(model_params(0, arch), jnp.asarray(lay.tokens),
                                      jnp.asarray(lay.mask), config=ARCHS[arch],
                                      contract=case_contract))
    return [routes[lay.rows[i], :s.prompt_tokens.size + s.length] for i, s in
            enumerate(samples)]


def agreement(samples, routes) -> float:
    """Fraction of (fed token, MoE layer) pairs whose expert SET is the train forward's."""
    same = total = 0
    for s, r in zip(samples, routes):
        recorded = np.concatenate([s.prompt_experts, s.experts])
        fed = recorded[:, 0, 0] >= 0
        same += int(np.all(np.sort(recorded[fed], -1) == np.sort(r[fed], -1), -1).sum())
        total += int(fed.sum()) * recorded.shape[1]
    return same / total


@pytest.mark.parametrize("arch", CASES, ids=CASES.keys())
def test_recorded_routes_equal_the_train_forward(arch):
    case = CASES[arch]
    samples, _ = run(case)
    num_moe = len(transformer.moe_layers(ARCHS[arch]))
    assert num_moe == (1 if arch == "qwen3_moe" else 4)   # qwen3_moe: layer 0 is dense
    for s in samples:
        assert s.experts.shape == (s.length, num_moe, 2) and s.experts.dtype == np.int32
        assert s.prompt_experts.shape == (s.prompt_tokens.size, num_moe, 2)
        # The last token was never fed (nothing was computed from it); every other was.
        assert np.all(s.experts[-1] == -1)
        assert np.all(s.experts[:-1] >= 0) and np.all(s.prompt_experts >= 0)
        assert np.all(s.experts[:-1] < 8)
    routes = train_routes(samples, arch, contract(case.backend, case.dtype), length=30)
    for s, r in zip(samples, routes):
        recorded = np.concatenate([s.prompt_experts, s.experts])
        # Same bits, so even the order within the top-k is the train forward's.
        np.testing.assert_array_equal(recorded[:-1], r[:-1])
    assert agreement(samples, routes) == 1.0
    # Not vacuous: the tokens spread over the experts.
    used = np.concatenate([s.experts[:-1].reshape(-1) for s in samples])
    assert len(np.unique(used)) == 8


def test_multiturn_observations_carry_their_routes():
    """Observation tokens (is_model False) are fed through the model by append: their routes
    are recorded, as are the stop tokens that ended each turn, and equal the train forward's."""
    tools = Tools()
    s = Sampler(ARCHS["qwen3_moe"], contract(), sampling(max_new_tokens=24,
                                                         stop_tokens=tuple(range(1, 9))),
                num_slots=2, max_prompt_len=MAX_PROMPT_LEN, steps_per_call=4,
                max_observation_len=3, prefill_buckets=PREFILL_BUCKETS)
    samples = s.generate(model_params(0, "qwen3_moe"), PROMPTS, on_turn=tools)
    assert s.last_stats["appends"] >= 4
    observed = [sm for sm in samples if not sm.model_token_mask().all()]
    assert len(observed) >= 4
    for sm in observed:
        assert np.all(sm.experts[~sm.model_token_mask()] >= 0)
        assert np.all(sm.experts[:-1] >= 0) and np.all(sm.experts[-1] == -1)
    routes = train_routes(samples, "qwen3_moe", contract(), length=MAX_PROMPT_LEN + 24)
    for sm, r in zip(samples, routes):
        np.testing.assert_array_equal(np.concatenate([sm.prompt_experts, sm.experts])[:-1],
                                      r[:-1])
