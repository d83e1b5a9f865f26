"""W8A8 matmuls on the one numerical path (NumericalContract.matmul_dtype="float8_e4m3fn").

Every projection, the MoE experts and the LM head multiply activations read back from FP8 per
token and weights per output column (jrl.kernels.fp8), in the sampler's prefill and decode and
in the train forward alike, through the same kernels. So p_b == p_o bit for bit holds as on the
compute-dtype path: tests/sampling/test_bitwise.py's w8a8 cases (the dense model in bfloat16 in
the default suite; Qwen3.5, the MoE families, LoRA and an FP8 KV cache beside W8A8 in the slow
tier). Here: that the quantisation acts, and what it refuses.
"""

import jax.numpy as jnp
import pytest

from jrl.models import transformer

from .helpers import (ARCHS, Case, max_abs_diff, model_params, run,
                      train_logprobs)

FP8 = "float8_e4m3fn"
DENSE = Case("pallas", "bfloat16", 1.0, 0.9, matmul_dtype=FP8)


def test_w8a8_changes_the_logprobs():
    """The quantisation acts: the same samples' train forward with W8A8 gives other logprobs
    than with compute-dtype matmuls (so test_bitwise.py's w8a8 cases are not the
    compute-dtype path's)."""
    samples, _ = run(DENSE)
    params = model_params(0)
    order = range(len(samples))
    w8a8 = train_logprobs(params, samples, DENSE.contract(), 1.0, order=order,
                          batch=len(samples), length=30)
    plain = train_logprobs(params, samples, DENSE._replace(matmul_dtype="compute").contract(),
                           1.0, order=order, batch=len(samples), length=30)
    assert max_abs_diff(w8a8, plain) > 0.0


def test_w8a8_refuses_a_qlora_base_naming_the_field():
    """A QLoRA base keeps its int8 storage: the forward raises, naming the field."""
    case = Case("xla", "float32", arch="llama_qlora", matmul_dtype=FP8)
    with pytest.raises(ValueError, match=r"NumericalContract.matmul_dtype='float8_e4m3fn'"):
        transformer.sequence_logprobs(model_params(0, "llama_qlora"), ARCHS["llama_qlora"],
                                      jnp.ones((1, 4), jnp.int32), contract=case.contract())
