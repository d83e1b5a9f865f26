"""The safe builtins: Python's, reimplemented or guarded so that each pays for its work and
checks the limits before it makes a value. Each is called as function(interpreter, name, args,
kwargs); BUILTINS maps every name of ALLOWED_BUILTINS to one."""

from __future__ import annotations

import ast
import math
from typing import Any, Callable

from jrl.envs.sandbox.interpreter import (CONCRETE_ITERABLES, SCALAR_TYPES, Generator,
                                          Interpreter, is_int)
from jrl.envs.sandbox.limits import ALLOWED_BUILTINS, SandboxLimitExceeded


def _arguments(name: str, args: list, kwargs: dict, positional: tuple[str, ...],
               required: int = 0, keywords: tuple[str, ...] = (),
               defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A builtin's arguments bound by name (`keywords`: those that may be passed by keyword),
    with the TypeError Python raises for a bad call."""
    if len(args) > len(positional):
        raise TypeError(f"{name}() takes at most {len(positional)} positional arguments "
                        f"({len(args)} given)")
    bound = dict(defaults or {})
    bound.update(zip(positional, args))
    for keyword, value in kwargs.items():
        if keyword not in keywords:
            raise TypeError(f"{name}() got an unexpected keyword argument {keyword!r} "
                            f"(allowed: {', '.join(keywords) or 'none'})")
        if keyword in positional[:len(args)]:
            raise TypeError(f"{name}() got multiple values for argument {keyword!r}")
        bound[keyword] = value
    for parameter in positional[:required]:
        if parameter not in bound:
            raise TypeError(f"{name}() missing required argument {parameter!r}")
    return bound


def _builtin_print(interp: Interpreter, name, args, kwargs):
    options = _arguments(name, [], kwargs, (), keywords=("sep", "end"),
                         defaults={"sep": None, "end": None})
    sep = " " if options["sep"] is None else options["sep"]
    end = "\n" if options["end"] is None else options["end"]
    if type(sep) is not str or type(end) is not str:
        raise TypeError("print(): sep and end must be None or a string")
    for position, value in enumerate(args):
        # Piece by piece: once the output is full, nothing more is copied.
        interp.emit((sep if position else "") + interp.to_text(value))
    interp.emit(end)


def _builtin_abs(interp, name, args, kwargs):
    return interp.new_value(abs(_arguments(name, args, kwargs, ("x",), 1)["x"]))


def _builtin_min_max(interp, name, args, kwargs):
    options = _arguments(name, [], kwargs, (), keywords=("default",))
    if not args:
        raise TypeError(f"{name} expected at least 1 argument, got 0")
    items = interp.materialize(args[0]) if len(args) == 1 else list(args)
    if not items and "default" in options:
        return options["default"]
    if not all(type(item) in SCALAR_TYPES for item in items):
        interp.measure(items)
    interp.charge_bulk(len(items))
    return (min if name == "min" else max)(items)


def _builtin_sum(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("iterable", "start"), 1, keywords=("start",),
                         defaults={"start": 0})
    start = options["start"]
    if type(start) is str:
        raise TypeError("sum() can't sum strings")
    items = interp.materialize(options["iterable"])
    if all(type(item) in (int, float, bool) for item in items + [start]):
        # n ints of at most B bits sum to at most B + log2(n) bits: computing first is bounded.
        interp.charge_bulk(len(items))
        return interp.new_value(sum(items, start))
    total = start
    for item in items:  # sequences: each concatenation is checked before it is made
        interp.tick()
        total = interp.binary(ast.Add, total, item)
    return total


def _builtin_len(interp, name, args, kwargs):
    return len(_arguments(name, args, kwargs, ("obj",), 1)["obj"])


def _builtin_range(interp, name, args, kwargs):
    _arguments(name, args, kwargs, ("start", "stop", "step"), 1)
    result = range(*args)
    try:
        length = len(result)
    except OverflowError:  # longer than sys.maxsize
        length = math.inf
    interp.check_len(length, "a range")
    return result


def _builtin_round(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("number", "ndigits"), 1,
                         keywords=("number", "ndigits"), defaults={"ndigits": None})
    ndigits = options["ndigits"]
    if ndigits is None:
        return interp.new_value(round(options["number"]))
    if is_int(ndigits) and abs(ndigits) > interp.limits.max_int_bits:
        # round(an int, -n) computes 10 ** n.
        raise SandboxLimitExceeded(f"round(): ndigits={ndigits} is beyond +-"
                                   f"{interp.limits.max_int_bits}")
    return interp.new_value(round(options["number"], ndigits))


def _builtin_sorted(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("iterable",), 1, keywords=("reverse",),
                         defaults={"reverse": False})
    items = interp.materialize(options["iterable"])
    if not all(type(item) in SCALAR_TYPES for item in items):
        interp.measure(items)
    interp.charge_bulk(len(items) * max(1, len(items).bit_length()))  # ~n log n comparisons
    items.sort(reverse=options["reverse"])
    return items


def _builtin_int(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("x", "base"), 0, keywords=("base",),
                         defaults={"x": 0})
    value = options["x"]
    if type(value) is str and len(value) > interp.limits.max_int_bits + 100:
        # Each digit adds at least one bit, and parsing a long string takes quadratic time.
        raise SandboxLimitExceeded(f"int(): a string of {len(value)} characters would pass the "
                                   f"{interp.limits.max_int_bits}-bit integer limit")
    if "base" in options:
        return interp.new_value(int(value, options["base"]))
    return interp.new_value(int(value))


def _builtin_float(interp, name, args, kwargs):
    return float(_arguments(name, args, kwargs, ("x",), 0, defaults={"x": 0.0})["x"])


def _builtin_str(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("object",), 0, defaults={"object": ""})
    return interp.to_text(options["object"])


def _builtin_bool(interp, name, args, kwargs):
    return bool(_arguments(name, args, kwargs, ("x",), 0, defaults={"x": False})["x"])


def _builtin_list_tuple(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("iterable",), 0, defaults={"iterable": ()})
    items = interp.materialize(options["iterable"])
    return items if name == "list" else tuple(items)


def _builtin_set(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("iterable",), 0, defaults={"iterable": ()})
    items = interp.materialize(options["iterable"])
    for item in items:
        interp.register_key(item)
    return set(items)


def _builtin_dict(interp, name, args, kwargs):
    if len(args) > 1:
        raise TypeError(f"dict expected at most 1 argument, got {len(args)}")
    result: dict[Any, Any] = {}
    if args and type(args[0]) is dict:
        interp.charge_bulk(len(args[0]))
        result.update(args[0])
    elif args:
        for position, pair in enumerate(interp.materialize(args[0])):
            pair = interp.materialize(pair)
            if len(pair) != 2:
                raise ValueError(f"dictionary update sequence element #{position} has length "
                                 f"{len(pair)}; 2 is required")
            interp.register_key(pair[0])
            result[pair[0]] = pair[1]
    for key in kwargs:
        interp.register_key(key)
    result.update(kwargs)
    return interp.new_value(result)


def _builtin_enumerate(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("iterable", "start"), 1,
                         keywords=("iterable", "start"), defaults={"start": 0})
    start = options["start"]
    if not is_int(start):
        raise TypeError(f"'{type(start).__name__}' object cannot be interpreted as an integer")
    items = interp.materialize(options["iterable"])
    interp.check_int_bits((abs(start) + len(items)).bit_length())
    interp.charge_alloc(len(items))
    return list(enumerate(items, start))


def _builtin_zip(interp, name, args, kwargs):
    _arguments(name, [], kwargs, ())
    columns = [interp.materialize(arg) for arg in args]
    rows = list(zip(*columns))
    interp.charge_alloc(len(rows) * (1 + len(columns)))
    return rows


def _builtin_divmod(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("a", "b"), 2)
    return divmod(options["a"], options["b"])


def _builtin_pow(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("base", "exp", "mod"), 2,
                         keywords=("base", "exp", "mod"), defaults={"mod": None})
    if options["mod"] is None:
        return interp.binary(ast.Pow, options["base"], options["exp"])
    # A modular power is below the modulus, and costs ~bits(exp) products of modulus-sized ints.
    return interp.new_value(pow(options["base"], options["exp"], options["mod"]))


def _builtin_all_any(interp, name, args, kwargs):
    iterable = _arguments(name, args, kwargs, ("iterable",), 1)["iterable"]
    wanted = name == "any"  # any() stops at the first truthy item, all() at the first falsy one
    if type(iterable) is Generator:
        for item in iterable.items:
            if bool(item) == wanted:
                return wanted
        return not wanted
    if type(iterable) not in CONCRETE_ITERABLES:
        raise TypeError(f"'{type(iterable).__name__}' object is not iterable")
    interp.charge_bulk(len(iterable))
    return any(iterable) if wanted else all(iterable)


def _builtin_reversed(interp, name, args, kwargs):
    sequence = _arguments(name, args, kwargs, ("sequence",), 1)["sequence"]
    if type(sequence) not in (list, tuple, str, range, dict):
        raise TypeError(f"'{type(sequence).__name__}' object is not reversible")
    items = interp.materialize(sequence)
    items.reverse()
    return items


# Each builtin is called as function(interpreter, name, args, kwargs).
BUILTINS: dict[str, Callable[[Interpreter, str, list, dict], Any]] = {
    "print": _builtin_print, "abs": _builtin_abs, "min": _builtin_min_max,
    "max": _builtin_min_max, "sum": _builtin_sum, "len": _builtin_len, "range": _builtin_range,
    "round": _builtin_round, "sorted": _builtin_sorted, "int": _builtin_int,
    "float": _builtin_float, "str": _builtin_str, "bool": _builtin_bool,
    "list": _builtin_list_tuple, "tuple": _builtin_list_tuple, "set": _builtin_set,
    "dict": _builtin_dict, "enumerate": _builtin_enumerate, "zip": _builtin_zip,
    "divmod": _builtin_divmod, "pow": _builtin_pow, "all": _builtin_all_any,
    "any": _builtin_all_any, "reversed": _builtin_reversed,
}
assert set(BUILTINS) == set(ALLOWED_BUILTINS)
