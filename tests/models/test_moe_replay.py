"""Routing replay (R3) in the MoE block and the train forward: the replayed experts are used,
gradients reach the router through its probabilities of them (checked by hand on a 4-expert toy),
and replaying the routes a forward would pick anyway changes no bit."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.blocks import moe
from jrl.models.config import ModelConfig

XLA = NumericalContract(backend="xla")
PALLAS = NumericalContract(backend="pallas", matmul_block_m=8, matmul_block_n=16,
                           matmul_block_k=16, norm_block_rows=8, logprob_block_rows=8,
                           attn_block_q=8, attn_block_k=8, vocab_chunk=16)
LN3 = math.log(3.0)


def toy(norm_topk_prob: bool):
    """One token x = [1, 0], D = 2, 4 experts, top-2, expert width 1.

    Router: logits = x W = [0, ln 2, ln 3, ln 4], so p = [1, 2, 3, 4] / 10 and the router's own
    top-2 is [3, 2]. Expert e: h = x W_gate[e] = ln 3 (sigmoid(ln 3) = 3/4, so
    silu(h) = 0.75 ln 3), u = x W_up[e] = 1, y_e = silu(h) u W_down[e] = 0.75 ln 3 * [c_e, 1] with
    c = [1, 2, 4, 8]. With the loss L = out[0], expert e contributes g_e = 0.75 ln 3 * c_e:
    g_0 = 0.75 ln 3, g_1 = 1.5 ln 3.
    """
    config = ModelConfig(model_type="qwen3_moe", hidden_size=2, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=1,
                         norm_topk_prob=norm_topk_prob)
    router = np.zeros((2, 4), np.float32)
    router[0] = np.log([1.0, 2.0, 3.0, 4.0])
    gate = np.zeros((4, 2, 1), np.float32)
    gate[:, 0, 0] = LN3
    up = np.zeros((4, 2, 1), np.float32)
    up[:, 0, 0] = 1.0
    down = np.ones((4, 1, 2), np.float32)
    down[:, 0, 0] = [1.0, 2.0, 4.0, 8.0]
    layer = {"router": router, "experts_gate": gate, "experts_up": up, "experts_down": down}
    x = jnp.asarray([[[1.0, 0.0]]])                                         # [1, 1, 2]
    return config, jax.tree.map(jnp.asarray, layer), x


@pytest.mark.parametrize("contract", [XLA, PALLAS], ids=["xla", "pallas"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replay_uses_the_recorded_experts_and_trains_the_router_through_them(contract,
                                                                              norm_topk_prob):
    config, layer, x = toy(norm_topk_prob)
    replayed = jnp.asarray([[[0, 1]]], jnp.int32)                # not the router's [3, 2]

    def loss(layer, routes):
        out, experts, _ = moe.forward(x, layer, config=config, contract=contract,
                                      routes=routes)
        return out[0, 0, 0], experts

    (value, experts), grads = jax.value_and_grad(loss, has_aux=True)(layer, replayed)
    # The block still reports the router's own choice.
    np.testing.assert_array_equal(experts, [[[3, 2]]])
    if norm_topk_prob:
        # w = p[0, 1] / (p_0 + p_1) = [1/3, 2/3]; L = (1/3)(0.75 ln 3) + (2/3)(1.5 ln 3)
        # = 1.25 ln 3. Renormalised weights are a softmax over the chosen logits, so
        # dL/dz_0 = g_0 w_0 (1 - w_0) - g_1 w_1 w_0 = (2/9)(g_0 - g_1) = -(1/6) ln 3,
        # dL/dz_1 = +(1/6) ln 3, and the unchosen logits get exactly 0.
        expected_value = 1.25 * LN3
        dz = np.array([-LN3 / 6, LN3 / 6, 0.0, 0.0])
    else:
        # w = p[0, 1] = [0.1, 0.2]; L = 0.075 ln 3 + 0.3 ln 3 = 0.375 ln 3 =: S.
        # dL/dz_i = sum_j g_j p_{e_j} (delta_{i e_j} - p_i):
        #   z_0: 0.075 ln 3 - 0.1 S = 0.0375 ln 3     z_1: 0.3 ln 3 - 0.2 S = 0.225 ln 3
        #   z_2: -0.3 S = -0.1125 ln 3               z_3: -0.4 S = -0.15 ln 3   (sum 0)
        expected_value = 0.375 * LN3
        dz = np.array([0.0375, 0.225, -0.1125, -0.15]) * LN3
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    # logits = x W with x = [1, 0]: dL/dW row 0 = dL/dz, row 1 = 0.
    np.testing.assert_allclose(grads["router"], np.stack([dz, np.zeros(4)]), rtol=1e-5,
                               atol=1e-7)
    # Experts 2 and 3 (the router's own choice) were not used: no gradient at all.
    for name in ("experts_gate", "experts_up", "experts_down"):
        assert np.all(np.asarray(grads[name])[2:] == 0.0) and np.any(grads[name][:2] != 0.0)

    # Recompute routes to [3, 2]: L = (3/7)(3 ln 3) + (4/7)(6 ln 3) with norm, else
    # 0.3 * 3 ln 3 + 0.4 * 6 ln 3 (g_2 = 0.75 ln 3 * 4, g_3 = 0.75 ln 3 * 8).
    recomputed, _ = loss(layer, None)
    expected = (3 / 7 * 3 + 4 / 7 * 6) * LN3 if norm_topk_prob else (0.9 + 2.4) * LN3
    np.testing.assert_allclose(recomputed, expected, rtol=1e-6)
    # -1 means "not recorded": the router routes that token itself.
    minus_one, _ = loss(layer, jnp.full((1, 1, 2), -1, jnp.int32))
    assert minus_one == recomputed


CONFIG = ModelConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=32,
                     intermediate_size=48, num_layers=3, num_heads=2, num_kv_heads=1,
                     head_dim=16, qk_norm=True, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=24, mlp_only_layers=(1,))


@functools.lru_cache(maxsize=None)
def params(seed: int):
    p = transformer.init_params(CONFIG, jax.random.key(seed))
    return jax.tree.map(lambda x: x * 15.0 if x.ndim >= 2 else x, p)


@functools.partial(jax.jit, static_argnames=("contract",))
def scores(params, tokens, mask, routes, *, contract):
    return transformer.sequence_scores(params, CONFIG, tokens, contract=contract, mask=mask,
                                       routes=routes)


def test_replaying_the_forwards_own_routes_changes_no_bit():
    """The train forward with routes = its own routing (what the sampler records on the Pallas
    path) is the recompute forward bit for bit; all -1 routes everything afresh; routes of other
    weights (a stale batch) change the logprobs."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 32, (3, 11)), jnp.int32)
    mask = jnp.asarray(np.arange(11)[None] < np.array([[11], [6], [9]]))
    own = scores(params(0), tokens, mask, None, contract=PALLAS)
    assert transformer.moe_layers(CONFIG) == (("layers_moe", 0), ("layers_moe", 1))
    assert own.routes.shape == (3, 11, 2, 2)
    for routes in (own.routes, jnp.full(own.routes.shape, -1, jnp.int32)):
        again = scores(params(0), tokens, mask, routes, contract=PALLAS)
        np.testing.assert_array_equal(np.asarray(again.logp).view(np.uint32),
                                      np.asarray(own.logp).view(np.uint32))
        np.testing.assert_array_equal(again.routes, own.routes)
    stale = scores(params(1), tokens, mask, None, contract=PALLAS).routes
    assert np.mean(np.asarray(stale) != np.asarray(own.routes)) > 0.3   # other weights: flips
    replayed = scores(params(0), tokens, mask, stale, contract=PALLAS)
    assert np.any(np.asarray(replayed.logp)[np.asarray(mask)] !=
                  np.asarray(own.logp)[np.asarray(mask)])


def test_split_routes_rejects_a_wrong_shape():
    with pytest.raises(ValueError, match=r"routes: expected \[B, T, 2 MoE layers, 2 experts\]"):
        transformer.split_routes(jnp.zeros((1, 4, 3, 2), jnp.int32), CONFIG)
