"""A safe evaluator for untrusted, model-written code: an allow-listed interpreter of Python's AST.

The text is only ever parsed (`ast.parse`); it is never compiled to bytecode, eval'd or exec'd. A
small interpreter walks the tree and evaluates the allowed constructs itself, so nothing outside
the allow-list can run: no imports, no attribute access (hence no `().__class__` escapes), no
function or class definitions, and calls only to a fixed set of builtins, reimplemented or guarded
here. Two languages:

    evaluate_arithmetic("(1 + 2) * 3")           -> 9
    run_python("xs = [i * i for i in range(4)]\\nprint(sum(xs))\\nxs")
        -> SandboxOutput(output="14\\n", value=[0, 1, 4, 9], value_repr="[0, 1, 4, 9]", ...)

Every resource is bounded by SandboxLimits, and every bound is checked before the work it guards:
the source's length and bracket depth before parsing; the tree's size and depth before running;
an int's bit length before `**`, `*`, `<<`; a sequence's length before repetition, concatenation,
range() or a copy; the size of a value before it is printed, compared or hashed; a set or dict
key's hash against crafted collisions before it is inserted. A program that ran away
(`while True: pass`) stops at max_steps or timeout_s. The failures are SandboxError (a
ValueError): SandboxRefused for a construct outside the allow-list, SandboxLimitExceeded for a
bound, and plain SandboxError for a syntax error or an error of the program ("ZeroDivisionError:
division by zero").

The parts: limits (errors, SandboxLimits, SandboxOutput, the allowed names), check (static
checks before anything runs), interpreter (the evaluation and its budgets), builtins (the safe
builtins). This module runs them in that order.
"""

from __future__ import annotations

from jrl.envs.sandbox.builtins import BUILTINS
from jrl.envs.sandbox.check import parse
from jrl.envs.sandbox.interpreter import Interpreter, run_guarded
from jrl.envs.sandbox.limits import (ALLOWED_BUILTINS, ELEMENTS_PER_STEP, WALKED_ELEMENTS_PER_STEP,
                                     SandboxError, SandboxLimitExceeded, SandboxLimits,
                                     SandboxOutput, SandboxRefused)

__all__ = ["ALLOWED_BUILTINS", "ELEMENTS_PER_STEP", "WALKED_ELEMENTS_PER_STEP", "SandboxError",
           "SandboxLimitExceeded", "SandboxLimits", "SandboxOutput", "SandboxRefused",
           "evaluate_arithmetic", "run_python"]


def evaluate_arithmetic(expression: str, limits: SandboxLimits = SandboxLimits()) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary + -, parentheses.

    Python's semantics: int arithmetic is exact, `/` always gives a float (7/2 -> 3.5,
    6/3 -> 2.0), `**` associates to the right (2**3**2 -> 512). Surrounding whitespace is ignored.

    Raises:
      SandboxRefused: anything else (names, calls, strings, comparisons, ^, ...).
      SandboxLimitExceeded: a bound of `limits` (9**9**9 is refused before it is computed).
      SandboxError: invalid syntax, an arithmetic error ("ZeroDivisionError: division by
        zero", a float overflow), or a complex result ((-1)**0.5).
    """
    tree = parse(expression.strip() if isinstance(expression, str) else expression, limits,
                  arithmetic=True)
    interpreter = Interpreter(limits, BUILTINS)
    value = run_guarded(lambda: interpreter.eval(tree.body, interpreter.scope))
    if isinstance(value, complex):   # a fractional power of a negative number: (-1)**0.5
        raise SandboxError("the result is not a real number")
    return value


def run_python(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxOutput:
    """Runs a small subset of Python and returns what it printed and its final value.

    Allowed: int/float/str/bool/None literals; tuple, list, dict and set displays; arithmetic,
    bitwise, comparison (incl. in, is) and boolean operators; `a if c else b`; assignment to
    names, subscripts and tuples of them (`a, b = b, a`), augmented assignment (`+=`, ...);
    `if`/`for`/`while` (with `else`), `break`, `continue`, `pass`; list/set/dict comprehensions
    and generator expressions; subscripts and slices; f-strings whose fields are plain names or
    constants, with an optional constant format spec (`f"{x:.3f}"`); and calls to the builtins
    in ALLOWED_BUILTINS, by name, positional and keyword arguments (no */** unpacking).
    `enumerate`, `zip` and `reversed` return lists (they are lazy iterators in Python).

    Refused (SandboxRefused, naming the construct): import, attribute access of any kind, names
    starting with "_" (except `_` itself), lambda, def, class, with, try, raise, assert, global,
    nonlocal, del, yield, await, match, starred expressions, `:=`, %-formatting of strings, and a
    call to anything but an allowed builtin (eval, exec, open, getattr, type, ...). A name used
    before it is assigned is a SandboxError ("NameError: ..."), as are the program's own errors
    (ZeroDivisionError, IndexError, TypeError, ...) and invalid syntax; limits raise
    SandboxLimitExceeded. Each call starts from no variables.
    """
    tree = parse(source, limits, arithmetic=False)
    interpreter = Interpreter(limits, BUILTINS)

    def run() -> SandboxOutput:
        value = interpreter.run_module(tree)
        value_repr = None if value is None else interpreter.to_text(value, "r")
        return SandboxOutput(output="".join(interpreter.output), value=value,
                             value_repr=value_repr,
                             output_truncated=interpreter.output_truncated)

    return run_guarded(run)
