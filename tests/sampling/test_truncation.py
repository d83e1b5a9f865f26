"""jrl.sampling.truncation: top-k / top-p as a logit floor, and drawing under it."""

import jax
import jax.numpy as jnp
import numpy as np

from jrl.sampling import logit_floor, sample_from_floor

# probabilities 0.05, 0.5, 0.1, 0.2, 0.15 (shuffled on purpose); z = log p, so softmax(z) = p.
PROBS = np.array([0.05, 0.5, 0.1, 0.2, 0.15])
Z = jnp.log(jnp.asarray(PROBS, jnp.float32))[None]


def kept(z, floor):
    return np.flatnonzero(np.asarray(z[0] >= floor[0]))


def test_no_truncation_floor_is_minus_inf():
    assert float(logit_floor(Z)[0]) == -np.inf


def test_top_k_keeps_exactly_k():
    z = jnp.asarray([[3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.6]])  # no ties
    for k, expected in ((1, [5]), (3, [2, 4, 5]), (4, [0, 2, 4, 5]), (7, range(7)),
                        (50, range(7))):
        floor = logit_floor(z, top_k=k)
        assert list(kept(z, floor)) == list(expected), k


def test_top_p_keeps_the_minimal_set_reaching_the_mass():
    # Sorted: 0.5 (id 1), 0.2 (id 3), 0.15 (id 4), 0.1 (id 2), 0.05 (id 0); running mass
    # 0.5, 0.7, 0.85, 0.95, 1.0. No top_p below sits on a boundary (f32 rounding safe).
    cases = {
        0.45: [1],            # 0.5 >= 0.45: one token
        0.6: [1, 3],          # 0.5 < 0.6 <= 0.5 + 0.2 = 0.7
        0.75: [1, 3, 4],      # 0.7 < 0.75 <= 0.7 + 0.15 = 0.85
        0.9: [1, 2, 3, 4],    # 0.85 < 0.9 <= 0.85 + 0.1 = 0.95
        0.99: [0, 1, 2, 3, 4],
    }
    for top_p, expected in cases.items():
        floor = logit_floor(Z, top_p=top_p)
        assert sorted(kept(Z, floor)) == expected, top_p
        # The floor is the z of the last kept token, exactly.
        assert float(floor[0]) == float(Z[0, expected[-1] if len(expected) == 1 else
                                             min(expected, key=lambda i: PROBS[i])])


def test_top_k_and_top_p_intersect():
    # top_p 0.9 keeps 4 tokens, top_k 2 keeps 2: the larger floor (top-k's) wins.
    assert sorted(kept(Z, logit_floor(Z, top_k=2, top_p=0.9))) == [1, 3]
    # top_p 0.6 keeps 2, top_k 4 keeps 4: top-p's floor wins.
    assert sorted(kept(Z, logit_floor(Z, top_k=4, top_p=0.6))) == [1, 3]


def test_sample_from_floor_stays_in_the_kept_set_with_renormalised_frequencies():
    draws = 20000
    z = jnp.broadcast_to(Z, (draws, 5))
    floor = logit_floor(z, top_p=0.75)                          # keeps ids 1, 3, 4
    keys = jax.random.split(jax.random.key(0), draws)
    tokens = np.asarray(jax.jit(sample_from_floor)(keys, z, floor))
    assert set(np.unique(tokens)) == {1, 3, 4}
    freq = np.bincount(tokens, minlength=5) / draws
    expected = np.array([0, 0.5, 0, 0.2, 0.15]) / 0.85          # renormalised over 0.85 mass
    # Binomial std <= sqrt(0.25 / 20000) = 0.0035; 0.015 is > 4 sigma.
    np.testing.assert_allclose(freq, expected, atol=0.015)
