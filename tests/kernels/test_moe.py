"""jrl.kernels.moe: router and expert layer against transformers' Qwen3-MoE, the dispatch by hand,
bitwise batch invariance, gradients, and TPU / GPU lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeSparseMoeBlock,
                                                              Qwen3MoeTopKRouter)

from jrl import kernels
from jrl.kernels import NumericalContract, _grid, moe

from .helpers import ATOL, DTYPES, assert_bitwise_equal, normal
from .test_platforms import HAVE_TPU_INTERPRET

E, D, F = 8, 40, 24            # odd model dims on purpose
# Tiles smaller than D and F so the expert kernels cross several K tiles (with a narrower last
# one) and N tiles (the last shifted left); 8-row expert tiles so groups need padding.
SMALL = dict(matmul_block_m=8, matmul_block_n=16, matmul_block_k=16, norm_block_rows=8,
             logprob_block_rows=8)


def _contract(dtype="float32", backend="pallas"):
    """float32 runs the SMALL tiles (every tiling path); bfloat16 runs
    NumericalContract.for_platform("cpu"), what a CPU sampler and trainer run (each expert dot
    one whole [16, D] x [D, F] tile)."""
    if dtype == "bfloat16":
        return NumericalContract.for_platform("cpu", compute_dtype=dtype, backend=backend)
    return NumericalContract(platform="cpu", compute_dtype=dtype, backend=backend, **SMALL)


def _weights(rng, dtype="float32"):
    """w_gate, w_up [E, D, F], w_down [E, F, D] (scaled so activations stay O(1))."""
    return (normal(rng, (E, D, F), dtype, 0.3), normal(rng, (E, D, F), dtype, 0.3),
            normal(rng, (E, F, D), dtype, 0.3))


@functools.lru_cache(maxsize=None)
def _layer(contract, top_k, norm_topk_prob=True):
    """jit(x, router_logits, w_gate, w_up, w_down -> (y, Routing))."""
    def layer(x, logits, w_gate, w_up, w_down):
        r = kernels.route(logits, top_k=top_k, norm_topk_prob=norm_topk_prob, contract=contract)
        return kernels.moe_experts(x, r.experts, r.weights, w_gate, w_up, w_down,
                                   contract=contract), r
    return jax.jit(layer)


@functools.lru_cache(maxsize=None)
def _batch(dtype):
    """A batch of 38 tokens (x [38, D], router logits [38, E], expert weights) shared by the
    tests, so each compiled program is built once."""
    rng = np.random.default_rng(3)
    return (normal(rng, (38, D), dtype), normal(rng, (38, E), scale=2.0),
            _weights(rng, dtype))


@jax.jit
def dense_reference(x, experts, weights, w_gate, w_up, w_down):
    """Every token through its k experts by gathering their weights, float32, plain jnp."""
    x, w_gate, w_up, w_down = (a.astype(jnp.float32) for a in (x, w_gate, w_up, w_down))
    hi = jax.lax.Precision.HIGHEST
    h = jnp.einsum("...d,...kdf->...kf", x, w_gate[experts], precision=hi)
    u = jnp.einsum("...d,...kdf->...kf", x, w_up[experts], precision=hi)
    y = jnp.einsum("...kf,...kfd->...kd", jax.nn.silu(h) * u, w_down[experts], precision=hi)
    return jnp.einsum("...k,...kd->...d", weights, y, precision=hi)


@jax.jit
def ragged_dot_reference(x, experts, weights, w_gate, w_up, w_down):
    """Sort-based dispatch + jax.lax.ragged_dot (fine at these sizes; see moe's docstring for
    why the XLA backend does not use it)."""
    n, k = experts.shape
    order = jnp.argsort(experts.reshape(-1), stable=True)
    rows = x.astype(jnp.float32)[order // k]
    sizes = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)
    h = jax.lax.ragged_dot(rows, w_gate.astype(jnp.float32), sizes)
    u = jax.lax.ragged_dot(rows, w_up.astype(jnp.float32), sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(h) * u, w_down.astype(jnp.float32), sizes)
    y_pairs = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)
    return jnp.einsum("nk,nkd->nd", weights, y_pairs)


# -------------------------------------------------------------------------------------------------
# Router.

@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_route_matches_transformers(norm_topk_prob):
    rng = np.random.default_rng(0)
    n, top_k = 50, 3
    config = Qwen3MoeConfig(hidden_size=D, num_experts=E, num_experts_per_tok=top_k,
                            norm_topk_prob=norm_topk_prob)
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((E, D)).astype(np.float32)))
        logits, scores, indices = router(torch.from_numpy(
            rng.standard_normal((n, D)).astype(np.float32)))
    got = jax.jit(functools.partial(kernels.route, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                    contract=_contract()))(jnp.asarray(logits.numpy()))
    probs = np.sort(np.asarray(got.probs), axis=-1)
    assert (np.diff(probs, axis=-1) > 0).all(), "random logits must have no ties"
    np.testing.assert_array_equal(np.asarray(got.experts), indices.numpy())
    np.testing.assert_allclose(np.asarray(got.weights), scores.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.probs),
                               torch.softmax(logits, -1).numpy(), rtol=0, atol=1e-6)


def test_route_tie_break_lowest_index():
    logits = jnp.asarray([
        [0.0, 2.0, 2.0, 1.0, 2.0, 0.0, 0.0, 0.0],   # three-way tie at 2: experts 1, 2, 4
        [1.0, 3.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0],   # tie at 3 (1, 3), then lowest of the 1s: 0
        [5.0] * 8,                                  # all equal: 0, 1, 2
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0],   # 7 first, then the lowest zeros: 0, 1
    ], jnp.float32)
    for backend in ("pallas", "xla"):
        r = kernels.route(logits, top_k=3, norm_topk_prob=False, contract=_contract(
            backend=backend))
        np.testing.assert_array_equal(np.asarray(r.experts),
                                      [[1, 2, 4], [1, 3, 0], [0, 1, 2], [7, 0, 1]])
        # All equal: exp(0) = 1 eight times, sum 8, reciprocal 0.125 (exact in binary).
        np.testing.assert_array_equal(np.asarray(r.weights[2]), [0.125] * 3)


def test_replayed_weights_equal_routed_weights():
    rng = np.random.default_rng(1)
    logits = normal(rng, (37, E), scale=2.0)
    for norm in (False, True):
        r = kernels.route(logits, top_k=3, norm_topk_prob=norm, contract=_contract())
        assert_bitwise_equal(kernels.routing_weights(r.probs, r.experts, norm_topk_prob=norm),
                             r.weights, f"replay, norm={norm}")
    # Other experts (a stale route): the chosen probabilities, renormalised in j order.
    stale = jnp.asarray(rng.integers(0, E, (37, 3)), jnp.int32)
    chosen = np.take_along_axis(np.asarray(r.probs), np.asarray(stale), axis=-1)
    got = kernels.routing_weights(r.probs, stale, norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(got), chosen / chosen.sum(-1, keepdims=True),
                               rtol=1e-6)


def test_route_rejects_bad_inputs():
    c = _contract()
    with pytest.raises(ValueError, match="float32"):
        kernels.route(jnp.zeros((2, E), jnp.bfloat16), top_k=2, norm_topk_prob=True, contract=c)
    with pytest.raises(ValueError, match="top_k"):
        kernels.route(jnp.zeros((2, E)), top_k=E + 1, norm_topk_prob=True, contract=c)
    with pytest.raises(ValueError, match="w_down"):
        kernels.moe_experts(jnp.zeros((2, D)), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2)),
                            jnp.zeros((E, D, F)), jnp.zeros((E, D, F)), jnp.zeros((E, D, F)),
                            contract=c)


# -------------------------------------------------------------------------------------------------
# Dispatch.

def test_dispatch_by_hand():
    experts = jnp.asarray([[1, 0], [1, 3], [0, 1]], jnp.int32)
    d = moe.dispatch(experts, num_experts=4, contract=_contract().replace(matmul_block_m=2))
    # Pairs p = token * 2 + j: experts 1 0 1 3 0 1. Groups (stable): e0 {p1, p4}, e1 {p0, p2, p5},
    # e2 {}, e3 {p3}; padded to 2, 4, 0, 2 rows, starting at rows 0, 2, 6, 6.
    # R = 6 pairs + min(4, 6) * (2 - 1) = 10 rows, T = 5 tiles, 4 live.
    np.testing.assert_array_equal(np.asarray(d.pair_row), [[2, 0], [3, 6], [1, 4]])
    np.testing.assert_array_equal(np.asarray(d.row_token), [0, 2, 0, 1, 2, 3, 1, 3, 3, 3])
    np.testing.assert_array_equal(np.asarray(d.tile_expert), [0, 1, 1, 3, 3])   # last repeats
    assert int(d.num_tiles) == 4


# -------------------------------------------------------------------------------------------------
# The expert layer.

def test_layer_matches_transformers_sparse_block():
    rng = np.random.default_rng(2)
    top_k = 3
    config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                            num_experts_per_tok=top_k, norm_topk_prob=True, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(config)
    w_gate, w_up, w_down = _weights(rng)
    w_router = normal(rng, (D, E))
    x = normal(rng, _batch("float32")[0].shape)          # the shared program's shapes
    with torch.no_grad():
        # transformers stores [out, in]: gate_up_proj[e] = [W_gate[e]^T; W_up[e]^T] [2F, D].
        block.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate(
            [np.swapaxes(w_gate, 1, 2), np.swapaxes(w_up, 1, 2)], axis=1)))
        block.experts.down_proj.copy_(torch.from_numpy(np.swapaxes(np.array(w_down), 1, 2)))
        block.gate.weight.copy_(torch.from_numpy(np.asarray(w_router).T.copy()))
        expected = block(torch.from_numpy(np.array(x))[None])[0].numpy()
    c = _contract()
    logits = kernels.matmul(x, w_router, contract=c)
    y, _ = _layer(c, top_k)(x, logits, w_gate, w_up, w_down)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_matches_references(dtype):
    x, logits, params = _batch(dtype)
    y, r = _layer(_contract(dtype), 3)(x, logits, *params)
    assert y.shape == x.shape and y.dtype == jnp.dtype(dtype)
    y_xla, r_xla = _layer(_contract(dtype, "xla"), 3)(x, logits, *params)
    np.testing.assert_array_equal(np.asarray(r.experts), np.asarray(r_xla.experts))
    y = np.asarray(y, np.float32)
    # The references compute in float32 (from the same bfloat16 values).
    inputs = [a.astype(jnp.float32) for a in (x, *params)]
    for name, expected in [
            ("dense", dense_reference(inputs[0], r.experts, r.weights, *inputs[1:])),
            ("ragged_dot", ragged_dot_reference(inputs[0], r.experts, r.weights, *inputs[1:])),
            ("xla backend", np.asarray(y_xla, np.float32))]:
        # bfloat16: act is rounded to bfloat16 before the down projection, the output once more.
        np.testing.assert_allclose(y, expected, rtol=0,
                                   atol=1e-5 if dtype == "float32" else ATOL[dtype] * 2,
                                   err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_token_bits_do_not_depend_on_other_tokens(dtype):
    """A token's routing and output are bitwise the same alone (decode), in a batch of 37 other
    tokens (the trainer), among 37 tokens routed to its own experts (every group then spans
    several row tiles), and at another position; jitted and (float32) not. The XLA backend is
    only close (test_moe_experts_matches_references)."""
    c = _contract(dtype)
    layer = _layer(c, 3)
    x, logits, params = _batch(dtype)
    n = x.shape[0]
    alone, r_alone = layer(x[:1], logits[:1], *params)
    batch, r_batch = layer(x, logits, *params)
    assert_bitwise_equal(r_batch.probs[:1], r_alone.probs, "router probs")
    assert_bitwise_equal(r_batch.weights[:1], r_alone.weights, "routing weights")
    np.testing.assert_array_equal(np.asarray(r_batch.experts[:1]), np.asarray(r_alone.experts))
    # Every token gets token 0's logits, hence its experts; token 0 sits at 20, among others.
    crowd, r_crowd = layer(x[::-1].at[20].set(x[0]), jnp.broadcast_to(logits[:1], (n, E)),
                           *params)
    assert (np.asarray(r_crowd.experts) == np.asarray(r_alone.experts)).all()
    perm = np.roll(np.arange(n), -1)                     # token 0 last
    moved, _ = layer(x[perm], logits[perm], *params)
    cases = [("batch of 38", batch[:1]), ("crowded experts", crowd[20:21]),
             ("last position", moved[-1:])]
    if dtype == "float32":
        cases.append(("not jitted", kernels.moe_experts(
            x[:1], r_alone.experts, r_alone.weights, *params, contract=c)))
    for name, got in cases:
        assert_bitwise_equal(got, alone, name)


# -------------------------------------------------------------------------------------------------
# Gradients.

def test_moe_grads_match_dense_reference():
    """jax.grad w.r.t. x, the three expert weights (f32), and w.r.t. the router probs and logits
    under replay: the experts are forced (stale ones, not the top-k of these logits), so the
    gradient reaches the router only through the replayed experts' probs (d probs is taken as
    the gradient w.r.t. an added zero offset).
    The backward is the XLA backend's (custom_vjp), so this also checks that backend's
    gradients, its hand-written grouped-matmul backward included."""
    rng = np.random.default_rng(5)
    c = _contract()
    n, top_k = 21, 3
    x, logits, dy = normal(rng, (n, D)), normal(rng, (n, E)), normal(rng, (n, D))
    params = _weights(rng)
    replay = jnp.asarray(np.argsort(rng.random((n, E)), axis=-1)[:, :top_k], jnp.int32)

    def loss(layer, softmax):
        def f(x, logits, probs_offset, w_gate, w_up, w_down):
            w = kernels.routing_weights(softmax(logits) + probs_offset, replay,
                                        norm_topk_prob=True)
            return jnp.sum(layer(x, replay, w, w_gate, w_up, w_down) * dy)
        return f

    args = (x, logits, jnp.zeros((n, E)), *params)
    ours = jax.jit(jax.grad(loss(functools.partial(kernels.moe_experts, contract=c),
                                 lambda z: kernels.route(z, top_k=top_k, norm_topk_prob=True,
                                                         contract=c).probs),
                            argnums=range(6)))(*args)
    expected = jax.jit(jax.grad(loss(dense_reference, jax.nn.softmax), argnums=range(6)))(*args)
    assert float(np.abs(expected[2]).max()) > 0
    for name, g, e in zip(["x", "logits", "probs", "w_gate", "w_up", "w_down"], ours, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4,
                                   atol=1e-4 * float(np.abs(e).max()), err_msg=name)


def test_moe_grads_bfloat16():
    """bf16 compute, float32 params: gradients land in the params' dtype, near the float32
    dense reference's (act and the output are rounded to bfloat16 in the forward)."""
    rng = np.random.default_rng(6)
    # Leading dims [B, T] as a model passes them.
    x, logits, dy = normal(rng, (1, 13, D)), normal(rng, (1, 13, E)), normal(rng, (1, 13, D))
    params = _weights(rng)
    r = kernels.route(logits, top_k=2, norm_topk_prob=False, contract=_contract())

    def grads(layer):
        return jax.grad(lambda *a: jnp.sum(layer(a[0], r.experts, *a[1:]).astype(
            jnp.float32) * dy), argnums=range(5))(x, r.weights, *params)

    ours = jax.jit(lambda: grads(functools.partial(kernels.moe_experts,
                                                   contract=_contract("bfloat16"))))()
    for g, e in zip(ours, jax.jit(lambda: grads(dense_reference))()):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, e, rtol=0, atol=0.05 * float(np.abs(e).max()))


