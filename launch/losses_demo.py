"""Demo of jrl.losses on the seed article's worked numbers (`python -m launch.losses_demo`).

Every number printed is computed by the library, not typed in. (A real RL run will replace this.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl import losses


def advantage_table() -> None:
    print("1. Group advantages, G = 8 binary rewards (population std; unbiased std in brackets)")
    print(f"   {'correct':>8} {'GRPO A+':>9} {'GRPO A-':>9} {'Dr.GRPO A+':>11} {'Dr.GRPO A-':>11}"
          f" {'sum A^2 GRPO':>13} {'sum A^2 Dr':>11}")
    for num_correct in (2, 1, 4):
        rewards = jnp.array([1.0] * num_correct + [0.0] * (8 - num_correct))
        grpo = losses.group_advantages(rewards, 8)
        unbiased = losses.group_advantages(rewards, 8, unbiased=True)
        dr = losses.group_advantages(rewards, 8, std_power=0.0)
        print(f"   {num_correct:>6}/8 {grpo[0]:>+9.3f} {grpo[-1]:>+9.3f} {dr[0]:>+11.3f} {dr[-1]:>+11.3f}"
              f" {jnp.sum(grpo**2):>13.3f} {jnp.sum(dr**2):>11.3f}"
              f"   [unbiased: {unbiased[0]:+.3f} / {unbiased[-1]:+.3f}]")
    print("   GRPO: sum A^2 = G = 8 for every mixed group; Dr.GRPO: G p (1 - p).\n")


def clipping_table() -> None:
    print("2. PPO clipping, eps = 0.2 (trust region [0.8, 1.2]); gradient = d objective / d ratio")
    ratio = jnp.array([1.3, 0.7, 0.7, 1.3, 1.25, 1.25, 0.5])
    adv = jnp.array([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    eps_high = jnp.array([0.2, 0.2, 0.2, 0.2, 0.2, 0.28, 0.28])
    notes = [
        "A>0 moved too far: stop encouraging",
        "A>0 fell by mistake: keep pushing up",
        "A<0 pushed down enough: stop",
        "A<0 got likelier: keep pushing down",
        "PPO at 1.25: clipped",
        "DAPO clip-higher (0.28): still learns",
        "DAPO, A<0 at 0.5: clipped at 0.8",
    ]
    print(f"   {'A':>4} {'r':>5} {'eps_hi':>6} {'objective':>9} {'grad':>6}  meaning")
    for i in range(len(notes)):
        fn = lambda r: losses.clipped_objective(r, adv[i], eps_low=0.2, eps_high=float(eps_high[i])).objective
        value, grad = jax.value_and_grad(fn)(ratio[i])
        grad = grad + 0.0  # a zero gradient prints as 0.00, not -0.00
        print(f"   {adv[i]:>+4.0f} {ratio[i]:>5.2f} {eps_high[i]:>6.2f} {value:>+9.3f} {grad:>+6.2f}  {notes[i]}")
    print()


def mismatch_example() -> None:
    print("3. Train/inference mismatch at step 0 (same weights): p_b = (0.4, 0.6), p_o = (0.6, 0.4)")
    p_b = jnp.log(jnp.array([[0.4, 0.6]]))
    p_o = jnp.log(jnp.array([[0.6, 0.4]]))
    inputs = losses.LossInputs(logp=p_o, old_logp=p_o, advantages=jnp.array([[1.0, -1.0]]),
                               mask=jnp.ones((1, 2)), behavior_logp=p_b)
    for denominator, label in (("behavior", "p_b (sampler)"), ("old", "p_o (trainer)")):
        loss_fn = losses.chain(losses.TokenRatio(denominator=denominator), losses.PPOClip(),
                               losses.Aggregate(mode="token_mean"))
        (loss, metrics), grad = jax.value_and_grad(
            lambda lp: loss_fn(inputs._replace(logp=lp)), has_aux=True)(p_o)
        grad = grad + 0.0
        ratio = losses.token_ratio(p_o, p_b if denominator == "behavior" else p_o)
        clipped = float(metrics["train/pg_clipfrac_low"] + metrics["train/pg_clipfrac_high"])
        print(f"   ratio against {label:<14}: r = ({ratio[0, 0]:.3f}, {ratio[0, 1]:.3f})"
              f"  clipped = {clipped:.0%}  d loss / d logp = ({grad[0, 0]:+.2f}, {grad[0, 1]:+.2f})")
    print("   Against p_b both tokens are clipped and learn nothing; against p_o, r = 1 and the\n"
          "   gradient is -A / N * grad logp. (tis_abs logs the hidden p_o / p_b drift.)\n")


def reduction_weights() -> None:
    print("4. Per-token weights (d loss / d value) for answers of 100 and 10000 tokens")
    length = 10_000
    mask = jnp.stack([jnp.arange(length) < 100, jnp.ones(length, bool)])
    for mode in losses.AGGREGATION_MODES:
        weights = jax.grad(lambda v: losses.aggregate(v, mask, mode, max_len=length))(jnp.zeros(mask.shape))
        print(f"   {mode:<20}: short token {weights[0, 0]:.3e}  long token {weights[1, 0]:.3e}"
              f"  (ratio {weights[0, 0] / weights[1, 0]:.0f}x)")
    print()


def overlong_and_gspo() -> None:
    print("5. DAPO overlong penalty (max_len 20480, buffer 4096) and the GSPO sequence ratio")
    lengths = jnp.array([16384, 18432, 20480, 25000])
    penalty = losses.overlong_penalty(lengths, max_len=20480, buffer_len=4096)
    print("   " + ", ".join(f"{int(n)} -> {p:+.2f}" for n, p in zip(lengths, penalty)))
    old = jnp.full((1, 1000), -2.0)
    seq = losses.sequence_ratio(old + jnp.log(1.01), old, jnp.ones_like(old))
    print(f"   1000 tokens with r = 1.01: GSPO ratio {seq[0]:.4f} (raw product 1.01^1000 = {1.01 ** 1000:.0f})\n")


def presets() -> None:
    print("6. Preset chains (each prints exactly what it computes)")
    for loss_fn in (losses.grpo(), losses.dapo(), losses.dr_grpo(max_len=4096), losses.gspo(), losses.cispo()):
        print("   " + repr(loss_fn).replace("\n", "\n   "))


def main() -> None:
    print("jrl.losses demo: the seed article's worked numbers\n")
    advantage_table()
    clipping_table()
    mismatch_example()
    reduction_weights()
    overlong_and_gspo()
    presets()


if __name__ == "__main__":
    main()
