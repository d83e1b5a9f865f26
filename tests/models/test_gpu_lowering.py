"""Every model family lowers to Triton (GPU) whole, traced on this CPU through jax.export for
CUDA: the train forward with its logprobs and their gradient, a prefill into the cache, a
one-token decode from it and (hybrid) a pending verify window settled to its kept tokens.

Triton wants every in-kernel array to have a power-of-two size. The kernel-level lowering test
(tests/kernels/test_platforms.py) gives each kernel its own shapes; a model hands kernels the
shapes of its layers, and the first GPU lease found a model-only one: Gated DeltaNet's conv
inputs (4 taps x 48 channels) in the rowwise kernel failed to lower for every hybrid sampler
test, which passed on the CPU. Nothing here runs on a GPU: lowering is where that failed."""

import jax
import jax.numpy as jnp
import pytest

from jrl.kernels import NumericalContract, _grid
from jrl.models import transformer
from tests.sampling.helpers import ARCHS

S = jax.ShapeDtypeStruct
BATCH, PROMPT, CAPACITY = 3, 8, 32
TRITON = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
# Every family jrl runs, LoRA and QLoRA (int8, nf4) on the bitwise path included, in bfloat16
# (a GPU run's dtype); float32 (other casts and dot precisions in the kernels) for a dense and
# a hybrid family.
CASES = [(family, "bfloat16") for family in (
    "llama", "qwen35", "qwen3_moe", "qwen35_moe", "llama_lora", "llama_qlora",
    "llama64_qlora_nf4")] + [("llama", "float32"), ("qwen35", "float32")]


def _export(fn, *args):
    specs = jax.tree.map(lambda a: S(a.shape, a.dtype), args)
    return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[TRITON])(*specs)


@pytest.mark.parametrize("family, dtype", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_model_programs_lower_for_triton(family, dtype, monkeypatch):
    monkeypatch.setattr(_grid, "_host_platform", lambda: "gpu")
    config = ARCHS[family]
    contract = NumericalContract.for_platform(
        "gpu", compute_dtype=dtype, delta_chunk=16,
        **({"matmul_block_k": 64} if family.endswith("nf4") else {}))
    params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))
    tokens = jnp.zeros((BATCH, PROMPT), jnp.int32)
    mask = jnp.ones((BATCH, PROMPT), bool)

    def train_logprobs(p, t, m):
        return transformer.sequence_logprobs(p, config, t, contract=contract, mask=m)

    def train_loss(p, t, m):
        return jnp.sum(train_logprobs(p, t, m)[0])

    _export(train_logprobs, params, tokens, mask)
    _export(jax.grad(train_loss), params, tokens, mask)

    cache = jax.eval_shape(lambda: transformer.init_cache(config, BATCH, CAPACITY, contract))

    def prefill(p, t, m, c):
        return transformer.forward_hidden(p, config, t, contract=contract, mask=m, cache=c)

    def decode(p, token, position, c):
        hidden, c = transformer.forward_hidden(p, config, token, contract=contract,
                                               positions=position, cache=c)
        return transformer.logits_from_hidden(p, hidden, contract=contract), c

    _export(prefill, params, tokens, mask, cache)
    _export(decode, params, tokens[:, :1], jnp.zeros((BATCH, 1), jnp.int32), cache)
    if config.has_deltanet:
        def verify_and_settle(p, t, positions, c, keep):
            pending = transformer.forward(p, config, t, contract=contract, positions=positions,
                                          cache=c, pending=True).cache
            return transformer.settle_cache(config, pending, c, keep)

        window = jnp.zeros((BATCH, 5), jnp.int32)
        _export(verify_and_settle, params, window, window, cache, jnp.zeros((BATCH,), jnp.int32))


# Qwen3.5 on TPU is left out: its Gated DeltaNet kernel asks Pallas for the TPU's generation,
# which a CPU-hosted export has none of (no model-level TPU export exists for the hybrid).
FP8_KV = {"kv_dtype": "float8_e4m3fn"}
W8A8 = {"matmul_dtype": "float8_e4m3fn"}
FP8_CASES = {
    "kv-llama-cuda": ("llama", "gpu", "cuda", FP8_KV),
    "kv-qwen35-cuda": ("qwen35", "gpu", "cuda", FP8_KV),
    "kv-llama-tpu": ("llama", "tpu", "tpu", FP8_KV),
    "w8a8-llama-cuda": ("llama", "gpu", "cuda", W8A8),
    "w8a8-qwen35_moe-cuda": ("qwen35_moe", "gpu", "cuda", W8A8),
    "w8a8-llama_lora-tpu": ("llama_lora", "tpu", "tpu", W8A8),
}


@pytest.mark.parametrize("family, platform, export_platform, fp8", FP8_CASES.values(),
                         ids=FP8_CASES.keys())
def test_fp8_programs_lower(family, platform, export_platform, fp8, monkeypatch):
    """FP8 in bfloat16, an FP8 KV cache (kv_dtype) or W8A8 matmuls (matmul_dtype): the train
    forward with its straight-through gradient, and a prefill and a decode step, lower for
    CUDA and TPU. The quantiser and the read-back are XLA ops beside the kernels, which multiply
    the read-back values in the compute dtype: no platform needs a native FP8 dot."""
    monkeypatch.setattr(_grid, "_host_platform", lambda: platform)
    config = ARCHS[family]
    contract = NumericalContract.for_platform(platform, compute_dtype="bfloat16",
                                              delta_chunk=16, **fp8)
    params = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))
    tokens = jnp.zeros((BATCH, PROMPT), jnp.int32)
    mask = jnp.ones((BATCH, PROMPT), bool)
    cache = jax.eval_shape(lambda: transformer.init_cache(config, BATCH, CAPACITY, contract))
    assert any("k_exp" in layer for layer in cache.layers.values()) == ("kv_dtype" in fp8)

    def export(fn, *args):
        specs = jax.tree.map(lambda a: S(a.shape, a.dtype), args)
        return jax.export.export(jax.jit(fn), platforms=[export_platform],
                                 disabled_checks=[TRITON])(*specs)

    def train_loss(p, t, m):
        return jnp.sum(transformer.sequence_logprobs(p, config, t, contract=contract,
                                                     mask=m)[0])

    def decode(p, token, position, c):
        hidden, c = transformer.forward_hidden(p, config, token, contract=contract,
                                               positions=position, cache=c)
        return transformer.logits_from_hidden(p, hidden, contract=contract), c

    # The program rounds through e4m3fn (the quantiser is in it, not optimised away).
    assert "f8E4M3FN" in export(jax.grad(train_loss), params, tokens, mask).mlir_module()
    export(lambda p, t, m, c: transformer.forward_hidden(p, config, t, contract=contract,
                                                         mask=m, cache=c),
           params, tokens, mask, cache)
    export(decode, params, tokens[:, :1], jnp.zeros((BATCH, 1), jnp.int32), cache)
