"""Orbax checkpoints of a run: train state, reference params, and JSON metadata.

A checkpoint directory holds one numbered step folder per save; Orbax writes each into a
temporary folder and renames it when complete, so a crash never leaves a half-written step that
`latest_step` would pick up. Metadata (config, numerical contract, RL step, data position, ...)
is JSON next to the arrays, so a checkpoint can be inspected and validated before restoring.

Normally every process of a job saves and restores together (arrays may span processes). A
checkpointer with `alone=True` is used by one process of a multi-process job while the others do
something else (the train process of jrl.pipeline.loop.multihost): no barrier waits for them, and the
arrays go through host memory, because Orbax refuses arrays of one process's devices in a
multi-process job and writes host arrays from process 0 only, so that process must be process 0.

LoRA: a checkpoint holds the trainable params only (the adapters, their optimizer state, and the
reference policy's adapters), not the frozen base, which restore takes from the state it
restores into (the base the run loaded; jrl.models.lora.split_trainable). A full-weight state
is saved whole, as before.

A gs:// directory (jrl.paths) is kept as a URL and handed to Orbax as an etils.epath.Path: Orbax
writes the arrays through TensorStore's GCS driver and the rest through etils.epath, and marks
a finished step with commit_success.txt instead of a rename (jrl.paths.intact_checkpoint_steps).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp

from jrl import paths
from jrl.io_errors import WriteFailed, describe_os_error, find_os_error
from jrl.models.lora import merge_trainable, split_trainable
from jrl.train.state import TrainState


def _trainable(state: TrainState) -> TrainState:
    return state._replace(params=split_trainable(state.params)[0])


class _HeldRecords(logging.Filter):
    """Keeps the records of a logger instead of emitting them, until release()."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.records = logger, []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()


@contextlib.contextmanager
def _orbax_errors_held() -> Iterator[_HeldRecords]:
    """Orbax's log records during a save are held: a disk error is then reported as one line
    (its background threads log each failure with a traceback first); a save that succeeds,
    or fails otherwise, releases them as Orbax logged them."""
    logger = logging.getLogger("absl")
    held = _HeldRecords(logger)
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)


class CorruptCheckpointError(RuntimeError):
    """A checkpoint step whose files cannot be read back (truncated or broken data, bad meta)."""


