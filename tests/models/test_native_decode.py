"""The fused layer on a native grid (Pallas's TPU interpreter on this CPU): a prefill and a
decode step through the KV cache give the train forward's bits. On a CPU the emulated grid runs
the separate kernels; this is the evidence for the fused norm-and-projections kernel, the
rotary tables and the attention plan computed once per forward, as a GPU or TPU runs them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import NumericalContract
from jrl.models import transformer

from ..kernels.helpers import assert_bitwise_equal
from ..kernels.test_platforms import HAVE_TPU_INTERPRET
from .test_cache_in_place import DENSE, HYBRID

BATCH, PROMPT, CAPACITY = 3, 5, 16
# The TPU's tile rules (multiples of 8 and 128) at the smallest sizes.
CONTRACT = NumericalContract(platform="tpu_interpret", matmul_block_m=8, matmul_block_n=128,
                             matmul_block_k=128, attn_block_q=8, attn_block_k=128,
                             norm_block_rows=8, logprob_block_rows=8, vocab_chunk=128,
                             delta_chunk=8)


@pytest.mark.skipif(not HAVE_TPU_INTERPRET, reason="pltpu.InterpretParams unavailable")
@pytest.mark.parametrize("config", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_native_decode_gives_the_train_forward_bits(config):
    params = transformer.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (BATCH, PROMPT + 2)),
                         jnp.int32)
    full = jax.jit(lambda p, t: transformer.forward(p, config, t, contract=CONTRACT).hidden)(
        params, tokens)

    @jax.jit
    def step(params, tokens, positions, cache):
        out = transformer.forward(params, config, tokens, contract=CONTRACT,
                                  positions=positions, cache=cache)
        return out.hidden, out.cache

    cache = transformer.init_cache(config, BATCH, CAPACITY, CONTRACT)
    positions = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (BATCH, PROMPT))
    hidden, cache = step(params, tokens[:, :PROMPT], positions, cache)
    assert_bitwise_equal(hidden, full[:, :PROMPT], "prefill")
    for t in (PROMPT, PROMPT + 1):
        hidden, cache = step(params, tokens[:, t:t + 1], jnp.full((BATCH, 1), t, jnp.int32),
                             cache)
        assert_bitwise_equal(hidden, full[:, t:t + 1], f"decode at position {t}")
