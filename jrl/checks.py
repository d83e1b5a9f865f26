"""Checks for config values: one ValueError line naming the field, the value and what is
allowed (with the closest allowed name for a likely typo). The config sections
(jrl.pipeline.config, jrl.kernels.contract, jrl.models.config, jrl.sampling, jrl.train) validate
their fields with these."""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Iterable


def did_you_mean(value: Any, allowed: Iterable[Any]) -> str:
    """'; did you mean X?' for the allowed string closest to a string `value` (difflib's ratio
    >= 0.6), else ''."""
    if not isinstance(value, str):
        return ""
    names = [a for a in allowed if isinstance(a, str)]
    close = difflib.get_close_matches(value, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """ValueError "NAME=VALUE: allowed values are [...]; did you mean X?" unless value is in
    allowed."""
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: allowed values are {allowed}"
                         f"{did_you_mean(value, allowed)}")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_range(name: str, value, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> None:
    """Raises ValueError unless `value` is a finite real number within the bounds.

    low / high: None means unbounded on that side; low_open / high_open exclude the bound
    (check_range("optimizer.b1", b1, low=0, high=1, high_open=True): b1 in [0, 1))."""
    ok = _is_number(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if ok:
        return
    if low is not None and high is not None:
        allowed = (f"a number in {'(' if low_open else '['}{low:g}, {high:g}"
                   f"{')' if high_open else ']'}")
    elif low is not None:
        allowed = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        allowed = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        allowed = "a finite number"
    raise ValueError(f"{name}={value!r}: must be {allowed}")


def check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    """Raises ValueError unless `value` is a finite number > 0 (>= 0 with allow_zero)."""
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, float) and not math.isfinite(value):
        # inf passes "> 0" (and NaN no comparison): one message for both.
        raise ValueError(f"{name}={value!r}: must be a finite number {bound}")
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {bound}")


def check_int(name: str, value, *, low: int, high: int | None = None) -> None:
    """Raises ValueError unless `value` is an int (not a bool) in [low, high) (high: None =
    unbounded)."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value < high
    if not ok:
        upper = f", {_power_of_two(high)})" if high is not None else ""
        allowed = f"an int in [{low}{upper}" if high is not None else f"an int >= {low}"
        raise ValueError(f"{name}={value!r}: must be {allowed}")


def check_seed(name: str, value) -> None:
    """A PRNG seed: an int in [0, 2**32)."""
    check_int(name, value, low=0, high=2**32)


def _power_of_two(value: int) -> str:
    exponent = value.bit_length() - 1
    return f"2**{exponent}" if value > 0 and value == 1 << exponent else str(value)
