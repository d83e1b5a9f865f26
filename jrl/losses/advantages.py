"""Group-relative advantages (GRPO, Dr.GRPO and the std-power spectrum between them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, as_groups, check_positive, f32


def group_advantages(
    rewards: Array,
    group_size: int,
    *,
    std_power: float = 1.0,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> Array:
    """Group-normalised advantages, one per sequence.

    For each group g of `group_size` consecutive sequences (the G samples of one prompt):

        A_i = (R_i - mean_g(R)) / (std_g(R) + eps) ** std_power

    - `std_power=1` is GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300);
    - `std_power=0` is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training",
      arXiv:2503.20783): centring only, A_i = R_i - mean;
    - 0 < std_power < 1 interpolates (the "alpha" spectrum of the seed article).

    Groups whose rewards are all equal get exactly 0 (not `0 / eps`, which float rounding of the
    mean could make nonzero): they carry no learning signal, and std is 0 there.

    Which std (frameworks disagree):
    - `unbiased=False` (default): population std, sqrt(sum (R - mean)^2 / G). The seed article's
      worked numbers use it (2 of 8 correct -> +1.732 / -0.577), and with it sum_i A_i^2 = G for
      every non-constant group (eps=0), which is the property Dr.GRPO criticises.
    - `unbiased=True`: sample std, sqrt(sum (R - mean)^2 / (G - 1)), as verl, slime and Tunix
      compute it (torch.std default), with eps 1e-6. Needs group_size >= 2.

    Args:
      rewards: [B] scalar reward per sequence; B must be a multiple of group_size.
      group_size: G, the number of consecutive sequences per group.
      std_power: exponent on (std + eps); must be >= 0.
      eps: added to std before the power; must be >= 0.
      unbiased: use the sample (G - 1) std instead of the population (G) std.

    Returns:
      [B] float32 advantages. Stop-gradient: no gradient flows back into `rewards`.
    """
    where = "group_advantages"
    check_positive(where, "std_power", std_power, allow_zero=True)
    check_positive(where, "eps", eps, allow_zero=True)
    rewards = jax.lax.stop_gradient(f32(rewards))
    groups = as_groups(rewards, group_size, where)  # [num_groups, G]
    if unbiased and group_size < 2:
        raise ValueError(
            f"{where}: group_size={group_size} is not allowed with unbiased=True; the sample std "
            "needs group_size >= 2 (use unbiased=False for groups of one)."
        )
    centered = groups - jnp.mean(groups, axis=-1, keepdims=True)
    dof = group_size - 1 if unbiased else group_size
    std = jnp.sqrt(jnp.sum(centered**2, axis=-1, keepdims=True) / dof)
    advantages = centered / (std + eps) ** std_power
    constant = jnp.max(groups, axis=-1, keepdims=True) == jnp.min(groups, axis=-1, keepdims=True)
    advantages = jnp.where(constant, 0.0, advantages)
    return advantages.reshape(-1)
