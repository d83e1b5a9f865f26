"""Kernels per layer of one exact decode step, lowered for CUDA on this CPU (launch.count_kernels):
the counts may fall (fusion), never grow back. The numbers are this code's; a change that fuses
kernels lowers them here and in docs/results/kernel_counts.json (python -m launch.count_kernels)."""

import pytest

from launch import count_kernels
from tests.sampling.helpers import ARCHS

# One scan period of the tiny test models, bfloat16, the platform's tiles. Dense: the attention
# input's RMSNorm with q, k, v in one kernel (kernels.projections), attention, o, the MLP input's
# RMSNorm with gate and up in one kernel, down = 5 Pallas calls (10 before the fusion, with 330
# glue ops); qwen35: one Gated DeltaNet layer (its norm and four input projections in one
# kernel) and one gated-attention layer per period; qwen3_moe: one dense layer
# (mlp_only_layers=(0,)) and one MoE layer per period.
CEILINGS = {("llama", "gpu"): (5, 165), ("llama", "tpu"): (5, 170),
            ("qwen35", "gpu"): (16, 1130), ("qwen3_moe", "gpu"): (18, 590)}


@pytest.mark.parametrize("family,platform", sorted(CEILINGS))
def test_decode_kernels_per_layer_do_not_grow(family, platform):
    counts = count_kernels.summary(count_kernels.layer_counts(
        count_kernels.lowered_decode(ARCHS[family], platform)))
    pallas, glue = CEILINGS[family, platform]
    assert counts["pallas"] <= pallas, counts
    assert counts["glue"] <= glue, counts
    # Not vacuous: the scan body was found and holds the layer's kernels.
    assert counts["pallas"] >= 5 and counts["glue"] >= 100, counts


def test_the_counter_follows_calls_and_skips_braces_in_strings():
    module = '''
  func.func public @main(%arg0: tensor<2xf32>) -> (tensor<2xf32> {jax.result_info = "r"}) {
    %0 = stablehlo.while(%iterArg = %arg0) : tensor<2xf32>
    cond {
      %1 = stablehlo.constant dense<true> : tensor<i1>
      stablehlo.return %1 : tensor<i1>
    } do {
      %2 = func.call @layer(%iterArg) : (tensor<2xf32>) -> tensor<2xf32>
      %3 = stablehlo.add %2, %2 : tensor<2xf32>
      stablehlo.return %3 : tensor<2xf32>
    }
    return %0 : tensor<2xf32>
  }
  func.func private @layer(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%arg0) {ir = "{ unbalanced"} : (tensor<2xf32>) -> tensor<2xf32>
    %1 = call @pad(%0) : (tensor<2xf32>) -> tensor<2xf32>
    return %1 : tensor<2xf32>
  }
  func.func private @pad(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = stablehlo.multiply %arg0, %arg0 : tensor<2xf32>
    return %0 : tensor<2xf32>
  }
'''
    counts = count_kernels.layer_counts(module)
    # The while body: one Pallas call (in @layer), a multiply (in @pad, via @layer) and an add;
    # the cond's constant and every return are not counted.
    assert dict(counts) == {"pallas": 1, "stablehlo.multiply": 1, "stablehlo.add": 1}