class Checkpointer:
    """Saves and restores (TrainState, optional reference params, metadata dict).

    alone=True: this process saves and restores by itself within a multi-process job (see the
    module docstring; it must be process 0). Orbax is then opened on first use, so a process
    that never saves never touches the directory. With one process `alone` changes nothing.
    """

    def __init__(self, directory: str, *, keep: int = 2, alone: bool = False):
        self.directory = paths.resolve(directory)    # local: absolute; a URL: as it is
        self._keep = keep
        self._alone = alone and jax.process_count() > 1
        self._opened: ocp.CheckpointManager | None = None if self._alone else self._open()

    @property
    def _manager(self) -> ocp.CheckpointManager:
        if self._opened is None:
            self._opened = self._open()
        return self._opened

    def _orbax_directory(self):
        return paths.as_epath(self.directory) if paths.is_url(self.directory) else self.directory

    def _open(self) -> ocp.CheckpointManager:
        if not self._alone:
            return ocp.CheckpointManager(
                self._orbax_directory(),
                options=ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True),
                item_names=("state", "reference", "meta"))
        me = jax.process_index()
        if me != 0:
            raise ValueError(f"Checkpointer(alone=True) on process {me}: only process 0 can save "
                             "alone in a multi-process job (Orbax writes host arrays from "
                             "process 0 only)")
        # Barriers among this process only, i.e. none; Orbax refuses create=True with them.
        only_me = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        paths.makedirs(self.directory)
        return ocp.CheckpointManager(
            self._orbax_directory(),
            options=ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=False,
                                                 multiprocessing_options=only_me),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(multiprocessing_options=only_me),
                "reference": ocp.StandardCheckpointHandler(multiprocessing_options=only_me),
                "meta": ocp.JsonCheckpointHandler(multiprocessing_options=only_me)})

    def set_aside(self, step: int, reason: str = "corrupt") -> str:
        """Renames step's folder to `<step>.<reason>-<n>` (kept for inspection, no longer a
        step), so a later save of the same step number can be written. Returns the new path."""
        source = os.path.join(self.directory, str(step))
        n = 0
        while paths.exists(f"{source}.{reason}-{n}"):
            n += 1
        paths.rename(source, f"{source}.{reason}-{n}")
        self._manager.close()
        self._opened = self._open()
        return f"{source}.{reason}-{n}"

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: TrainState, meta: dict, *, reference: Any = None) -> None:
        """Writes checkpoint `step` and waits until it is complete on disk (the trainable params:
        see the module docstring)."""
        state = _trainable(state)
        if reference is not None:
            reference = split_trainable(reference)[0]
        if self._alone:
            state, reference = jax.device_get((state, reference))
        items = {"state": ocp.args.StandardSave(state),
                 "meta": ocp.args.JsonSave(meta)}
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
        with _orbax_errors_held() as held:
            try:
                self._manager.save(step, args=ocp.args.Composite(**items), force=True)
                self._manager.wait_until_finished()
                held.release()
            except Exception as error:
                if find_os_error(error) is None:
                    held.release()
                    raise
                # Orbax wraps the disk's error in pages of logged tracebacks: one line instead.
                previous = [s for s in self._saved_steps() if s != step]
                kept = (f"checkpoint {previous[-1]} is intact" if previous
                        else "no earlier checkpoint exists")
                removed = self._remove_unfinished(step)
                raise WriteFailed(f"{describe_os_error(error)}: writing checkpoint step {step} "
                                  f"to {self.directory} failed ({kept}"
                                  + (f"; the unfinished {removed} was removed)" if removed
                                     else ")")) from error

    def _remove_unfinished(self, step: int) -> str | None:
        """Removes step's unfinished temporary folder(s) after a failed write (resume ignores
        them, but on a full disk they hold the space the next try needs); their name, or None.
        On an object store the unfinished step is the step's own folder without Orbax's commit
        file."""
        if paths.is_url(self.directory):
            if step in self._saved_steps() or not paths.isdir(os.path.join(self.directory,
                                                                            str(step))):
                return None
            try:
                paths.rmtree(os.path.join(self.directory, str(step)))
            except Exception:   # noqa: BLE001 - the write's own error is the one reported
                return None
            return str(step)
        try:
            names = [n for n in os.listdir(self.directory)
                     if n.startswith(f"{step}.") and "tmp" in n]
        except OSError:
            return None
        for name in names:
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        return ", ".join(names) or None

    def _saved_steps(self) -> list[int]:
        return paths.intact_checkpoint_steps(self.directory)

    def read_meta(self, step: int | None = None) -> dict:
        """The metadata of `step` (default the latest); CorruptCheckpointError naming the step
        folder when it cannot be read."""
        step = self._require_step(step)
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as err:   # Orbax / JSON / file errors all mean an unreadable step
            raise CorruptCheckpointError(
                f"{os.path.join(self.directory, str(step))}: metadata unreadable "
                f"({type(err).__name__}: {err})") from err
        if not isinstance(meta, dict):
            raise CorruptCheckpointError(f"{os.path.join(self.directory, str(step))}: metadata "
                                         f"is {type(meta).__name__}, not a JSON object")
        return meta

    def restore(self, like_state: TrainState, step: int | None = None, *,
                like_reference: Any = None) -> tuple[TrainState, Any, dict]:
        """Restores into the structure, shapes, dtypes and shardings of `like_state` (alone:
        host numpy arrays of its shapes and dtypes, for the caller to place). A frozen LoRA base
        is not in the checkpoint: the restored state holds like_state's (and the reference
        like_reference's)."""
        step = self._require_step(step)
        frozen = split_trainable(like_state.params)[1]
        like_state = _trainable(like_state)
        frozen_reference = None
        if like_reference is not None:
            like_reference, frozen_reference = split_trainable(like_reference)
        if self._alone:
            abstract = lambda tree: jax.tree.map(lambda x: np.empty(x.shape, x.dtype), tree)
        else:
            abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        items = {"state": ocp.args.StandardRestore(abstract(like_state)),
                 "meta": ocp.args.JsonRestore()}
        if like_reference is not None:
            items["reference"] = ocp.args.StandardRestore(abstract(like_reference))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:   # truncated or corrupt array data
            raise CorruptCheckpointError(
                f"{os.path.join(self.directory, str(step))}: arrays unreadable "
                f"({type(err).__name__}: {str(err)[:300]})") from err
        reference = (merge_trainable(restored["reference"], frozen_reference)
                     if like_reference is not None else None)
        state = restored["state"]
        state = state._replace(params=merge_trainable(state.params, frozen))
        return state, reference, restored["meta"]

    def _require_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"checkpoint step {step} not found in {self.directory}; "
                                    f"available: {self.all_steps()}")
        return step

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()
