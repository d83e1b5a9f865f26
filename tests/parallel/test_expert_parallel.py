"""Expert parallelism on the 8 host CPU devices: the MoE layer and the train forward are bitwise
equal for EP = 1, 2 and 4 (tokens move by all-to-all, each combined on its home device), and the
sampler on one device equals a trainer on EP = 4 bit for bit (the seed's different-layouts
point).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.parallel.expert import (EP_BATCH_AXES, expert_param_specs, make_expert_mesh,
                                 make_expert_parallel_score_fn)
from jrl.train import make_score_fn
from tests.sampling.helpers import (ARCHS, Case, bits_equal, contract, layout, model_params,
                                    run)

E, D, F, K = 8, 40, 24, 2
SMALL = NumericalContract(platform="cpu", matmul_block_m=8, matmul_block_n=16,
                          matmul_block_k=16, norm_block_rows=8, logprob_block_rows=8)


@pytest.fixture(scope="module", autouse=True)
def needs_eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets them)")


def _layer_inputs(skewed: bool):
    """32 tokens: x [32, D], top-2 experts and weights, expert weights [E, ...]. skewed: every
    token on experts 6 and 7 (all pairs go to the last device at EP = 4: the send buffers must
    hold a whole device's pairs)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, D)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(32, E)) * 2.0, jnp.float32)
    if skewed:
        logits = logits.at[:, 6:].add(20.0)
    routing = kernels.route(logits, top_k=K, norm_topk_prob=True, contract=SMALL)
    weights = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32)
               for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, routing.experts, routing.weights, weights


@functools.lru_cache(maxsize=None)
def _sharded_layer(ep: int, contract_: NumericalContract):
    mesh = make_expert_mesh(ep)
    rows, experts_axis = PartitionSpec(EP_BATCH_AXES), PartitionSpec("expert")

    def layer(x, experts, weights, w_gate, w_up, w_down):
        return kernels.moe_experts_sharded(x, experts, weights, w_gate, w_up, w_down,
                                           axis="expert", contract=contract_)
    return jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(rows,) * 3 + (experts_axis,) * 3,
                                 out_specs=rows, check_vma=False))


@pytest.mark.parametrize("skewed", [False, True], ids=["random", "skewed"])
def test_the_layer_is_bitwise_equal_for_ep_1_2_4(skewed):
    x, experts, weights, (w_gate, w_up, w_down) = _layer_inputs(skewed)
    if skewed:
        assert set(np.unique(experts).tolist()) == {6, 7}
    one = jax.jit(functools.partial(kernels.moe_experts, contract=SMALL))(
        x, experts, weights, w_gate, w_up, w_down)
    for ep in (1, 2, 4):
        got = _sharded_layer(ep, SMALL)(x, experts, weights, w_gate, w_up, w_down)
        assert bits_equal(got, one), ep
    assert float(jnp.abs(one).max()) > 0.1


def test_the_layer_gradient_under_ep_matches_one_device():
    """The custom_vjp (plain-XLA backward with the all-to-alls transposed): the gradient of the
    home tokens and of each device's own experts, against one device (float tolerance: the
    backward is the XLA reference, as on one device)."""
    x, experts, weights, w = _layer_inputs(False)
    c = jnp.asarray(np.random.default_rng(2).normal(size=(32, D)), jnp.float32)

    def loss_one(x, weights, *w):
        return jnp.sum(kernels.moe_experts(x, experts, weights, *w, contract=SMALL) * c)

    mesh = make_expert_mesh(4)
    rows, experts_axis = PartitionSpec(EP_BATCH_AXES), PartitionSpec("expert")

    def grads_local(x, experts_, weights, c_, *w):
        def loss(x, weights, *w):
            out = kernels.moe_experts_sharded(x, experts_, weights, *w, axis="expert",
                                              contract=SMALL)
            return jnp.sum(out * c_)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, weights, *w)

    sharded = jax.jit(jax.shard_map(grads_local, mesh=mesh,
                                    in_specs=(rows,) * 4 + (experts_axis,) * 3,
                                    out_specs=(rows, rows) + (experts_axis,) * 3,
                                    check_vma=False))
    want = jax.grad(loss_one, argnums=(0, 1, 2, 3, 4))(x, weights, *w)
    got = sharded(x, experts, weights, c, *w)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=2e-5, atol=2e-6)


@functools.lru_cache(maxsize=None)
def _ep_scores(ep: int, arch: str):
    return jax.jit(make_expert_parallel_score_fn(ARCHS[arch], contract(), make_expert_mesh(ep)))


def test_sampler_on_one_device_equals_the_train_forward_on_ep_1_2_4():
    """The refilling qwen3_moe run of tests/sampling (one device, 4 slots): p_b and the recorded
    routes equal the train engine's logp and routes on EP = 1, 2 and 4 (12 rows, reverse order,
    30 positions: a layout unlike the sampler's), bit for bit."""
    arch = "qwen3_moe"
    samples, _ = run(Case("pallas", "float32", 1.0, 0.9, arch=arch))
    lay = layout(samples, list(range(len(samples)))[::-1], len(samples), 30)
    arrays = (jnp.asarray(lay.tokens), jnp.asarray(lay.mask), jnp.asarray(lay.floor))
    params = model_params(0, arch)
    specs = expert_param_specs(ARCHS[arch], make_expert_mesh(4))
    assert specs["layers_moe"]["experts_gate"] == PartitionSpec(None, "expert", None, None)
    assert specs["layers_moe"]["router"] == PartitionSpec(None, None, None)
    single = jax.jit(make_score_fn(ARCHS[arch], contract()))(params, *arrays)
    for ep in (1, 2, 4):
        scores = _ep_scores(ep, arch)(params, *arrays)
        assert bits_equal(scores.logp, single.logp), ep
        np.testing.assert_array_equal(scores.routes, single.routes)
        logp, routes = np.asarray(scores.logp), np.asarray(scores.routes)
        for i, s in enumerate(samples):
            row, p, n = lay.rows[i], s.prompt_tokens.size, s.length
            assert bits_equal(logp[row, p:p + n], s.behavior_logp), (ep, i)
            np.testing.assert_array_equal(routes[row, p:p + n - 1], s.experts[:-1])
            np.testing.assert_array_equal(routes[row, :p], s.prompt_experts)


def test_ep_needs_experts_that_divide_over_the_axis():
    config = ARCHS["qwen3_moe"].replace(num_experts=6)
    with pytest.raises(ValueError, match="experts_gate dim 1 .*not divisible by mesh axes"):
        expert_param_specs(config, make_expert_mesh(4))
    with pytest.raises(ValueError, match="needs an MoE model"):
        expert_param_specs(ARCHS["llama"], make_expert_mesh(2))
    assert transformer.moe_layers(config)   # (a real MoE config: the error is the division)
