"""jrl.train.checkpoint with LoRA: a checkpoint holds the adapters and their optimizer state
only; restoring puts them back bit for bit next to the caller's frozen base (dense or QLoRA)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.quantized import QuantizedWeight
from jrl.models import lora, transformer
from jrl.models.config import LoraConfig
from jrl.train import OptimizerConfig, create_train_state, make_optimizer
from jrl.train.checkpoint import Checkpointer

from .test_step import CONFIG

OPTIMIZER = make_optimizer(OptimizerConfig(learning_rate=1e-2))


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_lora_checkpoint_holds_adapters_and_restores_them_bitwise(quantize, tmp_path):
    _, params = lora.attach(CONFIG, transformer.init_params(CONFIG, jax.random.key(0)),
                            LoraConfig(rank=4, alpha=8.0, quantize=quantize))
    state = create_train_state(params, OPTIMIZER, jax.random.PRNGKey(0))
    # A trained-looking state: adapters and optimizer moments away from their init.
    adapters, base = lora.split(state.params)
    adapters = jax.tree.map(lambda x: x + 0.25, adapters)
    state = state._replace(params=lora.merge(adapters, base),
                           opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x,
                                                  state.opt_state),
                           step=jnp.int32(3), version=jnp.int32(3))
    checkpointer = Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(3, state, {"note": "lora"})
    # Only the adapters were written: the saved tree (Orbax's metadata) names every adapter
    # and no base weight.
    with open(tmp_path / "ckpt" / "3" / "state" / "_METADATA") as f:
        saved = {key for key in json.load(f)["tree_metadata"] if key.startswith("('params'")}
    expected = {str(("params", "layers", name)) for name in adapters["layers"]}
    assert saved == expected and len(saved) == 14          # 7 targets x (A, B)

    # Restore into a fresh state of the same model (fresh adapters, the same base).
    like = create_train_state(params, OPTIMIZER, jax.random.PRNGKey(1))
    restored, _, meta = checkpointer.restore(like, 3)
    assert meta == {"note": "lora"} and int(restored.step) == 3
    got_adapters, got_base = lora.split(restored.params)
    for a, b in zip(jax.tree.leaves(got_adapters), jax.tree.leaves(adapters)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    for a, b in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    # The base is the caller's own arrays (never copied through the checkpoint).
    is_weight = lambda x: isinstance(x, QuantizedWeight)
    for a, b in zip(jax.tree.leaves(got_base, is_leaf=is_weight),
                    jax.tree.leaves(lora.split(like.params)[1], is_leaf=is_weight)):
        assert a is b
