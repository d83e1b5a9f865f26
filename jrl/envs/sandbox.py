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
key's hash against crafted collisions before it is inserted. A program that ran away (`while True: pass`) stops at max_steps or timeout_s. The failures are SandboxError (a
ValueError): SandboxRefused for a construct outside the allow-list, SandboxLimitExceeded for a
bound, and plain SandboxError for a syntax error or an error of the program ("ZeroDivisionError:
division by zero").
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
import operator
import re
import time
from typing import Any, Callable, Iterator, NamedTuple

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

_ERROR_CHARS = 200  # an error message quotes at most this much of the program's exception text

# Distinct keys that may share one hash value (see _Interpreter.register_key). Natural collisions
# are rare (hash(-1) == hash(-2)); crafted ones would make set and dict operations quadratic.
_MAX_KEYS_PER_HASH = 16


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
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "timeout_s":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                        not math.isfinite(value) or value <= 0:
                    raise ValueError(f"SandboxLimits: timeout_s={value!r} is not allowed; it must "
                                     "be a finite number of seconds > 0.")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SandboxLimits: {field.name}={value!r} is not allowed; it must "
                                 "be an int >= 1.")


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


# --------------------------------------------------------------------------------------------
# Static checks: before and right after parsing, before anything runs.

_OPERATOR_SYMBOLS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
    ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|", ast.BitXor: "^",
    ast.BitAnd: "&", ast.MatMult: "@", ast.UAdd: "unary +", ast.USub: "unary -",
    ast.Not: "not", ast.Invert: "~",
}

# The refusal message of each construct that is never allowed, by node type.
_REFUSED_MESSAGES = {
    ast.Import: "import is not allowed",
    ast.ImportFrom: "import is not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Lambda: "lambda is not allowed",
    ast.FunctionDef: "function definitions (def) are not allowed",
    ast.AsyncFunctionDef: "function definitions (def) are not allowed",
    ast.ClassDef: "class definitions are not allowed",
    ast.With: "with statements are not allowed",
    ast.AsyncWith: "with statements are not allowed",
    ast.Try: "try statements are not allowed",
    ast.Raise: "raise is not allowed",
    ast.Assert: "assert is not allowed",
    ast.Global: "global is not allowed",
    ast.Nonlocal: "nonlocal is not allowed",
    ast.Delete: "del is not allowed",
    ast.Return: "return is not allowed",
    ast.Yield: "yield is not allowed",
    ast.YieldFrom: "yield is not allowed",
    ast.Await: "await is not allowed",
    ast.AsyncFor: "async for is not allowed",
    ast.Starred: "starred expressions (*x) are not allowed",
    ast.NamedExpr: "assignment expressions (:=) are not allowed",
    ast.AnnAssign: "annotated assignments are not allowed",
    ast.Match: "match statements are not allowed",
    ast.MatMult: "the @ operator is not allowed",
}
if hasattr(ast, "TryStar"):  # Python >= 3.11
    _REFUSED_MESSAGES[ast.TryStar] = "try statements are not allowed"

_PYTHON_NODES = frozenset({
    ast.Module, ast.Expr, ast.Assign, ast.AugAssign, ast.If, ast.For, ast.While, ast.Break,
    ast.Continue, ast.Pass,
    ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.IfExp, ast.Dict, ast.Set, ast.ListComp, ast.SetComp,
    ast.DictComp, ast.GeneratorExp, ast.Compare, ast.Call, ast.Constant, ast.Subscript, ast.Name,
    ast.List, ast.Tuple, ast.Slice, ast.JoinedStr, ast.comprehension, ast.keyword,
    ast.Load, ast.Store, ast.And, ast.Or,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift,
    ast.BitOr, ast.BitXor, ast.BitAnd, ast.UAdd, ast.USub, ast.Not, ast.Invert,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
})

_ARITHMETIC_NODES = frozenset({
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.UAdd, ast.USub,
})

_PYTHON_CONSTANT_TYPES = (type(None), bool, int, float, str)

# An f-string field's format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(
    r"(?:[^{}]?[<>=^])?[-+ ]?z?#?0?(?P<width>\d*)[,_]?(?:\.(?P<precision>\d+))?[bcdeEfFgGnosxX%]?"
)
_MAX_FORMAT_WIDTH = 1000  # width and precision of an f-string format spec


def _bracket_depth(source: str) -> int:
    """The deepest nesting of ( [ { in `source`, brackets inside string literals included: the
    check has to run before the parser, whose recursion is what it guards."""
    depth = deepest = 0
    for character in source:
        if character in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif character in ")]}":
            depth -= 1
    return deepest