# -------------------------------------------------------------------------------------------------
# TPU and GPU evidence (as test_platforms).

@pytest.mark.skipif(not HAVE_TPU_INTERPRET, reason="pltpu.InterpretParams unavailable")
def test_tpu_interpret_matches_cpu():
    """The TPU kernel path (scalar prefetch, pl.when skipping) gives the CPU path's routes and
    bits (the expert tiles are matmul-like, which is bitwise on this machine)."""
    rng = np.random.default_rng(7)
    x, logits = normal(rng, (12, D)), normal(rng, (12, E))
    params = _weights(rng)
    tiles = dict(matmul_block_m=8, matmul_block_n=128, matmul_block_k=128, norm_block_rows=8,
                 logprob_block_rows=8, vocab_chunk=128, attn_block_k=128)
    tpu, tpu_r = _layer(NumericalContract(platform="tpu_interpret", **tiles), 2)(x, logits,
                                                                                 *params)
    cpu, cpu_r = _layer(NumericalContract(platform="cpu", **tiles), 2)(x, logits, *params)
    np.testing.assert_array_equal(np.asarray(tpu_r.experts), np.asarray(cpu_r.experts))
    np.testing.assert_allclose(np.asarray(tpu_r.weights), np.asarray(cpu_r.weights), atol=1e-6)
    assert_bitwise_equal(tpu, cpu, "moe_experts")


