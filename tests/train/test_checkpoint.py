"""Checkpointer.save: a disk fault is one line, cause first, naming the step and what is
intact (Orbax's own error wraps it in pages of asyncio tracebacks)."""

import errno

import jax
import optax
import orbax.checkpoint as ocp
import pytest

from jrl.io_errors import WriteFailed
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.train.checkpoint import Checkpointer
from jrl.train.state import create_train_state

CONFIG = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=8)


def test_a_full_disk_during_a_save_is_one_line_naming_the_step(tmp_path, monkeypatch):
    params = transformer.init_params(CONFIG, jax.random.key(0), "float32")
    state = create_train_state(params, optax.sgd(0.1), jax.random.key(1))
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))
    checkpointer.save(1, state, {"rl_step": 1})

    def full_disk(self, step, *args, **kwargs):
        # As Orbax reports it: its own error, the disk's OSError as the cause.
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "ckpt/2/state/x")
        except OSError as disk:
            raise RuntimeError("async save failed\n" + "Traceback ...\n" * 50) from disk

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
    with pytest.raises(WriteFailed) as caught:
        checkpointer.save(2, state, {"rl_step": 2})
    message = str(caught.value)
    assert message == (f"No space left on device (ENOSPC): ckpt/2/state/x: writing checkpoint "
                       f"step 2 to {tmp_path / 'checkpoints'} failed (checkpoint 1 is intact)")
    monkeypatch.undo()
    assert checkpointer.latest_step() == 1
    checkpointer.close()


def test_an_error_that_is_not_an_io_fault_is_raised_as_it_is(tmp_path, monkeypatch):
    params = transformer.init_params(CONFIG, jax.random.key(0), "float32")
    state = create_train_state(params, optax.sgd(0.1), jax.random.key(1))
    checkpointer = Checkpointer(str(tmp_path / "checkpoints"))

    def bug(self, *args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(ocp.CheckpointManager, "save", bug)
    with pytest.raises(TypeError, match="a bug"):
        checkpointer.save(1, state, {})
    monkeypatch.undo()
    checkpointer.close()
