"""Kernels per layer of one exact decode step, lowered for CUDA on this CPU (launch.count_kernels):
the counts may fall (fusion), never grow back. The numbers are this code's; a change that fuses
kernels lowers them here and in docs/results/kernel_counts.json (python -m launch.count_kernels)."""

import pytest

from launch import count_kernels
from tests.sampling.helpers import ARCHS

# One scan period of the tiny test models, CUDA lowering, bfloat16, GPU tiles:
# dense: 2 RMSNorms + q, k, v, o projections + attention + gate, up, down = 10 Pallas calls;
# qwen35: one Gated DeltaNet layer and one gated-attention layer per period;
# qwen3_moe: one dense layer (mlp_only_layers=(0,)) and one MoE layer per period.
CEILINGS = {"llama": (10, 330), "qwen35": (27, 1313), "qwen3_moe": (26, 910)}


@pytest.mark.parametrize("family", sorted(CEILINGS))
def test_decode_kernels_per_layer_do_not_grow(family):
    counts = count_kernels.summary(count_kernels.layer_counts(
        count_kernels.lowered_decode(ARCHS[family], "gpu")))
    pallas, glue = CEILINGS[family]
    assert counts["pallas"] <= pallas, counts
    assert counts["glue"] <= glue, counts
    # Not vacuous: the scan body was found and holds the layer's kernels.
    assert counts["pallas"] >= (10 if family == "llama" else 20)


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
