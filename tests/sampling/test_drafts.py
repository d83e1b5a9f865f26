"""Draft sources (jrl.sampling.drafts) on hand-written inputs; the draft model and the MTP
head drafting inside the sampler are tested in test_speculative.py and
test_speculative_mtp.py."""

import jax.numpy as jnp
import numpy as np

from jrl.sampling import drafts as draft_sources


def test_speculative_ngram_drafts_hand_computed():
    history = np.zeros((4, 10), np.int32)
    # Row 0: 5 6 7 5 6 | p = 4. Suffix (7,5,6) has no earlier occurrence; (5,6) ends at j = 1,
    # so the draft is history[2 .. 4] = 7 5 6 (p - j = 3 known tokens, k = 4).
    history[0, :5] = [5, 6, 7, 5, 6]
    # Row 1: 1 2 3 4 | p = 3: no earlier 4, no draft.
    history[1, :4] = [1, 2, 3, 4]
    # Row 2: 9 8 9 8 9 | p = 4. (9,8,9) ends at j = 2 (and at 4 = p itself, excluded):
    # draft history[3 .. 4] = 8 9 (p - j = 2).
    history[2, :5] = [9, 8, 9, 8, 9]
    # Row 3: 3 1 2 3 | p = 3, max_n 3: (1,2,3) and (2,3) have no earlier end; (3) ends at 0:
    # the longest n with a match is 1, draft 1 2 3 (p - j = 3).
    history[3, :4] = [3, 1, 2, 3]
    drafts = draft_sources.ngram_drafts(jnp.asarray(history), jnp.asarray([4, 3, 4, 3]), 4, 3, 1)
    count = np.asarray(drafts.count)
    tokens = np.asarray(drafts.tokens)
    assert count.tolist() == [3, 0, 2, 3]
    assert tokens[0, :3].tolist() == [7, 5, 6]
    assert tokens[2, :2].tolist() == [8, 9]
    assert tokens[3, :3].tolist() == [1, 2, 3]
    # ngram_min = 2 refuses row 3's single-token match.
    assert np.asarray(draft_sources.ngram_drafts(jnp.asarray(history), jnp.asarray([4, 3, 4, 3]),
                                               4, 3, 2).count).tolist() == [3, 0, 2, 0]
