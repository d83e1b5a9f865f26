"""jrl.sampling.truncation: top-k / top-p as a logit floor, and drawing under it."""

import jax
import jax.numpy as jnp
import numpy as np

from jrl.sampling import logit_floor, sample_from_floor
from jrl.sampling.truncation import DRAW_CHUNK, draw_from_logits

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


# A vocabulary of 600 spans three chunks of the two-level draw: 0-255, 256-511 and 512-599
# (the last padded to 256). Only six tokens are kept; chunk 1 keeps none.
WIDE_KEPT = np.array([3, 100, 255, 512, 540, 599])
WIDE_PROBS = np.array([0.1, 0.2, 0.15, 0.25, 0.2, 0.1])          # sums to 1


def wide_logits(rows):
    z = np.full((rows, 600), np.log(0.01), np.float32)             # below the floor
    z[:, WIDE_KEPT] = np.log(WIDE_PROBS)
    return jnp.asarray(z), jnp.full((rows,), np.log(0.1), jnp.float32)   # floor: p >= 0.1


def test_two_level_draw_over_several_chunks_has_the_kept_set_frequencies():
    assert DRAW_CHUNK == 256
    draws = 40000
    z, floor = wide_logits(draws)
    keys = jax.random.split(jax.random.key(3), draws)
    tokens = np.asarray(jax.jit(sample_from_floor)(keys, z, floor))
    assert set(np.unique(tokens)) <= set(WIDE_KEPT.tolist())
    freq = np.bincount(tokens, minlength=600)[WIDE_KEPT] / draws
    # Chunk masses 0.1 + 0.2 + 0.15 = 0.45 (chunk 0) and 0.25 + 0.2 + 0.1 = 0.55 (chunk 2);
    # a token's frequency is its chunk's share times its share in the chunk, i.e. its p.
    # Binomial std <= sqrt(0.25 / 40000) = 0.0025; 0.0125 is 5 sigma.
    np.testing.assert_allclose(freq, WIDE_PROBS, atol=0.0125)
    chunk0 = np.mean(tokens < 256)
    assert abs(chunk0 - 0.45) < 0.0125


def test_two_level_draw_of_a_row_does_not_depend_on_its_batch():
    """The chunk masses are summed by elementwise adds in a fixed order, so a row draws the
    same token alone, in a batch of 40 or in a batch of other shape (what plain decoding,
    verify passes and prefill rely on for speculative coupling)."""
    z = jax.random.normal(jax.random.key(4), (40, 1000), jnp.float32) * 4.0
    keys = jax.random.split(jax.random.key(5), 40)
    batch = np.asarray(jax.jit(draw_from_logits)(keys, z))
    alone = [int(jax.jit(draw_from_logits)(keys[i:i + 1], z[i:i + 1])[0]) for i in range(40)]
    thirds = np.concatenate([np.asarray(jax.jit(draw_from_logits)(keys[i:j], z[i:j]))
                             for i, j in ((0, 13), (13, 26), (26, 40))])
    assert batch.tolist() == alone == thirds.tolist()
    assert len(set(alone)) > 20                  # the draws do vary with the key
