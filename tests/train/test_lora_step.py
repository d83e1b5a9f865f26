"""The train step with LoRA adapters (jrl.models.lora): it differentiates and updates the
adapters alone; the frozen base (dense or QLoRA int8) comes out as the very same arrays, and
the optimizer state covers the adapters only."""

import jax
import numpy as np
import pytest

from jrl import losses
from jrl.kernels.contract import NumericalContract
from jrl.kernels.quantized import QuantizedWeight
from jrl.models import lora, transformer
from jrl.models.config import LoraConfig
from jrl.train import (OptimizerConfig, create_train_state, jit_train_step, make_optimizer,
                       make_train_step)

from .test_step import CONFIG, CONTRACT, _batch

# An attention and an MLP projection (every projection goes through the same
# jrl.models.lora.project; each adapted one adds four kernels to compile).
TARGETS = ("q_proj", "down_proj")
# Weight decay 0: with B = 0 the gradient of A is exactly 0 (below), and decay would move A.
OPTIMIZER = make_optimizer(OptimizerConfig(learning_rate=1e-2, weight_decay=0.0))


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _is_weight(x):
    return isinstance(x, QuantizedWeight)


# The dense base on the Pallas path (lora_matmul's own backward); the QLoRA int8 base with the
# plain-XLA kernels (cheaper to compile; the quantised kernel's backward is
# tests/kernels/test_lora.py's), to show a QuantizedWeight passes through the step untouched.
@pytest.mark.parametrize("quantize, contract", [("none", CONTRACT),
                                                ("int8", NumericalContract(backend="xla"))])
def test_lora_step_trains_the_adapters_and_leaves_the_base(quantize, contract):
    config, params = lora.attach(CONFIG, transformer.init_params(CONFIG, jax.random.key(0)),
                                 LoraConfig(rank=4, alpha=8.0, targets=TARGETS,
                                            quantize=quantize))
    adapters, base = lora.split(params)
    state = create_train_state(params, OPTIMIZER, jax.random.PRNGKey(0))
    # Adam's two moments over the adapters alone. Adapter sizes r (K + N), r = 4, one layer:
    # q 4 (32 + 32) = 256, down 4 (64 + 32) = 384: 640 params, so 1280 moment floats.
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in jax.tree.leaves(adapters)) == 640
    assert sum(x.size for x in moments) == 2 * 640
    assert {x.shape for x in moments} == {x.shape for x in jax.tree.leaves(adapters)}

    step = jit_train_step(make_train_step(config, contract, losses.dapo(), OPTIMIZER))
    batch = _batch()
    first, metrics = step(state, batch)
    assert float(metrics["train/grad_norm"]) > 0.0
    new_adapters, new_base = lora.split(first.params)
    # The base is read in place: the same arrays come back (no per-step copy), bits and all.
    for old, new in zip(jax.tree.leaves(base, is_leaf=_is_weight),
                        jax.tree.leaves(new_base, is_leaf=_is_weight)):
        assert new is old
    if quantize == "int8":
        assert isinstance(new_base["layers"]["wq"], QuantizedWeight)
    # B = 0 at init: dA = x^T (g B^T) = 0 exactly, and Adam moves a parameter whose gradient
    # and moments are 0 by 0 / (sqrt(0) + eps) = 0. So step 1 changes B only...
    for name, value in new_adapters["layers"].items():
        before = adapters["layers"][name]
        if name.endswith("_lora_a"):
            np.testing.assert_array_equal(_bits(value), _bits(before), err_msg=name)
        else:
            assert np.abs(np.asarray(value) - np.asarray(before)).max() > 1e-3, name
    # ...and step 2, with B != 0, changes A too.
    second, _ = step(first, batch)
    for name, value in lora.split(second.params)[0]["layers"].items():
        if name.endswith("_lora_a"):
            assert np.abs(np.asarray(value) - np.asarray(adapters["layers"][name])).max() > 1e-4
    assert int(second.step) == 2 and int(second.version) == 2
