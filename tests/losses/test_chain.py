"""Tests for jrl.losses.chain: presets, metrics, masking, composition, config errors."""

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import losses
from jrl.losses import (
    CISPO,
    METRIC_NAMES,
    MIS,
    TIS,
    Aggregate,
    EntropyBonus,
    KLPenalty,
    LossInputs,
    PPOClip,
    SequenceRatio,
    TokenRatio,
    chain,
)

B, T = 4, 6
MASK = jnp.array(
    [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
)
ADV = jnp.array([1.0, -1.0, 0.5, -2.0])


def make_inputs(dtype=jnp.float32, seed=0, same=False):
    """Random logprobs; `same=True` makes old_logp == behavior_logp == logp exactly."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    logp = -jax.random.uniform(keys[0], (B, T), minval=0.1, maxval=3.0)
    nudge = lambda k: 0.3 * jax.random.normal(k, (B, T))
    old = logp if same else logp + nudge(keys[1])
    behavior = logp if same else old + nudge(keys[2])
    return LossInputs(
        logp=logp.astype(dtype),
        old_logp=old.astype(dtype),
        advantages=ADV,
        mask=MASK,
        behavior_logp=behavior.astype(dtype),
        ref_logp=(logp + nudge(keys[3])).astype(dtype),
        entropy=jax.random.uniform(keys[4], (B, T)).astype(dtype),
    )


def grad_logp(loss_fn, inputs):
    """(loss, metrics), d loss / d logp."""
    def fn(logp):
        return loss_fn(inputs._replace(logp=logp))
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(inputs.logp)
    return loss, metrics, grad


PRESETS = {
    "grpo": losses.grpo(),
    "dapo": losses.dapo(),
    "dr_grpo": losses.dr_grpo(max_len=T),
    "gspo": losses.gspo(),
    "gspo-token": losses.gspo(token_grad=True),
    "cispo": losses.cispo(),
}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_on_policy_is_exact(name, dtype):
    loss_fn = PRESETS[name]
    loss, metrics = jax.jit(loss_fn)(make_inputs(dtype, same=True))
    assert set(METRIC_NAMES) <= set(metrics)
    assert np.isfinite(float(loss))
    # p_old == logp bit for bit: the ratio is exactly 1, ppo_kl exactly 0, nothing clipped.
    for key in ("train/ratio_min", "train/ratio_mean", "train/ratio_max"):
        assert float(metrics[key]) == 1.0, key
    assert float(metrics["train/ppo_kl"]) == 0.0
    assert float(metrics["train/pg_clipfrac_low"]) == 0.0
    assert float(metrics["train/pg_clipfrac_high"]) == 0.0
    assert float(metrics["train/tis_mean"]) == 1.0 and float(metrics["train/tis_abs"]) == 0.0
    for value in metrics.values():
        assert np.isfinite(float(value))
    np.testing.assert_allclose(
        metrics["train/loss"],
        metrics["train/pg_loss"] + metrics["train/kl_loss"] + metrics["train/entropy_loss"],
        rtol=1e-6,
    )


def test_preset_reprs_are_readable():
    text = repr(losses.grpo())
    for part in ("TokenRatio(", "PPOClip(eps_low=0.2, eps_high=0.2", "seq_mean_token_mean",
                 "KLPenalty(beta=0.04, kind='k3'", "name='grpo'"):
        assert part in text
    assert "PPOClip(eps_low=0.2, eps_high=0.28" in repr(losses.dapo())
    assert "Aggregate(mode='constant', max_len=4096)" in repr(losses.dr_grpo(4096))
    assert "PPOClip(eps_low=0.0003, eps_high=0.0004" in repr(losses.gspo())
    assert "SequenceRatio(token_grad=True" in repr(losses.gspo(token_grad=True))
    assert "CISPO(eps_low=1.0, eps_high=2.0)" in repr(losses.cispo())
    assert "TIS(cap=2.0" in repr(losses.dapo(corrections=(TIS(cap=2.0),)))


def test_preset_gradients_are_finite():
    inputs = make_inputs()
    for name, loss_fn in PRESETS.items():
        loss, _, grad = grad_logp(jax.jit(loss_fn), inputs)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(grad)), name
        assert np.all(np.asarray(grad)[np.asarray(MASK) == 0] == 0.0), name


FULL = chain(
    TokenRatio(log_ratio_clip=None),
    TIS(cap=2.0),
    MIS(threshold=3.0, level="sequence"),
    PPOClip(eps_low=0.2, eps_high=0.28, dual_clip=3.0),
    Aggregate(mode="seq_mean_token_mean"),
    KLPenalty(beta=0.1, kind="k3"),
    EntropyBonus(coef=0.01),
    name="everything",
)


@pytest.mark.parametrize("loss_fn", [FULL, PRESETS["gspo"], PRESETS["cispo"]], ids=["full", "gspo", "cispo"])
def test_masked_positions_never_matter(loss_fn, garbage):
    inputs = make_inputs()
    fn = jax.jit(lambda x: grad_logp(loss_fn, x))
    clean = fn(inputs)
    for sign in (1.0, -1.0):
        dirty_inputs = inputs._replace(**{
            field: sign * garbage(sign * getattr(inputs, field), MASK)
            for field in ("logp", "old_logp", "behavior_logp", "ref_logp", "entropy")
        })
        dirty = fn(dirty_inputs)
        np.testing.assert_allclose(clean[0], dirty[0], rtol=1e-6)
        for key in clean[1]:
            np.testing.assert_allclose(clean[1][key], dirty[1][key], rtol=1e-6, err_msg=key)
        np.testing.assert_allclose(clean[2], dirty[2], rtol=1e-6)


def test_empty_mask_is_nan_free():
    inputs = make_inputs()._replace(mask=jnp.zeros((B, T)))
    for loss_fn in (FULL, *PRESETS.values()):
        loss, metrics, grad = grad_logp(loss_fn, inputs)
        assert float(loss) == 0.0
        assert np.all(np.asarray(grad) == 0.0)
        for key, value in metrics.items():
            assert float(value) == 0.0, key


def test_seed_mismatch_through_the_chain():
    # p_b = (0.4, 0.6), p_o = p_c = (0.6, 0.4), A = (+1, -1), token_mean over the 2 tokens.
    p_b, p_o = jnp.log(jnp.array([[0.4, 0.6]])), jnp.log(jnp.array([[0.6, 0.4]]))
    inputs = LossInputs(logp=p_o, old_logp=p_o, advantages=jnp.array([[1.0, -1.0]]),
                        mask=jnp.ones((1, 2)), behavior_logp=p_b)
    against_pb = chain(TokenRatio(denominator="behavior"), PPOClip(), Aggregate())
    loss, metrics, grad = grad_logp(against_pb, inputs)
    # r = (1.5, 0.667): objective (1.2, -0.8) -> loss -(1.2 - 0.8) / 2 = -0.2; both clipped.
    np.testing.assert_allclose(loss, -0.2, rtol=1e-6)
    np.testing.assert_array_equal(grad, [[0.0, 0.0]])
    assert float(metrics["train/pg_clipfrac_high"]) == 0.5
    assert float(metrics["train/pg_clipfrac_low"]) == 0.5
    np.testing.assert_allclose(metrics["train/ratio_max"], 1.5, rtol=1e-6)
    # ppo_kl stays 0 (it compares p_old with p_c); the p_o / p_b drift shows in tis_abs:
    # mean(|1.5 - 1|, |0.667 - 1|) = (0.5 + 0.333) / 2 = 0.41667.
    assert float(metrics["train/ppo_kl"]) == 0.0
    np.testing.assert_allclose(metrics["train/tis_abs"], 0.416667, rtol=1e-5)
    # Against p_o: r = 1, loss -(1 - 1) / 2 = 0 and d loss / d logp = -A / 2 = (-0.5, +0.5).
    loss, metrics, grad = grad_logp(chain(TokenRatio(), PPOClip(), Aggregate()), inputs)
    np.testing.assert_allclose(grad, [[-0.5, 0.5]], rtol=1e-6)
    assert float(metrics["train/pg_clipfrac_high"]) == 0.0


def test_tis_weights_the_objective():
    # r = 1, A = 1 at two tokens; p_old / p_b = (1.5, 3.0) -> TIS cap 2 -> weights (1.5, 2.0).
    logp = jnp.log(jnp.array([[0.6, 0.9]]))
    inputs = LossInputs(logp=logp, old_logp=logp, advantages=jnp.array([1.0]), mask=jnp.ones((1, 2)),
                        behavior_logp=jnp.log(jnp.array([[0.4, 0.3]])))
    loss, metrics, grad = grad_logp(chain(TokenRatio(), TIS(cap=2.0), PPOClip(), Aggregate()), inputs)
    # loss = -(1.5 + 2.0) / 2 = -1.75; gradient -w / 2 = (-0.75, -1.0)
    np.testing.assert_allclose(loss, -1.75, rtol=1e-6)
    np.testing.assert_allclose(grad, [[-0.75, -1.0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["train/tis_mean"], 2.25, rtol=1e-6)  # (1.5 + 3) / 2
    np.testing.assert_allclose(metrics["train/tis_abs"], 1.25, rtol=1e-6)  # (0.5 + 2) / 2
    np.testing.assert_allclose(metrics["train/tis_clipfrac"], 0.5)


def test_mis_denominator_options():
    # Three tokens, r = 1, A = 1; p_old / p_b = (1, 1, 4): the third token is dropped (> 2).
    logp = jnp.log(jnp.array([[0.2, 0.2, 0.8]]))
    behavior = jnp.log(jnp.array([[0.2, 0.2, 0.2]]))
    inputs = LossInputs(logp=logp, old_logp=logp, advantages=jnp.array([1.0]),
                        mask=jnp.ones((1, 3)), behavior_logp=behavior)
    for normalize_by, expected in (("all", -2 / 3), ("kept", -2 / 2)):
        loss_fn = chain(TokenRatio(), MIS(threshold=2.0, normalize_by=normalize_by), PPOClip(), Aggregate())
        loss, metrics = loss_fn(inputs)
        # "all": (1 + 1 + 0) / 3 tokens; "kept": (1 + 1) / 2 kept tokens.
        np.testing.assert_allclose(loss, expected, rtol=1e-6)
        np.testing.assert_allclose(metrics["train/mis_masked_frac"], 1 / 3, rtol=1e-6)


def test_kl_and_entropy_terms():
    logp = jnp.log(jnp.array([[0.5, 0.25]]))
    inputs = LossInputs(logp=logp, old_logp=logp, advantages=jnp.array([0.0]), mask=jnp.ones((1, 2)),
                        ref_logp=jnp.log(jnp.array([[0.25, 0.5]])), entropy=jnp.array([[1.0, 2.0]]))
    loss_fn = chain(TokenRatio(), PPOClip(), Aggregate(), KLPenalty(beta=0.5, kind="k3"), EntropyBonus(coef=0.1))
    loss, metrics = loss_fn(inputs)
    # k3 = (0.193147, 0.306853), mean 0.25 -> kl_loss = 0.5 * 0.25 = 0.125
    # entropy mean 1.5 -> entropy_loss = -0.1 * 1.5 = -0.15; A = 0 -> pg_loss = 0
    np.testing.assert_allclose(metrics["train/ref_kl"], 0.25, rtol=1e-5)
    np.testing.assert_allclose(metrics["train/kl_loss"], 0.125, rtol=1e-5)
    np.testing.assert_allclose(metrics["train/entropy"], 1.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["train/entropy_loss"], -0.15, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.125 - 0.15, rtol=1e-5)


def test_importance_weighted_kl_term():
    logp = jnp.log(jnp.array([[0.5, 0.25]]))
    inputs = LossInputs(logp=logp, old_logp=jnp.log(jnp.array([[0.25, 0.125]])),
                        advantages=jnp.array([0.0]), mask=jnp.ones((1, 2)),
                        ref_logp=jnp.log(jnp.array([[0.25, 0.5]])))
    term = KLPenalty(beta=0.5, kind="k3", importance_weighted=True)
    loss_fn = chain(TokenRatio(), PPOClip(), Aggregate(), term)
    assert "KLPenalty(beta=0.5, kind='k3'" in repr(loss_fn)
    assert "importance_weighted=True" in repr(loss_fn)
    loss, metrics, grad = grad_logp(loss_fn, inputs)
    # rho = p_c / p_old = (2, 2); k3 = (0.193147, 0.306853); rho * k3 = (0.386294, 0.613706),
    # mean 0.5 -> kl_loss = 0.5 * 0.5 = 0.25 (plain k3 would give 0.125); A = 0 -> pg_loss = 0
    np.testing.assert_allclose(metrics["train/ref_kl"], 0.5, rtol=1e-5)
    np.testing.assert_allclose(metrics["train/kl_loss"], 0.25, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.25, rtol=1e-5)
    # d loss / d logp = beta / 2 * rho * (logp - ref_logp) = 0.25 * (2 ln 2, -2 ln 2)
    np.testing.assert_allclose(grad[0], [0.5 * math.log(2), -0.5 * math.log(2)], rtol=1e-5)
    # The preset wires it through; it needs a KL term and excludes straight-through.
    assert "importance_weighted=True" in repr(losses.grpo(kl_importance_weighted=True))
    with pytest.raises(ValueError, match="kl_importance_weighted=True needs a KL term"):
        losses.grpo(kl_beta=0.0, kl_importance_weighted=True)
    with pytest.raises(ValueError, match="importance_weighted=True and straight_through=True"):
        KLPenalty(importance_weighted=True, straight_through=True)
    with pytest.raises(ValueError, match=r"KLPenalty: importance_weighted='yes' .*False, True"):
        KLPenalty(importance_weighted="yes")


def test_gspo_and_gspo_token_agree_on_sequence_advantages():
    inputs = make_inputs()
    full = chain(SequenceRatio(), PPOClip(eps_low=10.0, eps_high=10.0), Aggregate(mode="seq_mean_token_mean"))
    tok = chain(SequenceRatio(token_grad=True), PPOClip(eps_low=10.0, eps_high=10.0), Aggregate(mode="seq_mean_token_mean"))
    l_full, _, g_full = grad_logp(full, inputs)
    l_tok, _, g_tok = grad_logp(tok, inputs)
    np.testing.assert_allclose(l_full, l_tok, rtol=1e-6)
    np.testing.assert_allclose(g_full, g_tok, rtol=1e-5, atol=1e-7)
    # With per-token advantages the two differ: GSPO-token lets each token's A act on itself.
    per_token = inputs._replace(advantages=jnp.arange(B * T, dtype=jnp.float32).reshape(B, T) - 10)
    _, _, g_full = grad_logp(full, per_token)
    _, _, g_tok = grad_logp(tok, per_token)
    assert not np.allclose(g_full, g_tok)


def test_per_sequence_and_per_token_advantages_agree():
    inputs = make_inputs()
    loss_a, _ = losses.dapo()(inputs)
    loss_b, _ = losses.dapo()(inputs._replace(advantages=jnp.broadcast_to(ADV[:, None], (B, T))))
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_full_batch(name):
    # Global counts in LossInputs make micro-batch losses and gradients sum to the full batch.
    loss_fn = PRESETS[name]
    inputs = make_inputs()
    full_loss, _, full_grad = grad_logp(loss_fn, inputs)
    counts = dict(global_num_tokens=losses.num_tokens(MASK), global_num_sequences=losses.num_sequences(MASK))
    total, grads = 0.0, []
    for rows in (slice(0, 1), slice(1, 4)):
        micro = jax.tree.map(lambda x: x[rows], inputs)._replace(**counts)
        loss, _, grad = grad_logp(loss_fn, micro)
        total += loss
        grads.append(grad)
    np.testing.assert_allclose(total, full_loss, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(grads), full_grad, rtol=1e-5, atol=1e-8)


def test_loss_is_negative_objective():
    # r = 1, A = +1 everywhere: objective 1 per token, loss -1 under every reduction but constant.
    logp = jnp.full((1, 3), -1.0)
    inputs = LossInputs(logp=logp, old_logp=logp, advantages=jnp.array([1.0]), mask=jnp.ones((1, 3)))
    loss, _ = losses.dapo()(inputs)
    assert float(loss) == -1.0
    loss, _ = losses.dr_grpo(max_len=6)(inputs)
    np.testing.assert_allclose(loss, -3 / 6)  # sum 3 / (1 sequence * 6)


def test_custom_transform_composes():
    @dataclasses.dataclass(frozen=True)
    class PositiveOnly:
        """Drop tokens with A <= 0 from the policy gradient (a research-style correction)."""

        stage: ClassVar[str] = "correction"

        def __call__(self, inputs, state):
            keep = (state["advantages"] > 0).astype(jnp.float32)
            return {**state, "weight": state["weight"] * keep}, {"train/pos_frac": jnp.mean(keep)}

    loss_fn = chain(TokenRatio(), PositiveOnly(), PPOClip(), Aggregate())
    assert "PositiveOnly()" in repr(loss_fn)
    loss, metrics = jax.jit(loss_fn)(make_inputs(same=True))
    # Only rows 0 (A = 1, 4 tokens) and 2 (A = 0.5, 2 tokens) count: (4 * 1 + 2 * 0.5) / 13 tokens.
    np.testing.assert_allclose(loss, -5 / 13, rtol=1e-6)
    assert "train/pos_frac" in metrics


def test_config_errors_name_field_and_choices():
    with pytest.raises(ValueError, match=r"Aggregate: mode='tokens' .*'token_mean'"):
        Aggregate(mode="tokens")
    with pytest.raises(ValueError, match="Aggregate: max_len=None"):
        Aggregate(mode="constant")
    with pytest.raises(ValueError, match=r"KLPenalty: kind='k5' .*'k1', 'k2', 'k3'"):
        KLPenalty(kind="k5")
    with pytest.raises(ValueError, match=r"MIS: level='seq' .*'token', 'sequence'"):
        MIS(level="seq")
    with pytest.raises(ValueError, match=r"TokenRatio: denominator='ref' .*'old', 'behavior'"):
        TokenRatio(denominator="ref")
    with pytest.raises(ValueError, match="PPOClip: dual_clip=1.0"):
        PPOClip(dual_clip=1.0)
    with pytest.raises(ValueError, match="out of order"):
        chain(PPOClip(), TokenRatio(), Aggregate())
    with pytest.raises(ValueError, match="exactly one 'aggregation'"):
        chain(TokenRatio(), PPOClip())
    with pytest.raises(ValueError, match="exactly one 'objective'"):
        chain(TokenRatio(), PPOClip(), CISPO(), Aggregate())
    with pytest.raises(ValueError, match="not a transform"):
        chain(TokenRatio(), lambda i, s: (s, {}), PPOClip(), Aggregate())
    logp = jnp.zeros((1, 2))
    no_behavior = LossInputs(logp=logp, old_logp=logp, advantages=jnp.ones(1), mask=jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="needs LossInputs.behavior_logp"):
        chain(TokenRatio(), TIS(), PPOClip(), Aggregate())(no_behavior)
    with pytest.raises(ValueError, match="needs LossInputs.ref_logp"):
        losses.grpo()(no_behavior)
    assert math.isfinite(float(losses.grpo(kl_beta=0.0)(no_behavior)[0]))