@pytest.mark.parametrize("platform, export_platform", [("tpu", "tpu"), ("gpu", "cuda")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_lowers_natively(platform, export_platform, dtype, monkeypatch):
    """Mosaic (TPU) and Triton (GPU) accept the router softmax, both expert kernels and the
    combine, forward and backward, with the platform's default tiles."""
    monkeypatch.setattr(_grid, "_host_platform", lambda: platform)
    contract = NumericalContract.for_platform(platform, compute_dtype=dtype)
    layer = _layer(contract, 2)
    specs = [jax.ShapeDtypeStruct(s, t) for s, t in [
        ((12, D), dtype), ((12, E), "float32"), ((E, D, F), dtype), ((E, D, F), dtype),
        ((E, F, D), dtype)]]
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")

    def loss(*args):
        return jnp.sum(layer(*args)[0].astype(jnp.float32))

    exported = jax.export.export(layer, platforms=[export_platform],
                                 disabled_checks=[triton])(*specs)
    text = exported.mlir_module()
    for name in ("jrl_router_softmax", "jrl_moe_gate_up", "jrl_moe_down", "jrl_moe_combine"):
        assert name in text, f"kernel {name} missing from the lowered program"
    jax.export.export(jax.jit(jax.grad(loss, argnums=range(5))), platforms=[export_platform],
                      disabled_checks=[triton])(*specs)
