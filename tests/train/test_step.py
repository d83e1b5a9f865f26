"""The pure train step: micro-batch accumulation, versions, SFT step, optimizer config."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jrl import losses
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.train import (OptimizerConfig, SFTBatch, TrainBatch, create_train_state, make_optimizer,
                       make_sft_step, make_train_step)
from jrl.train.step import apply_update

CONFIG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16)
CONTRACT = NumericalContract(backend="pallas")


def _batch(rows=8, seq=12, seed=0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 32, (rows, seq)).astype(np.int32)
    lengths = rng.integers(5, seq + 1, rows)
    prompt = 3
    attn = np.arange(seq)[None] < lengths[:, None]
    loss_mask = attn & (np.arange(seq)[None] >= prompt)
    old = np.where(loss_mask, -rng.uniform(0.5, 3.0, (rows, seq)), 0).astype(np.float32)
    return TrainBatch(tokens=jnp.asarray(tokens), attn_mask=jnp.asarray(attn),
                      loss_mask=jnp.asarray(loss_mask),
                      advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
                      old_logp=jnp.asarray(old), behavior_logp=jnp.asarray(old),
                      ref_logp=jnp.asarray(old), logit_floor=jnp.full((rows, seq), -jnp.inf))


@pytest.mark.parametrize("preset", ["dapo", "grpo"])
def test_micro_batch_split_gives_the_same_update_as_one_batch(preset):
    # token_mean (dapo) and seq_mean_token_mean (grpo) both normalise every micro-batch by the
    # WHOLE batch's counts, so 4 micro-batches of 2 rows sum to the 8-row loss and gradient.
    loss_fn = losses.dapo() if preset == "dapo" else losses.grpo(kl_beta=0.0)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=None))
    params = transformer.init_params(CONFIG, jax.random.key(0))
    state = create_train_state(params, optimizer, jax.random.PRNGKey(0))
    batch = _batch()
    one = jax.jit(make_train_step(CONFIG, CONTRACT, loss_fn, optimizer, num_micro_batches=1))
    four = jax.jit(make_train_step(CONFIG, CONTRACT, loss_fn, optimizer, num_micro_batches=4))
    state_one, metrics_one = one(state, batch)
    state_four, metrics_four = four(state, batch)
    # Only the float summation order differs (whole batch vs 4 partial sums).
    np.testing.assert_allclose(metrics_four["train/loss"], metrics_one["train/loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics_four["train/grad_norm"], metrics_one["train/grad_norm"],
                               rtol=1e-4)
    # Adam divides by sqrt(v): a near-zero gradient's rounding shows in its update, so compare
    # at 0.1% of the step size (lr 1e-2).
    for a, b in zip(jax.tree.leaves(state_one.params), jax.tree.leaves(state_four.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert int(state_four.version) == int(state.version) + 1 == int(state_four.step)
    # Token-weighted metrics combine exactly as one batch would report them.
    np.testing.assert_allclose(metrics_four["train/entropy"], metrics_one["train/entropy"],
                               rtol=1e-5)


def test_train_step_rejects_a_batch_that_does_not_split():
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3))
    state = create_train_state(transformer.init_params(CONFIG, jax.random.key(0)), optimizer,
                               jax.random.PRNGKey(0))
    step = make_train_step(CONFIG, CONTRACT, losses.dapo(), optimizer, num_micro_batches=3)
    with pytest.raises(ValueError, match="train.micro_batches=3"):
        step(state, _batch(rows=8))


def test_sft_step_lowers_cross_entropy_and_keeps_the_version():
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2))
    state = create_train_state(transformer.init_params(CONFIG, jax.random.key(0)), optimizer,
                               jax.random.PRNGKey(0))
    batch = _batch()
    sft = SFTBatch(batch.tokens, batch.attn_mask, batch.loss_mask)
    step = jax.jit(make_sft_step(CONFIG, CONTRACT, optimizer))
    losses_seen = []
    for _ in range(5):
        state, metrics = step(state, sft)
        losses_seen.append(float(metrics["sft/loss"]))
    assert losses_seen[-1] < losses_seen[0]
    # ln(32) = 3.47: a random 32-token model starts near uniform.
    assert abs(losses_seen[0] - np.log(32)) < 0.5
    assert int(state.version) == 0 and int(state.step) == 5


@pytest.mark.parametrize("field, value, message", [
    ("schedule", "exp", "optimizer.schedule='exp': allowed values are"),
    ("learning_rate", 0.0, "optimizer.learning_rate=0.0: must be > 0"),
    ("max_grad_norm", -1.0, "optimizer.max_grad_norm=-1.0"),
])
def test_optimizer_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        OptimizerConfig(**{field: value})


def test_a_non_finite_update_is_skipped_and_flagged():
    """apply_update keeps params and optimizer state when the loss or gradient is not finite
    (train/update_skipped = 1), and applies a finite one unchanged (0)."""
    params = {"w": jnp.ones((3,), jnp.float32)}
    optimizer = optax.sgd(0.5)
    state = create_train_state(params, optimizer, jax.random.PRNGKey(0))
    good = {"w": jnp.array([1.0, 2.0, 3.0], jnp.float32)}
    new, metrics = apply_update(state, good, optimizer, {"train/loss": jnp.float32(1.0)}, 3.0)
    # sgd: w - 0.5 * g = 1 - (0.5, 1, 1.5) = (0.5, 0, -0.5)
    np.testing.assert_array_equal(np.asarray(new.params["w"]), [0.5, 0.0, -0.5])
    assert float(metrics["train/update_skipped"]) == 0.0 and int(new.version) == 1
    bad = {"w": jnp.array([1.0, jnp.nan, 3.0], jnp.float32)}
    new, metrics = apply_update(state, bad, optimizer, {"train/loss": jnp.float32(1.0)}, 3.0)
    np.testing.assert_array_equal(np.asarray(new.params["w"]), [1.0, 1.0, 1.0])
    assert float(metrics["train/update_skipped"]) == 1.0 and int(new.version) == 1
    new, metrics = apply_update(state, good, optimizer, {"train/loss": jnp.float32(jnp.inf)}, 3.0)
    np.testing.assert_array_equal(np.asarray(new.params["w"]), [1.0, 1.0, 1.0])
    assert float(metrics["train/update_skipped"]) == 1.0


def test_a_token_excluded_by_its_floor_is_safe_out_of_the_mask():
    """A sampled token whose replayed truncation floor excludes it has p_c = -inf. Out of the
    loss mask (as jrl.pipeline.training.prepare puts it) the loss and the gradient stay finite; left in
    the mask, the log-ratio clamp (+-20) still keeps them finite, and no NaN reaches the
    params either way."""
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=1.0))
    params = transformer.init_params(CONFIG, jax.random.key(0))
    state = create_train_state(params, optimizer, jax.random.PRNGKey(0))
    batch = _batch()
    logits = np.asarray(transformer.forward_logits(params, CONFIG, batch.tokens,
                                                   contract=CONTRACT, mask=batch.attn_mask))
    # Row 0, position 4 (a response token): a floor between its logit and the best one.
    row, t = 0, 4
    target_logit = logits[row, t - 1, int(batch.tokens[row, t])]
    assert target_logit < logits[row, t - 1].max()
    floor = np.full(batch.logit_floor.shape, -np.inf, np.float32)
    floor[row, t] = (target_logit + logits[row, t - 1].max()) / 2
    step = jax.jit(make_train_step(CONFIG, CONTRACT, losses.dapo(), optimizer))
    outside = batch._replace(logit_floor=jnp.asarray(floor),
                             loss_mask=batch.loss_mask.at[row, t].set(False))
    new, metrics = step(state, outside)
    assert np.isfinite(float(metrics["train/loss"])) and np.isfinite(
        float(metrics["train/grad_norm"]))
    assert float(metrics["train/update_skipped"]) == 0.0
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new.params))
    inside = batch._replace(logit_floor=jnp.asarray(floor))
    new, metrics = step(state, inside)
    assert np.isfinite(float(metrics["train/loss"]))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(new.params))