def _parse(source: str, limits: SandboxLimits, *, arithmetic: bool) -> ast.AST:
    """The checked tree of `source` (ast.Expression if arithmetic, else ast.Module)."""
    if not isinstance(source, str):
        raise TypeError(f"sandbox: the source must be a str; got {type(source).__name__}.")
    if arithmetic and not source.strip():
        raise SandboxError("invalid syntax: the expression is empty")
    if len(source) > limits.max_source_chars:
        raise SandboxLimitExceeded(f"the source is {len(source)} characters long; the limit is "
                                   f"{limits.max_source_chars}")
    depth = _bracket_depth(source)
    if depth > limits.max_nesting_depth:
        raise SandboxLimitExceeded(f"brackets are nested {depth} deep; the limit is "
                                   f"{limits.max_nesting_depth}")
    try:
        tree = ast.parse(source, mode="eval" if arithmetic else "exec")
    except SyntaxError as error:
        where = f" at line {error.lineno}" if error.lineno else ""
        detail = f": {error.msg}" if error.msg and error.msg != "invalid syntax" else ""
        raise SandboxError(f"invalid syntax{where}{detail}") from None
    except (RecursionError, MemoryError):
        raise SandboxLimitExceeded("the source is nested too deeply to parse") from None
    except ValueError as error:  # e.g. null bytes, on Python versions that raise ValueError
        raise SandboxError(f"invalid source: {error}") from None
    _check_tree(tree, limits, arithmetic=arithmetic)
    return tree


def _check_tree(tree: ast.AST, limits: SandboxLimits, *, arithmetic: bool) -> None:
    """Refuses a tree with a construct outside the allow-list, or past the size/depth limits.

    Iterative (an explicit stack), so that a deep tree cannot overflow Python's recursion here."""
    allowed = _ARITHMETIC_NODES if arithmetic else _PYTHON_NODES
    nodes = 0
    stack: list[tuple[ast.AST, int, bool]] = [(tree, 1, False)]  # (node, depth, inside a loop)
    while stack:
        node, depth, in_loop = stack.pop()
        nodes += 1
        if nodes > limits.max_ast_nodes:
            raise SandboxLimitExceeded(f"the code has more than {limits.max_ast_nodes} syntax "
                                       "nodes")
        if depth > limits.max_ast_depth:
            raise SandboxLimitExceeded(f"the code is nested more than {limits.max_ast_depth} "
                                       "levels deep")
        if arithmetic:
            _check_arithmetic_node(node, limits)
        else:
            _check_python_node(node, limits, in_loop)
        if type(node) not in allowed:
            raise SandboxRefused(f"{type(node).__name__} is not allowed")
        if isinstance(node, ast.JoinedStr):
            # The fields' expressions are checked like any other; their format specs were checked
            # as constants by _check_python_node and are not walked.
            children = [value.value for value in node.values
                        if isinstance(value, ast.FormattedValue)]
            stack.extend((child, depth + 1, False) for child in children)
            continue
        for field, value in ast.iter_fields(node):
            child_in_loop = in_loop
            if isinstance(node, (ast.For, ast.While)):
                child_in_loop = field == "body" or (in_loop and field == "orelse")
            # The interpreter walks a chain like 1+2+3+... (a left-deep tree) in a loop, so its
            # length is not depth.
            child_depth = depth if isinstance(node, ast.BinOp) and field == "left" else depth + 1
            children = value if isinstance(value, list) else [value]
            stack.extend((child, child_depth, child_in_loop) for child in children
                         if isinstance(child, ast.AST))


def _check_arithmetic_node(node: ast.AST, limits: SandboxLimits) -> None:
    kind = type(node)
    if kind in _ARITHMETIC_NODES and kind is not ast.Constant:
        return
    if kind is ast.Constant:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SandboxRefused(f"only numbers are allowed in arithmetic; got {value!r:.40}")
        _check_int_literal(value, limits)
    elif kind is ast.Name:
        raise SandboxRefused(f"names are not allowed in arithmetic (got {node.id!r:.40})")
    elif kind is ast.Call:
        raise SandboxRefused("function calls are not allowed in arithmetic")
    elif kind is ast.BitXor:
        raise SandboxRefused("the ^ operator is not allowed in arithmetic (use ** for powers)")
    elif kind in _OPERATOR_SYMBOLS:
        raise SandboxRefused(f"the {_OPERATOR_SYMBOLS[kind]} operator is not allowed in "
                             "arithmetic; allowed: + - * / // % ** and parentheses")
    elif kind in _REFUSED_MESSAGES:
        raise SandboxRefused(_REFUSED_MESSAGES[kind])
    else:
        raise SandboxRefused(f"{kind.__name__} is not allowed in arithmetic; allowed: numbers, "
                             "+ - * / // % ** and parentheses")


def _check_int_literal(value: Any, limits: SandboxLimits) -> None:
    if isinstance(value, int) and value.bit_length() > limits.max_int_bits:
        raise SandboxLimitExceeded(f"an integer literal has {value.bit_length()} bits; the limit "
                                   f"is {limits.max_int_bits}")


