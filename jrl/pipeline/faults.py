"""What a run does about bad numbers: non-finite steps stop it, failing rewards are reported."""

from __future__ import annotations

import numpy as np

from jrl.metrics import names

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
