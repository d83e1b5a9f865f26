"""Static checks of a program, before and right after parsing, before anything runs.

The source's length and bracket depth are checked before `ast.parse`; the tree is then walked
once (iteratively) against the allow-list of node types, the refusal messages of constructs that
are never allowed, and the size and depth limits. `parse` returns a tree the interpreter may
run."""

from __future__ import annotations

import ast
import re
from typing import Any

from jrl.envs.sandbox.limits import (ALLOWED_BUILTINS, SandboxError, SandboxLimitExceeded,
                                     SandboxLimits, SandboxRefused)

OPERATOR_SYMBOLS = {
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


def parse(source: str, limits: SandboxLimits, *, arithmetic: bool) -> ast.AST:
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
    elif kind in OPERATOR_SYMBOLS:
        raise SandboxRefused(f"the {OPERATOR_SYMBOLS[kind]} operator is not allowed in "
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
