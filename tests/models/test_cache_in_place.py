"""A KV cache is written and read in place: a decode step's attention layers scatter their new
keys into the model's cache stacks and the kernel reads each layer where it lies, with the
train forward's bits, and the compiled step holds no copy of a layer's cache."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig

from ..kernels.helpers import assert_bitwise_equal

BATCH, PROMPT, CAPACITY = 16, 8, 32     # 16 sequences: two emulated attention blocks of 8
CONTRACT = NumericalContract(platform="cpu", attn_block_q=16, attn_block_k=16)
DENSE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=2, num_kv_heads=1, head_dim=16)
# Qwen3.5-style period [DeltaNet, attention, attention] repeated twice: two attention layers
# per scanned period, so layer (repeat r, j) is stack entry 2 r + j.
HYBRID = DENSE.replace(
    model_type="qwen3_5_text", num_layers=6,
    layer_types=("linear_attention", "full_attention", "full_attention") * 2,
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=16, partial_rotary_factor=0.5, attn_output_gate=True, norm_offset=1.0,
    qk_norm=True)


@pytest.mark.parametrize("config", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_attends_over_cache_stack_in_place_bitwise(config, dtype):
    """float32 caches are written and read in place. bfloat16 caches on a CPU stay scanned
    layer by layer (XLA's CPU backend widens a whole bfloat16 buffer per in-place write), so
    their compiled step does hold per-layer arrays; the bits are the train forward's either
    way."""
    contract = CONTRACT.replace(compute_dtype=dtype, param_dtype=dtype)
    params = transformer.init_params(config, jax.random.key(0), dtype=jnp.dtype(dtype))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (BATCH, PROMPT + 1)),
                         jnp.int32)
    full = transformer.forward(params, config, tokens, contract=contract).hidden

    def step(params, tokens, positions, cache):
        return transformer.forward(params, config, tokens, contract=contract,
                                   positions=positions, cache=cache)

    prefill = jax.jit(step)
    decode = jax.jit(step, donate_argnums=(3,))
    cache = transformer.init_cache(config, BATCH, CAPACITY, contract)
    prompt_positions = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (BATCH, PROMPT))
    cache = prefill(params, tokens[:, :PROMPT], prompt_positions, cache).cache
    position = jnp.full((BATCH, 1), PROMPT, jnp.int32)
    # The compiled step: no instruction makes an array of one layer's keys [B, C, Hkv, hd] (the
    # scanned design dynamic-sliced, scattered and re-stacked such arrays at every layer).
    element = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    layer_shape = f"{element}[{BATCH},{CAPACITY},{config.num_kv_heads},{config.head_dim}]"
    text = decode.lower(params, tokens[:, PROMPT:], position, cache).compile().as_text()
    has_layer_arrays = re.search(re.escape(layer_shape) + r"\{", text) is not None
    assert has_layer_arrays == (dtype == "bfloat16"), layer_shape
    out = decode(params, tokens[:, PROMPT:], position, cache)
    # Stage consistency through the stacks: the decoded token's hidden state is the train
    # forward's at its position, bit for bit.
    assert_bitwise_equal(out.hidden[:, 0], full[:, PROMPT])
    assert out.cache.layers[transformer.KIND_PARAM_KEYS[("attention", "dense")]]["k"].shape == (
        config.kind_count(("attention", "dense")), BATCH, CAPACITY, config.num_kv_heads,
        config.head_dim)
