"""What a run does about faults: non-finite steps stop it, failing rewards are reported, and
Ctrl-C / SIGTERM wait for a checkpoint write in progress to finish."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

import numpy as np

from jrl.metrics import names
from jrl import stop_request

# More failed reward calls than this fraction of a step's rows prints a warning with the first.
REWARD_ERROR_WARN_FRACTION = 0.1


class NonFiniteError(RuntimeError):
    """A step produced a non-finite loss, gradient or logprob: the run stops (its update was
    skipped, so the params and the last checkpoint are intact)."""


def check_finite(step: int, metrics: dict) -> None:
    """Raises NonFiniteError naming the first non-finite metric of `step` (or a skipped update:
    a non-finite loss or gradient). Tokens the trainer scores -inf never get here: prepare_batch
    takes them out of the loss (train/excluded_tokens)."""
    bad = [name for name, value in metrics.items()
           if isinstance(value, (float, np.floating)) and not np.isfinite(value)]
    if metrics.get(names.TRAIN_UPDATE_SKIPPED, 0) > 0 and not bad:
        bad = [names.TRAIN_UPDATE_SKIPPED]
    if bad:
        shown = ", ".join(f"{name}={metrics[name]}" for name in bad[:4])
        raise NonFiniteError(
            f"step {step}: non-finite values ({shown}); the step's update was not applied "
            "and the run stops here. The last checkpoint is intact; fix the cause (learning "
            "rate, reward scale, ...) and resume with --resume.")


def reward_error_warning(rl_step: int, metrics: dict, rows: int,
                         first_error: str | None) -> str | None:
    """The warning for a step whose failed reward calls (rollout/reward_errors in its rollout
    metrics) exceed REWARD_ERROR_WARN_FRACTION of its rows, naming the first; None otherwise."""
    errors = metrics.get(names.ROLLOUT_REWARD_ERRORS, 0)
    if errors <= REWARD_ERROR_WARN_FRACTION * rows:
        return None
    return (f"warning: step {rl_step + 1}: {errors} reward calls failed and count as reward 0 "
            f"(of {rows} rows); first: {first_error}")


INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are delivered to their usual handlers when
    it ends (in the main thread; elsewhere signals cannot be handled and the block runs as is).

    A KeyboardInterrupt raised in the middle of an Orbax save leaves the save's background
    threads writing into the step's temporary folder; the interrupt handler's own save of the
    same step then collides with them (an OSError or Orbax's StepAlreadyExistsError: exit code 1
    instead of 130, found by launch/fault_campaign.py). Deferred, the save completes first.
    """
    if stop_request.is_installed():
        # The recording handler raises nothing mid-save (and a second signal must still exit).
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in INTERRUPT_SIGNALS}
    # None: a handler not installed from Python, which could not be put back.
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    received: list[int] = []
    for signum in INTERRUPT_SIGNALS:
        signal.signal(signum, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)
