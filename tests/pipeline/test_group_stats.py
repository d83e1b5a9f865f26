"""The host-side group statistics agree with their jrl.losses references."""

import numpy as np
import pytest

from jrl import losses
from jrl.pipeline.rollout.group_stats import overlong_penalty, reward_spread


@pytest.mark.parametrize("max_len,buffer_len,factor", [(16, 4, 1.0), (48, 7, 0.3), (20, 20, 2.5)])
def test_overlong_penalty_equals_the_losses_reference(max_len, buffer_len, factor):
    lengths = np.arange(0, max_len + 5, dtype=np.int32)
    ours = overlong_penalty(lengths, max_len=max_len, buffer_len=buffer_len, factor=factor)
    reference = np.asarray(losses.overlong_penalty(lengths, max_len=max_len,
                                                   buffer_len=buffer_len, factor=factor))
    assert ours.dtype == np.float32
    # XLA's CPU division is not correctly rounded (e.g. 3/7 differs in the last bit from
    # numpy's), so the two agree to one ulp, and exactly wherever the ramp is 0 or 1.
    np.testing.assert_array_max_ulp(ours, reference, maxulp=1)
    flat = (lengths <= max_len - buffer_len) | (lengths >= max_len)
    assert ours[flat].tobytes() == reference[flat].tobytes()


def test_overlong_penalty_by_hand():
    # max_len 16, buffer 4: free up to 12; L=14 -> -(14 - 12) / 4 = -0.5; L >= 16 -> -1.
    out = overlong_penalty(np.array([12, 14, 16, 20]), max_len=16, buffer_len=4, factor=1.0)
    assert out.tolist() == [0.0, -0.5, -1.0, -1.0]
    assert not np.signbit(out[0])          # 0.0, not -0.0


@pytest.mark.parametrize("rewards", [[0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0],
                                     [0.0, 0.0, 0.0, 0.0], [-1.0, -1.0], [0.5, 0.5]])
def test_reward_spread_equals_useful_groups(rewards):
    reference = losses.useful_groups(np.asarray(rewards, np.float32), len(rewards))
    spread = reward_spread(np.asarray(rewards))
    assert spread.useful == bool(reference.num_useful)
    assert spread.all_correct == bool(reference.num_all_correct)
    assert spread.all_wrong == bool(reference.num_all_wrong)
