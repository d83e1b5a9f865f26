"""What every part of the sandbox shares: its errors, its resource limits (SandboxLimits and
the step costs of bulk work), what run_python returns, and the names of the allowed builtins."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

ALLOWED_BUILTINS = (
    "abs", "all", "any", "bool", "dict", "divmod", "enumerate", "float", "int", "len", "list",
    "max", "min", "pow", "print", "range", "reversed", "round", "set", "sorted", "str", "sum",
    "tuple", "zip",
)

# One step of the step budget is one node evaluation (~0.2 us). Work on the elements of a container
# inside one operation costs steps too, at about the same time per step: C-level work (copying,
# sorting, `in`) ELEMENTS_PER_STEP elements a step, the interpreter's own walk of a value before it
# is printed, compared or hashed WALKED_ELEMENTS_PER_STEP. Big-int arithmetic (at most
# max_int_bits, well under 1 ms an operation) is bounded by timeout_s instead.
ELEMENTS_PER_STEP = 8
WALKED_ELEMENTS_PER_STEP = 2


class SandboxError(ValueError):
    """The untrusted code failed: invalid syntax, an error of the program, or a subclass below."""


class SandboxRefused(SandboxError):
    """The code uses a construct outside the allow-list (the message names the construct)."""


class SandboxLimitExceeded(SandboxError):
    """Running the code would pass one of the SandboxLimits (the message names the limit)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource bounds of one evaluation.

    max_source_chars: length of the source text.
    max_nesting_depth: bracket depth of the source (counted before parsing, brackets inside string
      literals included) and nesting depth of a value that is printed, compared or hashed.
    max_ast_nodes, max_ast_depth: size and depth of the parsed tree (the interpreter recurses
      along the tree's depth).
    max_steps: node evaluations (ELEMENTS_PER_STEP elements of bulk work inside a builtin count
      as one).
    timeout_s: wall-clock seconds, checked while running (between steps).
    max_int_bits: bit length of any int the program makes.
    max_collection_len: items of one list/tuple/set/dict/range, characters of one str.
    max_total_alloc: items and characters created over the whole run, freed ones included: the
      memory bound (about 8 bytes a list slot, 1-4 a character). A string built by += in a loop
      pays for every intermediate copy.
    max_output_chars: printed text kept; later output is dropped (SandboxOutput.output_truncated).
    """

    max_source_chars: int = 2000
    max_nesting_depth: int = 50
    max_ast_nodes: int = 5000
    max_ast_depth: int = 100
    max_steps: int = 1_000_000
    timeout_s: float = 1.0
    max_int_bits: int = 4096
    max_collection_len: int = 100_000
    max_total_alloc: int = 5_000_000
    max_output_chars: int = 10_000

    def __post_init__(self):
        check_limits(self)


def check_limits(limits, lowest: dict[str, int] | None = None) -> None:
    """Raises ValueError naming the field of a limits dataclass (SandboxLimits, the process
    sandbox's ProcessLimits) that is not allowed: timeout_s must be a finite number of seconds
    > 0, every other field an int >= lowest.get(field, 1)."""
    owner = type(limits).__name__
    for field in dataclasses.fields(limits):
        value = getattr(limits, field.name)
        if field.name == "timeout_s":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value) or value <= 0:
                raise ValueError(f"{owner}: timeout_s={value!r} is not allowed; it must be a "
                                 "finite number of seconds > 0.")
            continue
        low = (lowest or {}).get(field.name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{owner}: {field.name}={value!r} is not allowed; it must be an int "
                             f">= {low}.")


class SandboxOutput(NamedTuple):
    """What run_python returns.

    output: the text the program printed (at most max_output_chars).
    value: the value of the program's last statement when that is a bare expression, else None
      (it passed the same size and depth checks as value_repr, so repr(value) is safe too).
    value_repr: repr(value) made inside the sandbox's limits (None when value is None, as the
      Python REPL prints nothing for None).
    output_truncated: the program printed more than max_output_chars; the rest was dropped.
    """

    output: str
    value: Any
    value_repr: str | None
    output_truncated: bool = False
