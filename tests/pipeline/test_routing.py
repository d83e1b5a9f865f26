"""The routing metrics on hand-made arrays (jrl.pipeline.training.routing): which weights a recorded route
belongs to, which pairs are compared, and each metric's arithmetic."""

import numpy as np
import pytest

from jrl.metrics import names
from jrl.pipeline.training.routing import (expert_load_max, route_versions, routing_metrics,
                                  same_expert_set)


def test_route_versions_are_the_next_model_tokens():
    # Row 0: prompt (2 tokens), model tokens at versions 3, 3, 4, then padding. Position t's
    # route was made by the forward that drew the next model token: [3, 3, 3, 4, -1, -1].
    # Row 1: prompt, a model token (v5), an observation (-1), a model token (v6): the
    # observation and the token before it were fed in the append that drew the v6 token.
    versions = np.array([[-1, -1, 3, 3, 4, -1], [-1, 5, -1, 6, -1, -1]], np.int32)
    loss_mask = versions >= 0
    np.testing.assert_array_equal(route_versions(versions, loss_mask),
                                  [[3, 3, 3, 4, -1, -1], [5, 6, 6, -1, -1, -1]])


def test_same_expert_set_ignores_order():
    a = np.array([[1, 2], [3, 0], [1, 2]])
    b = np.array([[2, 1], [3, 1], [1, 2]])
    np.testing.assert_array_equal(same_expert_set(a, b), [True, False, True])


def test_expert_load_max_by_hand():
    # 4 experts, top-2, 3 tokens, 2 layers. Layer 0: pairs (0,1) (0,2) (0,3): expert 0 holds 3
    # of 6 pairs, share 1/2 over mean share 1/4 = 2.0. Layer 1: (0,1) (2,3) (0,1): max count 2
    # -> 2 * 4 / 6 = 1.333. The worst layer: 2.0. The masked-out 4th token (all on expert 3)
    # does not count.
    routes = np.array([[[[0, 1], [0, 1]], [[0, 2], [2, 3]], [[0, 3], [0, 1]],
                        [[3, 2], [3, 2]]]], np.int32)                    # [1, 4, 2, 2]
    mask = np.array([[True, True, True, False]])
    assert expert_load_max(routes, mask, 4) == pytest.approx(2.0)
    assert expert_load_max(routes[:, :, 1:], mask, 4) == pytest.approx(8 / 6)


def _batch():
    """One row: prompt of 1 token, model tokens at positions 1..4 with versions 0, 0, 1, 1 (a
    weight swap after position 2), then padding; 1 MoE layer, top-2 of 4 experts."""
    versions = np.array([[-1, 0, 0, 1, 1, -1]], np.int32)
    loss_mask = versions >= 0
    attn_mask = np.array([[True] * 5 + [False]])
    recorded = np.array([[[0, 1]], [[1, 2]], [[2, 3]], [[3, 0]], [[-1, -1]], [[-1, -1]]],
                        np.int32)[None]                                  # [1, 6, 1, 2]
    return versions, loss_mask, attn_mask, recorded


def test_routing_metrics_by_hand():
    versions, loss_mask, attn_mask, recorded = _batch()
    # Route versions: [0, 0, 1, 1, -1, -1]. Model-token positions with a route: 1 (v0), 2 (v1),
    # 3 (v1); position 4 was never fed. The sampler routed position 2 with v1 weights on top
    # of a v0 prefix (KV kept across the swap): no single version reproduces it, nor 3.
    # The train forward routes every token: its choices at the unfed / padding positions.
    routed = recorded.copy()
    routed[0, 4:, 0] = [[2, 1], [3, 3]]
    v0 = routed.copy()
    v0[0, 1, 0] = [2, 1]                   # same set as recorded at position 1 (order differs)
    v2 = routed.copy()
    v2[0, 1, 0] = [1, 3]                   # the current weights flip position 1
    v2[0, 0, 0] = [0, 0]                   # the prompt token is not a model token: not counted
    scored = {0: v0, 1: routed.copy(), 2: v2}
    keep = routing_metrics(recorded, scored, versions=versions, loss_mask=loss_mask,
                           attn_mask=attn_mask, trainer_version=2, kv_on_swap="keep",
                           num_experts=4)
    # Pairs: position 1 only (1 pair). Agreement 1 - 0/1; stale flips 1/1.
    assert keep[names.MISMATCH_ROUTING_PAIRS] == 1
    assert keep[names.MISMATCH_ROUTING_AGREEMENT] == 1.0
    assert keep[names.MISMATCH_ROUTING_STALE_FLIP_FRAC] == 1.0
    # Load under v2 over the 5 attended positions: pairs (0,0) (1,3) (2,3) (3,0) (2,1):
    # experts 0 and 3 hold 3 of 10 pairs each -> 3 * 4 / 10 = 1.2 (padding's (3,3) is out).
    assert keep[names.TRAIN_EXPERT_LOAD_MAX] == pytest.approx(1.2)

    # After a KV refresh every route is reproducible by its own version: positions 1, 2, 3.
    # Position 2 under v1 disagrees with the sampler: agreement 2/3. Stale flips vs v2:
    # position 1 ({1,2} vs {1,3}) only -> 1/3.
    scored[1] = routed.copy()
    scored[1][0, 2, 0] = [2, 0]
    refresh = routing_metrics(recorded, scored, versions=versions, loss_mask=loss_mask,
                              attn_mask=attn_mask, trainer_version=2, kv_on_swap="recompute",
                              num_experts=4)
    assert refresh[names.MISMATCH_ROUTING_PAIRS] == 3
    assert refresh[names.MISMATCH_ROUTING_AGREEMENT] == pytest.approx(2 / 3)
    # Position 2: v1 {0,2} vs v2 {2,3} flips too; position 3: {3,0} both. -> 2/3.
    assert refresh[names.MISMATCH_ROUTING_STALE_FLIP_FRAC] == pytest.approx(2 / 3)


def test_versions_no_longer_held_are_not_compared():
    versions, loss_mask, attn_mask, recorded = _batch()
    # Only the current version (1) is held: the v0 route of position 1 is skipped; under
    # refresh positions 2 and 3 (v1) are compared, both equal to the sampler's.
    routed = np.where(recorded >= 0, recorded, 0)
    out = routing_metrics(recorded, {1: routed}, versions=versions, loss_mask=loss_mask,
                          attn_mask=attn_mask, trainer_version=1, kv_on_swap="recompute",
                          num_experts=4)
    assert out[names.MISMATCH_ROUTING_PAIRS] == 2
    assert out[names.MISMATCH_ROUTING_AGREEMENT] == 1.0
    assert out[names.MISMATCH_ROUTING_STALE_FLIP_FRAC] == 0.0
