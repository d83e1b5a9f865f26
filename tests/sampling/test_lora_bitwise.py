"""The invariant with LoRA adapters: p_b recorded by the sampler == p_o recomputed by the train
forward, bitwise, on the Pallas path: a QLoRA int8 base in bfloat16, and (slow: each case
compiles a sampler and a train forward in interpret mode, about a minute of CPU) a float32
dense base and an NF4 base (4-bit blocks of 64, on a 64-wide Llama) in bfloat16 with top-p. The same refilling run and train layouts as test_bitwise (helpers.py), on the tiny
Llama with rank-4 adapters whose B is nonzero."""

import numpy as np
import pytest

from jrl.kernels.quantized import QuantizedWeight

from .helpers import (LORA_ARCHS, Case, bits_equal, contract, max_abs_diff, model_params,
                      recompute_two_layouts, run, train_logprobs)
from .test_bitwise import assert_refills_happened

CASES = {"qlora-int8-bf16-t1": Case("pallas", "bfloat16", 1.0, 1.0, arch="llama_qlora"),
         "lora-f32-topp0.9": pytest.param(Case("pallas", "float32", 1.0, 0.9, arch="llama_lora"),
                                          marks=pytest.mark.slow),
         "qlora-nf4-bf16-topp0.9": pytest.param(
             Case("pallas", "bfloat16", 1.0, 0.9, arch="llama64_qlora_nf4"),
             marks=pytest.mark.slow)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bitwise_lora_sampler_logprobs_equal_train_recompute(case):
    params = model_params(0, case.arch)
    quantized = params["layers"]["wq"]
    assert isinstance(quantized, QuantizedWeight) == ("qlora" in case.arch)
    if "nf4" in case.arch:
        assert quantized.format == "nf4"
    samples, stats = run(case)
    assert_refills_happened(samples, stats)
    p_b = [s.behavior_logp for s in samples]
    assert all(np.all(np.isfinite(x)) and np.all(x <= 0.0) for x in p_b)
    first, second = recompute_two_layouts(params, samples,
                                          contract(case.backend, case.dtype, case.arch),
                                          case.temperature, arch=case.arch)
    assert max_abs_diff(p_b, first) == 0.0
    assert max_abs_diff(p_b, second) == 0.0
    for i in range(len(samples)):
        assert bits_equal(p_b[i], first[i]) and bits_equal(p_b[i], second[i]), i
    # Not vacuous: the adapters change the policy; the base model (plain XLA, a cheap control)
    # scores the same tokens far differently.
    base_arch, base_seed, _ = LORA_ARCHS[case.arch]
    base = train_logprobs(model_params(base_seed, base_arch), samples, contract("xla", "float32"),
                          case.temperature, order=range(len(samples)), batch=len(samples),
                          length=30, arch=base_arch)
    assert max_abs_diff(p_b, base) > 0.1
