"""The interpreter: evaluates a checked tree (jrl.envs.sandbox.check) node by node.

One Interpreter is one evaluation's state: variables and comprehension scopes, the step, time
and allocation budgets, printed output. Every operation whose result could pass a limit is
refused before it is computed. Calls go to the builtins it is given (jrl.envs.sandbox.builtins);
run_guarded turns the program's own exceptions into SandboxError."""

from __future__ import annotations

import ast
import itertools
import math
import operator
import time
from typing import Any, Callable, Iterator, Mapping

from jrl.envs.sandbox.check import OPERATOR_SYMBOLS
from jrl.envs.sandbox.limits import (ALLOWED_BUILTINS, ELEMENTS_PER_STEP, WALKED_ELEMENTS_PER_STEP,
                                     SandboxError, SandboxLimitExceeded, SandboxLimits,
                                     SandboxRefused)

_ERROR_CHARS = 200  # an error message quotes at most this much of the program's exception text

# Distinct keys that may share one hash value (see Interpreter.register_key). Natural collisions
# are rare (hash(-1) == hash(-2)); crafted ones would make set and dict operations quadratic.
_MAX_KEYS_PER_HASH = 16

SCALAR_TYPES = frozenset({type(None), bool, int, float, str})
_CONTAINER_TYPES = frozenset({list, tuple, dict, set})
_SEQUENCE_TYPES = frozenset({str, list, tuple})
CONCRETE_ITERABLES = frozenset({list, tuple, dict, set, str, range})


class Generator:
    """The value of a generator expression: consumed lazily by the interpreter only (it has no
    __iter__, so no C-level builtin can drive it past the interpreter's checks)."""

    __slots__ = ("items",)

    def __init__(self, items: Iterator[Any]):
        self.items = items

    def __repr__(self) -> str:
        return "<generator object <genexpr>>"


Generator.__name__ = "generator"  # the type name that error messages show, as in Python


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


def is_int(value: Any) -> bool:
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


class Interpreter:
    """One evaluation's state: variables, the step/time/allocation budgets, printed output."""

    def __init__(self, limits: SandboxLimits,
                 builtins: Mapping[str, Callable[..., Any]]):
        self.limits = limits
        self.builtins = builtins  # name -> function(interpreter, name, args, kwargs)
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
        if type(key) not in SCALAR_TYPES:
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
        if kind in CONCRETE_ITERABLES:
            return iter(value)
        if kind is Generator:
            return value.items
        raise TypeError(f"'{kind.__name__}' object is not iterable")

    def materialize(self, value: Any) -> list[Any]:
        """The items of an iterable value as a new list, paid for and within max_collection_len."""
        kind = type(value)
        if kind in CONCRETE_ITERABLES:
            self.check_len(len(value), f"a list of the items of a {kind.__name__}")
            self.charge_bulk(len(value))
            self.charge_alloc(len(value))
            return list(value)
        if kind is Generator:
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
            raise SandboxRefused(f"{kind.__name__} is not allowed")  # check._check_tree refused it

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
        elif kind is list and op_type is ast.Mult and is_int(value):
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
            # A left-deep chain a + b - c ..., walked in a loop (see check._check_tree).
            chain = [node]
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
        raise SandboxRefused(f"{kind.__name__} is not allowed")  # check._check_tree refused it

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
            if left_kind in _SEQUENCE_TYPES and is_int(right):
                self.check_len(len(left) * max(right, 0), f"a repeated {left_kind.__name__}",
                               _unit(left_kind))
            elif right_kind in _SEQUENCE_TYPES and is_int(left):
                self.check_len(len(right) * max(left, 0), f"a repeated {right_kind.__name__}",
                               _unit(right_kind))
            elif is_int(left) and is_int(right):
                # A product has at least bits(a) + bits(b) - 1 bits.
                self.check_int_bits(left.bit_length() + right.bit_length() - 1)
        elif op is ast.Pow:
            if is_int(left) and is_int(right) and right > 0 and abs(left) > 1:
                # |a| ** b has floor(b * log2|a|) + 1 bits; b alone bounds it from below.
                self.check_int_bits(right)
                self.check_int_bits(int(right * math.log2(abs(left))))
        elif op is ast.LShift:
            if is_int(left) and is_int(right) and left != 0 and right > 0:
                self.check_int_bits(right)
                self.check_int_bits(left.bit_length() + right)
        elif op is ast.Mod:
            if left_kind is str:
                raise SandboxRefused("%-formatting of strings is not allowed")
        elif op in (ast.BitOr, ast.BitXor):
            if left_kind is right_kind and left_kind in (set, dict):
                self.check_len(len(left) + len(right), f"a {left_kind.__name__}")
        if op not in _BINARY_OPERATORS:
            raise SandboxRefused(f"the {OPERATOR_SYMBOLS.get(op, op.__name__)} operator is not "
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
        if kind is Generator:
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
            return Generator(self.eval(node.elt, inner) for inner in scopes)
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
        return self.builtins[name](self, name, args, kwargs)


def run_guarded(function: Callable[[], Any]) -> Any:
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
