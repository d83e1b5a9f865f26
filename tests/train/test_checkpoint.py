"""Checkpointer.save: a disk fault is one line, cause first, naming the step and what is
intact (Orbax's own error wraps it in pages of asyncio tracebacks)."""

import errno
import logging
import os
import subprocess

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


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 2 MiB tmpfs (root on Linux); skipped where this machine cannot mount one."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip() or made.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_real_full_disk_is_one_line_and_the_partial_step_is_removed(small_filesystem, caplog):
    """Orbax (TensorStore) reports ENOSPC as a ValueError "RESOURCE_EXHAUSTED ...
    [os_error_code='28']" and logs each failing thread's traceback: one line instead, naming the
    intact checkpoint, and the unfinished folder is removed."""
    small = transformer.init_params(CONFIG, jax.random.key(0), "float32")
    state = create_train_state(small, optax.sgd(0.1), jax.random.key(1))
    directory = small_filesystem / "checkpoints"
    checkpointer = Checkpointer(str(directory))
    checkpointer.save(1, state, {"rl_step": 1})           # a few KB: fits
    # 3 MiB of random float32 (768 * 1024 * 4 bytes; Orbax compresses, so not constants)
    # cannot fit in 2 MiB.
    big = {"w": jax.random.normal(jax.random.key(2), (768, 1024), jax.numpy.float32)}
    with pytest.raises(WriteFailed) as caught:
        checkpointer.save(2, create_train_state(big, optax.sgd(0.1), jax.random.key(1)),
                          {"rl_step": 2})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("No space left on device (ENOSPC): writing checkpoint step 2 to "
                              f"{directory} failed (checkpoint 1 is intact; the unfinished 2.")
    assert message.endswith(" was removed)")
    assert sorted(os.listdir(directory)) == ["1"]
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.ERROR]
    assert checkpointer.read_meta(1)["rl_step"] == 1
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
