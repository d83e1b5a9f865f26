"""SIGINT / SIGTERM as a stop request: a flag the run checks at defined points, never an
exception raised wherever the main thread happens to be.

Python runs a signal handler in the main thread between two bytecodes, wherever they are: inside
a garbage-collection callback, an atexit hook or a `__del__`. An exception raised there is
printed as "Exception ignored in ..." and dropped, so a handler that raised KeyboardInterrupt
lost 4 of 27 SIGTERMs sent into a run's eval (the run went on and exited 0; a scheduler's SIGTERM
was then ignored until its SIGKILL). The handler installed here only records the signal. The run
calls `check_stop()` at its check points (between RL steps, while it waits for a rollout batch,
between a sampler's device calls in evaluation, between warm-start steps); it raises
`StopRequested`, a KeyboardInterrupt, so the run's interrupt handling saves the last finished step
as before. Inside `stop_at_once()` (setup, export: phases with nothing to save) the handler raises
at once as well, and the flag stays set, so a raise that Python dropped is raised again at the
next check point.

A second signal exits the process at once (status 128 + signal), naming the last intact
checkpoint of the directory given to `watch_checkpoints`.

Several processes (SPMD, or the split rollout / train processes) must stop at the same step,
or one would wait in a collective for a peer that left. `agree_with(fn)` gives the collective
that tells every process whether any was asked to stop; while it is set, the local check points
pass and `check_stop_at_step()` (called by every process at each step boundary) is where they
stop, together.

Library use is unchanged: without `install()` no handler is replaced, Ctrl-C raises Python's own
KeyboardInterrupt, and `check_stop()` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """A stop request (SIGINT or SIGTERM) raised at a check point; `signum` names the signal."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum} ({signal.Signals(signum).name})")
        self.signum = signum


class _State:
    installed = False
    signum: int | None = None     # the stop's signal (this process's or, agreed, a peer's)
    received = 0                  # signals this process received itself
    raise_at_once = 0             # depth of stop_at_once() blocks
    checkpoint_dir: str | None = None
    checkpoint_steps: Callable[[str], list[int]] | None = None
    agree: Callable[[int], int] | None = None


_state = _State()


def install() -> None:
    """Installs the recording handler for SIGINT and SIGTERM (main thread only; the CLI calls it
    first). SIGINT is set too: a process started in a script's background inherits SIGINT
    ignored, and `kill -INT` must still stop it."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _handle)
    _state.installed = True


def is_installed() -> bool:
    """True while the recording handler is the one Python runs for SIGINT and SIGTERM."""
    return _state.installed and all(signal.getsignal(s) is _handle for s in STOP_SIGNALS)


def requested() -> int | None:
    """The signal number of the pending stop request, or None."""
    return _state.signum


def exit_status() -> int | None:
    """128 + the signal of the pending stop request (130 for SIGINT, 143 for SIGTERM), or None."""
    return None if _state.signum is None else 128 + _state.signum


def check_stop() -> None:
    """Raises StopRequested when a stop was requested (a check point of one process; it passes
    while an agreement is set: see check_stop_at_step)."""
    if _state.signum is not None and _state.agree is None:
        raise StopRequested(_state.signum)


def agree_with(agree: Callable[[int], int] | None) -> None:
    """agree(this process's signal number, 0 for none) -> the signal some process received, 0
    for none: a collective that every process calls at each step boundary. None: one process
    decides alone (the default)."""
    _state.agree = agree


def check_stop_at_step() -> None:
    """The step boundary's check point: with an agreement, every process raises StopRequested
    at the same step when any was asked to stop; without one, check_stop()."""
    if _state.agree is None:
        check_stop()
        return
    signum = int(_state.agree(_state.signum or 0))
    if signum:
        _state.signum = _state.signum or signum
        raise StopRequested(_state.signum)


def watch_checkpoints(directory: str | None,
                      steps: Callable[[str], list[int]] | None = None) -> None:
    """The checkpoint directory a second signal names the last intact checkpoint of, and how
    to list its finished steps (default: the numbered folders of a local directory; a run on
    a bucket passes jrl.paths.intact_checkpoint_steps)."""
    _state.checkpoint_dir = directory
    _state.checkpoint_steps = steps


def reset() -> None:
    """Forgets a pending stop request (tests; a process that goes on after handling one)."""
    _state.signum, _state.received = None, 0


@contextlib.contextmanager
def stop_at_once() -> Iterator[None]:
    """Inside the block a stop request also raises where the main thread is (for phases that
    have nothing to save; the flag still catches a raise that Python dropped)."""
    _state.raise_at_once += 1
    try:
        check_stop()
        yield
    finally:
        _state.raise_at_once -= 1


def last_intact_checkpoint(directory: str | None,
                           steps: Callable[[str], list[int]] | None = None) -> int | None:
    """The newest finished checkpoint step in `directory`, or None. steps(directory) lists
    the finished steps in increasing order; by default those of a local directory (Orbax
    renames a step's temporary folder to its number only once the step is complete)."""
    if not directory:
        return None
    if steps is not None:
        found = steps(directory)
        return found[-1] if found else None
    try:
        local = [int(name) for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        return None
    return max(local) if local else None


def _handle(signum, frame) -> None:
    if threading.current_thread() is not threading.main_thread():   # pragma: no cover
        return
    _state.received += 1
    if _state.received > 1:       # this process's own second signal (a peer's stop is not one)
        _exit_now(signum)
    _state.signum = _state.signum or signum
    if _state.raise_at_once:
        raise StopRequested(signum)


def _exit_now(signum: int) -> None:
    """A second signal: leave without waiting for anything (a checkpoint being written stays a
    temporary folder that resume ignores)."""
    step = last_intact_checkpoint(_state.checkpoint_dir, _state.checkpoint_steps)
    where = (f"the last intact checkpoint is step {step} in {_state.checkpoint_dir}; resume "
             "with --resume" if step is not None else "no checkpoint was written")
    try:
        sys.stderr.write(f"\nsecond signal ({signal.Signals(signum).name}): exiting now; "
                         f"{where}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(128 + signum)
