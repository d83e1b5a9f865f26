"""Jitted programs shared within a process.

A jitted function compiles once per input signature, but every new `jax.jit` object starts with
an empty cache, so a second trainer built with the same settings would compile its step again.
Trainers and the warm start build their programs through `shared_program`: keys made of equal
settings (model config, numerical contract, loss chain, optimizer config, step options; frozen
dataclasses, compared by value) return the same jitted function, and a second run in one process
(a sweep, a notebook, a test suite) compiles nothing the first one compiled.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable, TypeVar

Program = TypeVar("Program")

# Programs kept (least recently used dropped first); each holds its compiled executables.
MAX_SHARED_PROGRAMS = 32

_programs: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def shared_program(key: Hashable, build: Callable[[], Program]) -> Program:
    """The program built for an equal `key` earlier in this process, else `build()` (kept).

    A key that cannot be hashed (a setting holding a list or an array) is not shared: `build()`
    every time, as without this cache.
    """
    try:
        hash(key)
    except TypeError:
        return build()
    with _lock:
        if key in _programs:
            _programs.move_to_end(key)
            return _programs[key]
    program = build()     # cheap: tracing and compiling wait for the first call
    with _lock:
        program = _programs.setdefault(key, program)
        _programs.move_to_end(key)
        while len(_programs) > MAX_SHARED_PROGRAMS:
            _programs.popitem(last=False)
    return program


def clear_shared_programs() -> None:
    """Drops every kept program (their executables are freed once nothing else holds them)."""
    with _lock:
        _programs.clear()
