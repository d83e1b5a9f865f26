"""The MoE load-balancing loss: hand-computed values and gradient, transformers' own
load_balancing_loss_func as an independent reference, and the LoadBalance transform in a chain."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import losses
from jrl.losses import LoadBalance, LossInputs, load_balance_loss
from jrl.metrics import names

P1 = [0.4, 0.3, 0.2, 0.1]
P2 = [0.1, 0.2, 0.3, 0.4]


def test_balanced_and_skewed_by_hand():
    # 4 experts, top-2, one MoE layer, tokens t1 (p = P1, experts 0, 1), t2 and a padding
    # token that must not count (everything on expert 3).
    probs = jnp.asarray([[[P1], [P2], [[0.0, 0.0, 0.0, 1.0]]]])               # [1, 3, 1, 4]
    mask = jnp.asarray([[True, True, False]])
    # t2 on experts 3, 2: each expert once in 2 tokens, f = [1/2] * 4; P = mean(P1, P2) =
    # [1/4] * 4; loss = 4 * 4 * (1/2)(1/4) = 2 = k (balanced).
    balanced = jnp.asarray([[[[0, 1]], [[3, 2]], [[3, 3]]]])
    assert float(load_balance_loss(probs, balanced, mask)) == pytest.approx(2.0)
    # t2 with p = P1 also on experts 0, 1: f = [1, 1, 0, 0], P = P1; loss = 4 (0.4 + 0.3) = 2.8.
    probs_skew = probs.at[0, 1, 0].set(jnp.asarray(P1))
    skewed = jnp.asarray([[[[0, 1]], [[0, 1]], [[3, 3]]]])
    assert float(load_balance_loss(probs_skew, skewed, mask)) == pytest.approx(2.8)
    # Only P carries gradient: dL/dp_{t,e} = E f_e / (L N) = 4 f_e / 2 = [2, 2, 0, 0] for each
    # counted token, 0 for the padding one.
    grad = jax.grad(lambda p: load_balance_loss(p, skewed, mask))(probs_skew)
    np.testing.assert_allclose(grad[0, :2, 0], [[2, 2, 0, 0]] * 2, rtol=1e-6)
    np.testing.assert_array_equal(grad[0, 2], 0.0)


def test_matches_transformers_load_balancing_loss_func():
    """Random logits of 3 MoE layers over a padded batch: transformers computes f and P over
    the layers pooled, from the logits (softmax, then top-k); jrl from probs and experts."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = np.random.default_rng(0)
    batch, seq, layers, experts, top_k = 2, 5, 3, 6, 2
    logits = rng.normal(size=(layers, batch * seq, experts)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    theirs = load_balancing_loss_func(tuple(torch.as_tensor(x) for x in logits), experts, top_k,
                                      torch.as_tensor(mask))
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)          # [L, B*T, E]
    chosen = jax.lax.top_k(probs, top_k)[1]
    to_btl = lambda x: jnp.moveaxis(x.reshape(layers, batch, seq, -1), 0, 2)
    ours = load_balance_loss(to_btl(probs), to_btl(chosen), jnp.asarray(mask, bool))
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_load_balance_in_a_chain_adds_its_weighted_term():
    """coef 0.01 on the skewed case above (2.8): the chain's loss gains 0.028 times the
    micro-batch's share of the tokens (here 3 of 6: 0.014)."""
    probs = jnp.asarray([[[P1], [P1], [P2]]])
    experts = jnp.asarray([[[[0, 1]], [[0, 1]], [[3, 2]]]])
    router_mask = jnp.asarray([[True, True, False]])
    base = dict(logp=jnp.zeros((1, 3)), old_logp=jnp.zeros((1, 3)), advantages=jnp.ones((1,)),
                mask=jnp.ones((1, 3), bool), global_num_tokens=6.0)
    plain = losses.chain(losses.TokenRatio(), losses.PPOClip(), losses.Aggregate())
    with_lb = losses.chain(*plain.transforms, LoadBalance(coef=0.01))
    loss0, _ = plain(LossInputs(**base))
    loss1, metrics = with_lb(LossInputs(**base, router_probs=probs, router_experts=experts,
                                        router_mask=router_mask))
    assert float(metrics[names.TRAIN_LOAD_BALANCE_LOSS]) == pytest.approx(0.014)
    assert float(loss1 - loss0) == pytest.approx(0.014)
    with pytest.raises(ValueError, match="LossInputs.router_probs"):
        with_lb(LossInputs(**base))
