"""Group filters: which groups carry a learning signal (DAPO dynamic sampling)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, as_groups, f32


class UsefulGroups(NamedTuple):
    """Output of `useful_groups`."""

    useful: Array  # [B // G] bool: the group's rewards are not all equal
    useful_sequences: Array  # [B] bool: `useful` repeated over each group's sequences
    num_useful: Array  # int32 scalar
    num_all_correct: Array  # int32 scalar: zero-spread groups whose common reward > correct_above
    num_all_wrong: Array  # int32 scalar: zero-spread groups whose common reward <= correct_above


def useful_groups(rewards: Array, group_size: int, *, correct_above: float = 0.0) -> UsefulGroups:
    """Finds the groups with nonzero reward spread (DAPO dynamic sampling, arXiv:2503.14476).

    A group whose G rewards are all equal has all-zero group advantages, so it spends rollout
    compute and gives no policy gradient. With i.i.d. samples of success rate p,
    P(useful) = 1 - p^G - (1 - p)^G. Zero-spread groups are split by their common reward:
    "all correct" if it is > correct_above (0: right for {0, 1} and {-1, 1} rewards), else
    "all wrong" (these counts feed rollout/zero_std_groups_all_correct / _all_wrong).

    Args:
      rewards: [B] rewards; B a multiple of group_size; groups are consecutive rows.
      group_size: G.
      correct_above: reward level above which a zero-spread group counts as all correct.

    Returns:
      UsefulGroups; no gradient.
    """
    groups = as_groups(jax.lax.stop_gradient(f32(rewards)), group_size, "useful_groups")
    high = jnp.max(groups, axis=-1)
    useful = high > jnp.min(groups, axis=-1)
    flat = ~useful
    all_correct = flat & (high > correct_above)
    all_wrong = flat & ~(high > correct_above)
    return UsefulGroups(
        useful=useful,
        useful_sequences=jnp.repeat(useful, group_size),
        num_useful=jnp.sum(useful, dtype=jnp.int32),
        num_all_correct=jnp.sum(all_correct, dtype=jnp.int32),
        num_all_wrong=jnp.sum(all_wrong, dtype=jnp.int32),
    )