def _check_python_node(node: ast.AST, limits: SandboxLimits, in_loop: bool) -> None:
    kind = type(node)
    if kind in _REFUSED_MESSAGES:
        raise SandboxRefused(_REFUSED_MESSAGES[kind])
    if kind is ast.Name:
        # `_` alone is the usual throwaway loop variable; longer names starting with "_" are the
        # dunder/private names that escapes go through.
        if node.id.startswith("_") and node.id != "_":
            raise SandboxRefused(f"names starting with '_' are not allowed (got {node.id!r:.40})")
    elif kind is ast.Constant:
        if not isinstance(node.value, _PYTHON_CONSTANT_TYPES):
            raise SandboxRefused(f"{type(node.value).__name__} literals are not allowed; allowed: "
                                 "int, float, str, bool, None")
        _check_int_literal(node.value, limits)
    elif kind is ast.Call:
        function = node.func
        if type(function) in _REFUSED_MESSAGES:
            raise SandboxRefused(_REFUSED_MESSAGES[type(function)])
        if not isinstance(function, ast.Name):
            raise SandboxRefused("calling the result of an expression is not allowed; only these "
                                 f"builtins may be called: {', '.join(ALLOWED_BUILTINS)}")
        if function.id not in ALLOWED_BUILTINS:
            raise SandboxRefused(f"calling {function.id!r:.40} is not allowed; allowed functions: "
                                 f"{', '.join(ALLOWED_BUILTINS)}")
        names = [keyword.arg for keyword in node.keywords]
        if None in names:
            raise SandboxRefused("**keyword unpacking is not allowed")
        if len(set(names)) != len(names):
            raise SandboxError(f"invalid syntax at line {node.lineno}: keyword argument repeated")
    elif kind is ast.Dict:
        if any(key is None for key in node.keys):
            raise SandboxRefused("** unpacking in dict literals is not allowed")
    elif kind is ast.comprehension:
        if node.is_async:
            raise SandboxRefused("async comprehensions are not allowed")
    elif kind in (ast.Break, ast.Continue):
        if not in_loop:
            word = "break" if kind is ast.Break else "continue"
            raise SandboxError(f"invalid syntax at line {node.lineno}: '{word}' outside loop")
    elif kind is ast.JoinedStr:
        for value in node.values:
            if isinstance(value, ast.Constant):
                continue
            if not isinstance(value.value, (ast.Name, ast.Constant)):
                inner = _REFUSED_MESSAGES.get(type(value.value))
                raise SandboxRefused(inner or "f-string fields may only be plain names or "
                                     "constants (compute the value first)")
            _check_format_spec(value.format_spec)


def _check_format_spec(spec: ast.AST | None) -> None:
    if spec is None:
        return
    if not all(isinstance(part, ast.Constant) for part in spec.values):
        raise SandboxRefused("f-string format specs must be constant (no nested {fields})")
    text = "".join(part.value for part in spec.values)
    match = _FORMAT_SPEC.fullmatch(text)
    if match is None:
        raise SandboxRefused(f"the f-string format spec {text!r:.40} is not allowed")
    for field in ("width", "precision"):
        digits = match.group(field)
        if digits and int(digits) > _MAX_FORMAT_WIDTH:
            raise SandboxLimitExceeded(f"f-string format {field} {int(digits)} is above the "
                                       f"limit {_MAX_FORMAT_WIDTH}")


# --------------------------------------------------------------------------------------------
# The interpreter.

_SCALAR_TYPES = frozenset({type(None), bool, int, float, str})
_CONTAINER_TYPES = frozenset({list, tuple, dict, set})
_SEQUENCE_TYPES = frozenset({str, list, tuple})
_CONCRETE_ITERABLES = frozenset({list, tuple, dict, set, str, range})


class _Generator:
    """The value of a generator expression: consumed lazily by the interpreter only (it has no
    __iter__, so no C-level builtin can drive it past the interpreter's checks)."""

    __slots__ = ("items",)

    def __init__(self, items: Iterator[Any]):
        self.items = items

    def __repr__(self) -> str:
        return "<generator object <genexpr>>"


_Generator.__name__ = "generator"  # the type name that error messages show, as in Python


class _Scope:
    """Variables of the program (parent None) or of one comprehension (parent: the enclosing)."""

    __slots__ = ("names", "parent")

    def __init__(self, parent: _Scope | None = None):
        self.names: dict[str, Any] = {}
        self.parent = parent

    def find(self, name: str) -> dict[str, Any] | None:
        scope: _Scope | None = self
        while scope is not None:
            if name in scope.names:
                return scope.names
            scope = scope.parent
        return None


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def _is_int(value: Any) -> bool:
    return type(value) in (int, bool)


def _unit(kind: type) -> str:
    return "characters" if kind is str else "items"


def _scalar_chars(value: Any) -> int:
    """Roughly len(repr(value)) of a non-container (an int has ~0.3 decimal digits per bit)."""
    kind = type(value)
    if kind is str:
        return len(value) + 2
    if kind is int:
        return value.bit_length() * 3 // 10 + 2
    if kind is float:
        return 24
    if kind in (bool, type(None)):
        return 5
    return 40  # range, generator


_BINARY_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
    ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_,
}
_INPLACE_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.iadd, ast.Mult: operator.imul, ast.BitOr: operator.ior,
    ast.BitAnd: operator.iand, ast.BitXor: operator.ixor, ast.Sub: operator.isub,
}
_COMPARE_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
_UNARY_OPERATORS: dict[type, Callable[[Any], Any]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert,
}


