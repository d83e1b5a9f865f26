"""Tests for jrl.losses.filtering: useful groups and the all-correct / all-wrong counts."""

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import useful_groups


def test_counts(maybe_jit, dtype):
    # Four groups of 4: mixed, all correct, all wrong, mixed.
    rewards = jnp.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1], dtype)
    out = maybe_jit(lambda r: useful_groups(r, 4))(rewards)
    np.testing.assert_array_equal(out.useful, [True, False, False, True])
    np.testing.assert_array_equal(out.useful_sequences, [True] * 4 + [False] * 8 + [True] * 4)
    assert int(out.num_useful) == 2
    assert int(out.num_all_correct) == 1
    assert int(out.num_all_wrong) == 1


def test_signed_rewards_and_threshold():
    # {-1, +1} rewards: an all -1 group is all wrong, an all +1 group all correct.
    out = useful_groups(jnp.array([-1.0, -1.0, 1.0, 1.0, -1.0, 1.0]), 2)
    assert (int(out.num_useful), int(out.num_all_correct), int(out.num_all_wrong)) == (1, 1, 1)
    # Shaped rewards where 0.5 still means wrong: raise the threshold.
    out = useful_groups(jnp.array([0.5, 0.5]), 2, correct_above=0.5)
    assert int(out.num_all_wrong) == 1


def test_bad_group_size():
    with pytest.raises(ValueError, match="group_size=3 .*B=4"):
        useful_groups(jnp.zeros(4), 3)
