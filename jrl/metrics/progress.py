"""Training progress: a tqdm bar on a terminal, plain status lines in logs."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from tqdm import tqdm

from jrl.metrics import names


def format_duration(seconds: float) -> str:
    """Compact h/m/s text: 5 -> "5s", 62 -> "1m02s", 3725 -> "1h02m05s"."""
    if not math.isfinite(seconds):
        return "?"
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class ProgressBar:
    """Shows the run's progress with its reward and latest eval accuracy.

    On a TTY: a tqdm bar (rate and ETA from tqdm) with "reward 0.412 | eval 0.530" after it.
    Otherwise (logs, CI): a plain line "step 12/200 | reward 0.412 | eval 0.530 | 1m02s elapsed |
    ETA 15m40s" every `every` steps and at the last step. The eval accuracy shown is the latest
    one seen (eval runs only every few steps); eval/accuracy is preferred, then
    eval/accuracy_greedy, then eval/accuracy_sampled. ETA = remaining steps x mean seconds per
    step since the first update, so a resumed run's rate ignores the steps before the resume.

    Args:
      total_steps: the step count at which the run ends, >= 1.
      stream: where to write (default sys.stdout).
      every: for non-TTY output, print every this many steps, >= 1.
      tty: force TTY (True) or plain (False) output; None asks stream.isatty().
      clock: seconds, monotonic (injectable for tests; the plain lines use it).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        every: int = 10,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for field, value in (("total_steps", total_steps), ("every", every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"ProgressBar: {field}={value!r} is not allowed; it must be an int >= 1."
                )
        self.total_steps = total_steps
        self.every = every
        self._stream = stream if stream is not None else sys.stdout
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.tty = tty
        self._clock = clock
        self._start_time: float | None = None
        self._start_step = 0
        self._eval: float | None = None
        self._bar: tqdm | None = None

    def _status(self, metrics: Mapping[str, Any]) -> list[str]:
        """["reward 0.412", "eval 0.530"] (what is known), remembering the latest eval."""
        for name in (names.EVAL_ACCURACY, names.EVAL_ACCURACY_GREEDY, names.EVAL_ACCURACY_SAMPLED):
            value = _as_float(metrics.get(name))
            if value is not None:
                self._eval = value
                break
        parts = []
        reward = _as_float(metrics.get(names.ROLLOUT_REWARD_MEAN))
        if reward is not None:
            parts.append(f"reward {reward:.3f}")
        if self._eval is not None:
            parts.append(f"eval {self._eval:.3f}")
        return parts

    def render(self, step: int, metrics: Mapping[str, Any] | None = None) -> str:
        """The plain status line for `step` (updates the remembered eval; prints nothing)."""
        now = self._clock()
        if self._start_time is None:
            self._start_time, self._start_step = now, step
        parts = [f"step {step}/{self.total_steps}"] + self._status(metrics or {})
        elapsed = now - self._start_time
        parts.append(f"{format_duration(elapsed)} elapsed")
        steps_done = step - self._start_step
        if steps_done > 0:
            eta = (self.total_steps - step) * elapsed / steps_done
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Records progress at `step` (the number of steps completed) and shows it."""
        if not self.tty:
            line = self.render(step, metrics)
            if step % self.every == 0 or step >= self.total_steps:
                self._stream.write(line + "\n")
                self._stream.flush()
            return
        if self._bar is None:
            # The first update fixes the start: a resumed run's rate ignores earlier steps.
            self._bar = tqdm(total=self.total_steps, initial=step, file=self._stream,
                             unit="step", dynamic_ncols=True, leave=True)
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix_str(" | ".join(self._status(metrics or {})), refresh=True)

    def write(self, text: str) -> None:
        """Prints a message on its own line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text.rstrip("\n"), file=self._stream)
        else:
            self._stream.write(text.rstrip("\n") + "\n")
            self._stream.flush()

    def close(self) -> None:
        """Ends the progress bar (TTY mode)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