class _Interpreter:
    """One evaluation's state: variables, the step/time/allocation budgets, printed output."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.steps = 0
        self.allocated = 0
        self.scope = _Scope()
        self.output: list[str] = []
        self.output_chars = 0
        self.output_truncated = False
        self.keys_by_hash: dict[int, list[Any]] = {}  # see register_key

    # ---- budgets -----------------------------------------------------------------------------
    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise SandboxLimitExceeded(f"step limit exceeded: the program ran more than "
                                       f"{self.limits.max_steps} steps")
        if not self.steps & 127:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise SandboxLimitExceeded(f"time limit exceeded: the program ran longer than "
                                       f"{self.limits.timeout_s:g} s")

    def charge_bulk(self, elements: int, per_step: int = ELEMENTS_PER_STEP) -> None:
        """Steps for `elements` elements of work inside one operation."""
        self.steps += 1 + elements // per_step
        if self.steps > self.limits.max_steps:
            raise SandboxLimitExceeded(f"step limit exceeded: the program ran more than "
                                       f"{self.limits.max_steps} steps")
        self.check_time()

    def check_len(self, length: int, what: str, unit: str = "items") -> None:
        if length > self.limits.max_collection_len:
            raise SandboxLimitExceeded(f"{what} would have {length} {unit}; the limit is "
                                       f"{self.limits.max_collection_len}")

    def charge_alloc(self, items: int) -> None:
        self.allocated += items
        if self.allocated > self.limits.max_total_alloc:
            raise SandboxLimitExceeded(f"memory limit exceeded: the program created more than "
                                       f"{self.limits.max_total_alloc} items and characters")

    def check_int_bits(self, bits: int) -> None:
        if bits > self.limits.max_int_bits:
            raise SandboxLimitExceeded(f"an integer would have {bits} bits; the limit is "
                                       f"{self.limits.max_int_bits}")

    def new_value(self, value: Any) -> Any:
        """`value`, just made by a bounded operation, checked against the limits and paid for."""
        kind = type(value)
        if kind is int:
            self.check_int_bits(value.bit_length())
            self.charge_alloc(value.bit_length() >> 6)  # 64-bit words; small ints are free
        elif kind in _SEQUENCE_TYPES or kind in _CONTAINER_TYPES:
            self.check_len(len(value), f"a {kind.__name__}", _unit(kind))
            self.charge_alloc(len(value))
        return value

    # ---- deep operations: repr, comparison, hashing ------------------------------------------
    def measure(self, value: Any) -> tuple[int, int]:
        """(elements, characters): the number of elements in `value` counted with repeats (its
        size as a tree) and roughly len(repr(value)), found by walking it
        (WALKED_ELEMENTS_PER_STEP elements a step).

        Every C-level operation that walks a whole value (repr, ==, <, hash, sorting) is preceded
        by this walk: a value built by sharing (`x = [x, x]` repeated) is exponentially larger
        than the steps that built it, and the walk runs out of steps on it before C would hang.
        A value that contains itself, or is nested deeper than max_nesting_depth (C recursion),
        is refused.
        """
        if type(value) not in _CONTAINER_TYPES:
            return 1, _scalar_chars(value)
        budget = (self.limits.max_steps - self.steps) * WALKED_ELEMENTS_PER_STEP
        chars = visited = containers = 0
        on_path: set[int] = set()
        stack: list[tuple[Any, int]] = [(value, 1)]  # depth 0 marks leaving a container
        while stack:
            item, depth = stack.pop()
            if depth == 0:
                on_path.discard(id(item))
                continue
            if id(item) in on_path:
                raise SandboxRefused("a value that contains itself cannot be printed, compared "
                                     "or hashed")
            if depth > self.limits.max_nesting_depth:
                raise SandboxLimitExceeded(f"a value nested more than "
                                           f"{self.limits.max_nesting_depth} levels deep cannot "
                                           "be printed, compared or hashed")
            on_path.add(id(item))
            stack.append((item, 0))
            is_dict = type(item) is dict
            size = 2 * len(item) if is_dict else len(item)
            visited += 1 + size
            containers += 1
            if not containers & 255:
                self.check_time()
            if visited > budget:
                raise SandboxLimitExceeded(f"step limit exceeded: the program ran more than "
                                           f"{self.limits.max_steps} steps (walking a large "
                                           "value)")
            chars += 2 + 2 * size
            elements = itertools.chain.from_iterable(item.items()) if is_dict else item
            for element in elements:
                if type(element) in _CONTAINER_TYPES:
                    stack.append((element, depth + 1))
                else:
                    chars += _scalar_chars(element)
        self.charge_bulk(visited, WALKED_ELEMENTS_PER_STEP)
        return visited, chars

    def guard_hashable(self, key: Any) -> None:
        """Refuses a key whose hashing or comparing would walk too far (see measure)."""
        if type(key) not in _SCALAR_TYPES:
            self.measure(key)

    def register_key(self, key: Any) -> None:
        """Checks a key about to be put in a set or dict: guard_hashable, and no more than
        _MAX_KEYS_PER_HASH distinct keys of the run may share one hash value.

        Keys with equal hashes probe the same slots, so n of them in one set cost n**2 / 2
        comparisons inside a single C call (set(xs), s | t, a copy), which no step or time check
        can interrupt; ints are easy to collide on purpose (i * (2**61 - 1) all hash to 0). Every
        key enters a set or dict through this check, so every set and dict stays free of long
        collision chains.
        """
        self.guard_hashable(key)
        same_hash = self.keys_by_hash.setdefault(hash(key), [])
        if key not in same_hash:
            if len(same_hash) >= _MAX_KEYS_PER_HASH:
                raise SandboxLimitExceeded(f"more than {_MAX_KEYS_PER_HASH} distinct set/dict "
                                           "keys share one hash value")
            same_hash.append(key)

    def to_text(self, value: Any, conversion: str = "s") -> str:
        """str(value) ("s"), repr ("r") or ascii ("a"), within max_collection_len."""
        if type(value) is str and conversion == "s":
            return value
        _, estimate = self.measure(value)
        if estimate > self.limits.max_collection_len:
            raise SandboxLimitExceeded(f"the text of a value would be about {estimate} "
                                       f"characters; the limit is "
                                       f"{self.limits.max_collection_len}")
        text = {"s": str, "r": repr, "a": ascii}[conversion](value)
        return self.new_value(text)

    def emit(self, text: str) -> None:
        room = self.limits.max_output_chars - self.output_chars
        if len(text) > room:
            text = text[:max(room, 0)]
            self.output_truncated = True
        if text:
            self.output.append(text)
            self.output_chars += len(text)

    # ---- iteration ---------------------------------------------------------------------------
    def loop_items(self, value: Any) -> Iterator[Any]:
        """An iterator over `value` for a for loop or comprehension (each iteration pays for its
        own steps in the loop body)."""
        kind = type(value)
        if kind in _CONCRETE_ITERABLES:
            return iter(value)
        if kind is _Generator:
            return value.items
        raise TypeError(f"'{kind.__name__}' object is not iterable")

    def materialize(self, value: Any) -> list[Any]:
        """The items of an iterable value as a new list, paid for and within max_collection_len."""
        kind = type(value)
        if kind in _CONCRETE_ITERABLES:
            self.check_len(len(value), f"a list of the items of a {kind.__name__}")
            self.charge_bulk(len(value))
            self.charge_alloc(len(value))
            return list(value)
        if kind is _Generator:
            items = []
            for item in value.items:
                items.append(item)
                self.check_len(len(items), "a list of a generator's items")
                self.charge_alloc(1)
            return items
        raise TypeError(f"'{kind.__name__}' object is not iterable")

    # ---- statements --------------------------------------------------------------------------
    def run_module(self, tree: ast.Module) -> Any:
        """Runs the program; the value of its last statement if that is a bare expression."""
        body = tree.body
        for index, statement in enumerate(body):
            if index == len(body) - 1 and isinstance(statement, ast.Expr):
                self.tick()
                return self.eval(statement.value, self.scope)
            self.execute(statement, self.scope)
        return None

    def execute_block(self, statements: list[ast.stmt], scope: _Scope) -> None:
        for statement in statements:
            self.execute(statement, scope)

    def execute(self, node: ast.stmt, scope: _Scope) -> None:
        self.tick()
        kind = type(node)
        if kind is ast.Expr:
            self.eval(node.value, scope)
        elif kind is ast.Assign:
            value = self.eval(node.value, scope)
            for target in node.targets:
                self.assign(target, value, scope)
        elif kind is ast.AugAssign:
            self.augmented_assign(node, scope)
        elif kind is ast.If:
            branch = node.body if self.eval(node.test, scope) else node.orelse
            self.execute_block(branch, scope)
        elif kind is ast.For:
            for item in self.loop_items(self.eval(node.iter, scope)):
                self.assign(node.target, item, scope)
                try:
                    self.execute_block(node.body, scope)
                except _Break:
                    break
                except _Continue:
                    continue
            else:
                self.execute_block(node.orelse, scope)
        elif kind is ast.While:
            while self.eval(node.test, scope):
                try:
                    self.execute_block(node.body, scope)
                except _Break:
                    break
                except _Continue:
                    continue
            else:
                self.execute_block(node.orelse, scope)
        elif kind is ast.Break:
            raise _Break
        elif kind is ast.Continue:
            raise _Continue
        elif kind is not ast.Pass:
            raise SandboxRefused(f"{kind.__name__} is not allowed")  # _check_tree refused it

    def assign(self, target: ast.expr, value: Any, scope: _Scope) -> None:
        kind = type(target)
        if kind is ast.Name:
            scope.names[target.id] = value
        elif kind in (ast.Tuple, ast.List):
            items = self.materialize(value)
            expected = len(target.elts)
            if len(items) != expected:
                if len(items) > expected:
                    raise ValueError(f"too many values to unpack (expected {expected})")
                raise ValueError(f"not enough values to unpack (expected {expected}, got "
                                 f"{len(items)})")
            for element, item in zip(target.elts, items):
                self.assign(element, item, scope)
        elif kind is ast.Subscript:
            container = self.eval(target.value, scope)
            self.store_item(container, self.eval(target.slice, scope), value)
        else:
            raise SandboxRefused(f"assigning to {kind.__name__} is not allowed")

    def store_item(self, container: Any, index: Any, value: Any) -> None:
        kind = type(container)
        if kind is dict:
            self.register_key(index)
            if index not in container:
                self.check_len(len(container) + 1, "a dict")
                self.charge_alloc(1)
        elif kind is list and type(index) is slice:
            value = self.materialize(value)
            replaced = len(range(*index.indices(len(container))))
            self.check_len(len(container) - replaced + len(value), "a list")
        container[index] = value  # other types (str, tuple, ...) raise TypeError themselves

    def augmented_assign(self, node: ast.AugAssign, scope: _Scope) -> None:
        target = node.target
        if type(target) is ast.Name:
            names = scope.find(target.id)
            if names is None:
                raise SandboxError(f"NameError: name {target.id!r} is not defined")
            names[target.id] = self.augmented(node.op, names[target.id],
                                              self.eval(node.value, scope))
        elif type(target) is ast.Subscript:
            container = self.eval(target.value, scope)
            index = self.eval(target.slice, scope)
            old = self.subscript(container, index)
            self.store_item(container, index, self.augmented(node.op, old,
                                                             self.eval(node.value, scope)))
        else:
            raise SandboxRefused(f"augmented assignment to {type(target).__name__} is not "
                                 "allowed")

    def augmented(self, op: ast.operator, old: Any, value: Any) -> Any:
        """old <op>= value: in place for list/set/dict (as Python does), else old <op> value."""
        kind, op_type = type(old), type(op)
        if kind is list and op_type is ast.Add:
            value = self.materialize(value)  # list += accepts any iterable
            self.check_len(len(old) + len(value), "a list")
        elif kind is list and op_type is ast.Mult and _is_int(value):
            self.check_len(len(old) * max(value, 0), "a list")
            self.charge_alloc(len(old) * max(value - 1, 0))
        elif kind in (set, dict) and type(value) is kind and op_type in _INPLACE_OPERATORS:
            self.check_len(len(old) + len(value), f"a {kind.__name__}")
            self.charge_alloc(len(value))
        else:
            return self.binary(op_type, old, value)
        return _INPLACE_OPERATORS[op_type](old, value)

    # ---- expressions -------------------------------------------------------------------------
    def eval(self, node: ast.expr, scope: _Scope) -> Any:
        self.tick()
        kind = type(node)
        if kind is ast.Constant:
            return node.value
        if kind is ast.Name:
            return self.load(node.id, scope)
        if kind is ast.BinOp:
            chain = [node]  # a left-deep chain a + b - c ..., walked in a loop (see _check_tree)
            while type(chain[-1].left) is ast.BinOp:
                chain.append(chain[-1].left)
                self.tick()
            value = self.eval(chain[-1].left, scope)
            for link in reversed(chain):
                value = self.binary(type(link.op), value, self.eval(link.right, scope))
            return value
        if kind is ast.UnaryOp:
            operand = self.eval(node.operand, scope)
            if type(node.op) is ast.Not:
                return not operand
            return self.new_value(_UNARY_OPERATORS[type(node.op)](operand))
        if kind is ast.BoolOp:
            is_and = type(node.op) is ast.And
            for value_node in node.values:
                value = self.eval(value_node, scope)
                if bool(value) != is_and:  # `and` stops at a falsy value, `or` at a truthy one
                    return value
            return value
        if kind is ast.IfExp:
            branch = node.body if self.eval(node.test, scope) else node.orelse
            return self.eval(branch, scope)
        if kind is ast.Compare:
            left = self.eval(node.left, scope)
            for op, right_node in zip(node.ops, node.comparators):
                right = self.eval(right_node, scope)
                if not self.compare(type(op), left, right):
                    return False
                left = right
            return True
        if kind is ast.Call:
            return self.call(node, scope)
        if kind is ast.Subscript:
            container = self.eval(node.value, scope)
            return self.subscript(container, self.eval(node.slice, scope))
        if kind is ast.Slice:
            bounds = [None if part is None else self.eval(part, scope)
                      for part in (node.lower, node.upper, node.step)]
            return slice(*bounds)
        if kind in (ast.List, ast.Tuple):
            items = [self.eval(element, scope) for element in node.elts]
            self.charge_alloc(len(items))
            return items if kind is ast.List else tuple(items)
        if kind is ast.Set:
            result = set()
            for element in node.elts:
                item = self.eval(element, scope)
                self.register_key(item)
                result.add(item)
            self.charge_alloc(len(result))
            return result
        if kind is ast.Dict:
            result = {}
            for key_node, value_node in zip(node.keys, node.values):
                key = self.eval(key_node, scope)
                self.register_key(key)
                result[key] = self.eval(value_node, scope)
            self.charge_alloc(2 * len(result))
            return result
        if kind in (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp):
            return self.comprehension(node, scope)
        if kind is ast.JoinedStr:
            return self.joined_str(node, scope)
        raise SandboxRefused(f"{kind.__name__} is not allowed")  # _check_tree refused it

    def load(self, name: str, scope: _Scope) -> Any:
        names = scope.find(name)
        if names is not None:
            return names[name]
        if name in ALLOWED_BUILTINS:
            raise SandboxRefused(f"the builtin {name!r} may only be called, not used as a value")
        raise SandboxError(f"NameError: name {name!r} is not defined")

    def binary(self, op: type, left: Any, right: Any) -> Any:
        """left <op> right, refused before it is computed when the result would pass a limit."""
        left_kind, right_kind = type(left), type(right)
        if op is ast.Add:
            if left_kind is right_kind and left_kind in _SEQUENCE_TYPES:
                self.check_len(len(left) + len(right), f"a {left_kind.__name__}",
                               _unit(left_kind))
        elif op is ast.Mult:
            if left_kind in _SEQUENCE_TYPES and _is_int(right):
                self.check_len(len(left) * max(right, 0), f"a repeated {left_kind.__name__}",
                               _unit(left_kind))
            elif right_kind in _SEQUENCE_TYPES and _is_int(left):
                self.check_len(len(right) * max(left, 0), f"a repeated {right_kind.__name__}",
                               _unit(right_kind))
            elif _is_int(left) and _is_int(right):
                # A product has at least bits(a) + bits(b) - 1 bits.
                self.check_int_bits(left.bit_length() + right.bit_length() - 1)
        elif op is ast.Pow:
            if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
                # |a| ** b has floor(b * log2|a|) + 1 bits; b alone bounds it from below.
                self.check_int_bits(right)
                self.check_int_bits(int(right * math.log2(abs(left))))
        elif op is ast.LShift:
            if _is_int(left) and _is_int(right) and left != 0 and right > 0:
                self.check_int_bits(right)
                self.check_int_bits(left.bit_length() + right)
        elif op is ast.Mod:
            if left_kind is str:
                raise SandboxRefused("%-formatting of strings is not allowed")
        elif op in (ast.BitOr, ast.BitXor):
            if left_kind is right_kind and left_kind in (set, dict):
                self.check_len(len(left) + len(right), f"a {left_kind.__name__}")
        if op not in _BINARY_OPERATORS:
            raise SandboxRefused(f"the {_OPERATOR_SYMBOLS.get(op, op.__name__)} operator is not "
                                 "allowed")
        return self.new_value(_BINARY_OPERATORS[op](left, right))

    def compare(self, op: type, left: Any, right: Any) -> bool:
        if op is ast.Is:
            return left is right
        if op is ast.IsNot:
            return left is not right
        if op in (ast.In, ast.NotIn):
            found = self.contains(right, left)
            return found if op is ast.In else not found
        if type(left) in _CONTAINER_TYPES and type(right) in _CONTAINER_TYPES:
            self.measure(left)
            self.measure(right)
        return _COMPARE_OPERATORS[op](left, right)

    def contains(self, container: Any, item: Any) -> bool:
        kind = type(container)
        if kind is _Generator:
            container, kind = self.materialize(container), list
        if kind in (dict, set):
            self.guard_hashable(item)
        elif kind in (list, tuple):
            # `item == element` walks the two in step and stops where `item` ends, so it costs at
            # most item's size, whatever the element is: the container need not be walked.
            item_size, _ = self.measure(item)
            self.charge_bulk(len(container) * item_size)
        elif kind in (str, range):
            self.charge_bulk(len(container))
        else:
            raise TypeError(f"argument of type '{kind.__name__}' is not iterable")
        return item in container

    def subscript(self, container: Any, index: Any) -> Any:
        if type(container) is dict:
            self.guard_hashable(index)
        item = container[index]
        # A slice is a new object; an item is not (charging it again would bill every read).
        return self.new_value(item) if type(index) is slice else item

    def comprehension(self, node: ast.expr, scope: _Scope) -> Any:
        generators = node.generators
        # Python evaluates the first iterable in the enclosing scope, the rest in the
        # comprehension's own.
        scopes = self.comprehension_scopes(generators, 0, _Scope(scope),
                                           self.eval(generators[0].iter, scope))
        kind = type(node)
        if kind is ast.GeneratorExp:
            return _Generator(self.eval(node.elt, inner) for inner in scopes)
        if kind is ast.ListComp:
            result = []
            for inner in scopes:
                result.append(self.eval(node.elt, inner))
                self.check_len(len(result), "a list")
                self.charge_alloc(1)
        elif kind is ast.SetComp:
            result = set()
            for inner in scopes:
                item = self.eval(node.elt, inner)
                self.register_key(item)
                result.add(item)
                self.check_len(len(result), "a set")
                self.charge_alloc(1)
        else:
            result = {}
            for inner in scopes:
                key = self.eval(node.key, inner)
                self.register_key(key)
                result[key] = self.eval(node.value, inner)
                self.check_len(len(result), "a dict")
                self.charge_alloc(2)
        return result

    def comprehension_scopes(self, generators: list[ast.comprehension], index: int,
                             inner: _Scope, iterable: Any) -> Iterator[_Scope]:
        """The comprehension's scope once per combination of its `for` clauses that passes the
        `if` clauses (the same scope object, rebound each time, as in Python)."""
        generator = generators[index]
        for item in self.loop_items(iterable):
            self.assign(generator.target, item, inner)
            if all(self.eval(condition, inner) for condition in generator.ifs):
                if index + 1 == len(generators):
                    yield inner
                else:
                    yield from self.comprehension_scopes(
                        generators, index + 1, inner, self.eval(generators[index + 1].iter, inner))

    def joined_str(self, node: ast.JoinedStr, scope: _Scope) -> str:
        parts = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                parts.append(part.value)
                continue
            value = self.eval(part.value, scope)
            conversion = "s" if part.conversion == -1 else chr(part.conversion)
            spec = "".join(piece.value for piece in part.format_spec.values) \
                if part.format_spec is not None else ""
            if spec and part.conversion == -1 and type(value) is not str:
                # Numbers format within the spec's bounded width/precision; other objects
                # refuse a non-empty spec without printing themselves.
                parts.append(self.new_value(format(value, spec)))
            else:
                text = self.to_text(value, conversion)
                parts.append(self.new_value(format(text, spec)) if spec else text)
        self.check_len(sum(len(part) for part in parts), "an f-string", "characters")
        return self.new_value("".join(parts))

    # ---- calls -------------------------------------------------------------------------------
    def call(self, node: ast.Call, scope: _Scope) -> Any:
        name = node.func.id
        names = scope.find(name)
        if names is not None:  # the program assigned a variable of this name: not callable
            raise TypeError(f"'{type(names[name]).__name__}' object is not callable")
        args = [self.eval(argument, scope) for argument in node.args]
        kwargs = {keyword.arg: self.eval(keyword.value, scope) for keyword in node.keywords}
        return _BUILTINS[name](self, name, args, kwargs)


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


def _builtin_print(interp: _Interpreter, name, args, kwargs):
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
    if not all(type(item) in _SCALAR_TYPES for item in items):
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
    if _is_int(ndigits) and abs(ndigits) > interp.limits.max_int_bits:
        # round(an int, -n) computes 10 ** n.
        raise SandboxLimitExceeded(f"round(): ndigits={ndigits} is beyond +-"
                                   f"{interp.limits.max_int_bits}")
    return interp.new_value(round(options["number"], ndigits))


def _builtin_sorted(interp, name, args, kwargs):
    options = _arguments(name, args, kwargs, ("iterable",), 1, keywords=("reverse",),
                         defaults={"reverse": False})
    items = interp.materialize(options["iterable"])
    if not all(type(item) in _SCALAR_TYPES for item in items):
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
    if not _is_int(start):
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
    if type(iterable) is _Generator:
        for item in iterable.items:
            if bool(item) == wanted:
                return wanted
        return not wanted
    if type(iterable) not in _CONCRETE_ITERABLES:
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
_BUILTINS: dict[str, Callable[[_Interpreter, str, list, dict], Any]] = {
    "print": _builtin_print, "abs": _builtin_abs, "min": _builtin_min_max,
    "max": _builtin_min_max, "sum": _builtin_sum, "len": _builtin_len, "range": _builtin_range,
    "round": _builtin_round, "sorted": _builtin_sorted, "int": _builtin_int,
    "float": _builtin_float, "str": _builtin_str, "bool": _builtin_bool,
    "list": _builtin_list_tuple, "tuple": _builtin_list_tuple, "set": _builtin_set,
    "dict": _builtin_dict, "enumerate": _builtin_enumerate, "zip": _builtin_zip,
    "divmod": _builtin_divmod, "pow": _builtin_pow, "all": _builtin_all_any,
    "any": _builtin_all_any, "reversed": _builtin_reversed,
}
assert set(_BUILTINS) == set(ALLOWED_BUILTINS)


def _run_guarded(function: Callable[[], Any]) -> Any:
    """function(), with the program's own exceptions turned into SandboxError."""
    try:
        return function()
    except SandboxError:
        raise
    except RecursionError as error:
        raise SandboxLimitExceeded("the program nests too deeply (recursion limit)") from error
    except MemoryError as error:
        raise SandboxLimitExceeded("out of memory") from error
    except (ArithmeticError, LookupError, TypeError, ValueError, RuntimeError) as error:
        message = f"{type(error).__name__}: {error}"
        if len(message) > _ERROR_CHARS:
            message = message[:_ERROR_CHARS] + "..."
        raise SandboxError(message) from error


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
    tree = _parse(expression.strip() if isinstance(expression, str) else expression, limits,
                  arithmetic=True)
    interpreter = _Interpreter(limits)
    value = _run_guarded(lambda: interpreter.eval(tree.body, interpreter.scope))
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
    tree = _parse(source, limits, arithmetic=False)
    interpreter = _Interpreter(limits)

    def run() -> SandboxOutput:
        value = interpreter.run_module(tree)
        value_repr = None if value is None else interpreter.to_text(value, "r")
        return SandboxOutput(output="".join(interpreter.output), value=value,
                             value_repr=value_repr,
                             output_truncated=interpreter.output_truncated)

    return _run_guarded(run)
