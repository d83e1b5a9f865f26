"""The NNX module is the functional core by construction: its state is the params pytree, its
forward the core's, for every family; it carries the logical sharding axes and loads
checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jrl.kernels.contract import NumericalContract
from jrl.models import ModelConfig, transformer
from jrl.models.nnx_model import (Decoder, Llama, Qwen2, Qwen3, Qwen3Moe, Qwen35, as_params,
                                  from_params, logical_axes_of, params_of)
from jrl.models.sharding import param_logical_axes
from jrl.sampling import Sampler, SamplingParams

CONTRACT = NumericalContract(backend="pallas", compute_dtype="float32")

CONFIGS = {
    "llama": ModelConfig(model_type="llama", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8),
    "qwen2": ModelConfig(model_type="qwen2", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         attention_bias=True, tie_word_embeddings=False),
    "qwen3": ModelConfig(model_type="qwen3", vocab_size=40, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True),
    "qwen3_moe": ModelConfig(model_type="qwen3_moe", vocab_size=40, hidden_size=32,
                             intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, mlp_only_layers=(0,)),
    "qwen3_5": ModelConfig(model_type="qwen3_5_text", vocab_size=40, hidden_size=32,
                           intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=8, qk_norm=True, attn_output_gate=True, norm_offset=1.0,
                           partial_rotary_factor=0.5,
                           layer_types=("linear_attention", "full_attention"),
                           linear_num_key_heads=1, linear_num_value_heads=2,
                           linear_key_head_dim=8, linear_value_head_dim=8),
}
CLASSES = {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "qwen3_moe": Qwen3Moe,
           "qwen3_5": Qwen35}


def batch():
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (3, 7)), jnp.int32)
    mask = jnp.arange(7)[None, :] < jnp.array([7, 5, 2])[:, None]
    return tokens, mask


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_module_equals_the_functional_core_bitwise(family):
    config = CONFIGS[family]
    model = CLASSES[family](config, rngs=nnx.Rngs(0), contract=CONTRACT)
    tokens, mask = batch()
    # Under nnx.jit (one program for the module, one for the pure function).
    jitted = nnx.jit(lambda m, t, k: m(t, mask=k))(model, tokens, mask)
    core_jit = jax.jit(lambda p, t, k: transformer.forward_logits(
        p, config, t, contract=CONTRACT, mask=k))(params_of(model), tokens, mask)
    assert jitted.shape == (3, 7, 40) and jitted.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(core_jit))
    if family == "llama":
        # Eagerly too, for one family: op-by-op interpret-mode Pallas compiles every kernel
        # call on its own (a minute per family on 2 cores), and the forward is shared code.
        ours = model(tokens, mask=mask)
        core = transformer.forward_logits(params_of(model), config, tokens, contract=CONTRACT,
                                          mask=mask)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(core))


def test_init_is_init_params_with_the_rngs_key():
    config = CONFIGS["qwen3"]
    model = Qwen3(config, rngs=nnx.Rngs(3))
    expected = transformer.init_params(config, nnx.Rngs(3).params())
    for a, b in zip(jax.tree.leaves(params_of(model)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_params_round_trip_and_split_merge():
    config = CONFIGS["qwen2"]
    params = transformer.init_params(config, jax.random.PRNGKey(1))
    model = from_params(config, params, contract=CONTRACT)
    back = params_of(model)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        assert a is b                                  # the same arrays, no copy
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    tokens, mask = batch()
    np.testing.assert_array_equal(np.asarray(merged(tokens, mask=mask)),
                                  np.asarray(model(tokens, mask=mask)))
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(params))
    # The split state is the params pytree itself, under "weights".
    pure = nnx.to_pure_dict(state)["weights"]
    assert jax.tree.structure(pure) == jax.tree.structure(params)


def test_params_carry_their_logical_sharding_axes():
    config = CONFIGS["qwen3_5"]
    model = Decoder(config, rngs=nnx.Rngs(0))
    assert logical_axes_of(model) == param_logical_axes(config)
    assert logical_axes_of(model)["layers_deltanet"]["w_qkv"] == ("layers", "embed", "linear_qkv")


def test_parts_accept_the_module():
    """The sampler takes the module where it takes params (as_params), with the same bits."""
    config = CONFIGS["llama"]
    model = Decoder(config, rngs=nnx.Rngs(1), contract=CONTRACT)
    params = params_of(model)
    assert as_params(params) is params
    assert jax.tree.structure(as_params(model)) == jax.tree.structure(params)
    sampler = Sampler(config, CONTRACT, SamplingParams(max_new_tokens=4, group_size=2, seed=1),
                      num_slots=2, max_prompt_len=4)
    by_module = sampler.generate(model, [(0, [3, 4, 5])])
    by_params = sampler.generate(params_of(model), [(0, [3, 4, 5])])
    for a, b in zip(by_module, by_params):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.behavior_logp, b.behavior_logp)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="model_type='llama'.*'qwen3'"):
        Qwen3(CONFIGS["llama"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exactly one of rngs"):
        Decoder(CONFIGS["llama"])
    params = transformer.init_params(CONFIGS["llama"], jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="do not match config 'qwen3'"):
        from_params(CONFIGS["qwen3"], params)
