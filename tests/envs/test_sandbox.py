import re
import time

import pytest

from jrl.envs import (
    SandboxError,
    SandboxLimitExceeded,
    SandboxLimits,
    SandboxRefused,
    evaluate_arithmetic,
    run_python,
)

# ---------------------------------------------------------------------------------------------
# evaluate_arithmetic


@pytest.mark.parametrize("expression, expected", [
    ("(1+2)*3", 9),                 # 3 * 3
    ("7/2", 3.5),                   # true division gives a float
    ("6/3", 2.0),                   # still a float
    ("7//2", 3),
    ("-7//2", -4),                  # floor of -3.5
    ("7 % 3", 1),
    ("-7 % 3", 2),                  # -7 = 3 * (-3) + 2
    ("2**10", 1024),
    ("2**3**2", 512),               # right-associative: 2 ** 9
    ("2**-1", 0.5),
    ("10-2-3", 5),                  # left-associative: (10 - 2) - 3
    ("100/10/5", 2.0),              # (100 / 10) / 5
    ("-(3 - 5)", 2),
    ("+4", 4),
    ("1.5 * 4", 6.0),
    ("  12 * (3 + 4)  ", 84),       # surrounding space ignored; 12 * 7
    ("1" + "+1" * 999, 1000),       # a long flat chain is not "deep"
])
def test_arithmetic_values(expression, expected):
    value = evaluate_arithmetic(expression)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("expression, fragment", [
    ("x + 1", "names are not allowed"),
    ("abs(-1)", "function calls are not allowed"),
    ("'a' + 'b'", "only numbers"),
    ("True + 1", "only numbers"),
    ("2 ^ 3", "use ** for powers"),
    ("1 < 2", "Compare"),
    ("(1, 2)", "Tuple"),
    ("1 << 3", "<<"),
    ("().__class__", "attribute access is not allowed"),
    ("__import__('os')", "function calls are not allowed"),
])
def test_arithmetic_refuses_everything_else(expression, fragment):
    with pytest.raises(SandboxRefused, match=re.escape(fragment)):
        evaluate_arithmetic(expression)


@pytest.mark.parametrize("expression", ["9**9**9", "10**10**10", "2**4096", "(2**4095) * 2",
                                        "1" * 2000])
def test_arithmetic_limits_refuse_before_computing(expression):
    start = time.monotonic()
    with pytest.raises(SandboxLimitExceeded):
        evaluate_arithmetic(expression)
    assert time.monotonic() - start < 5.0


def test_arithmetic_int_limit_is_exact():
    assert evaluate_arithmetic("2**4095") == 2**4095  # 4096 bits: exactly at the limit


def test_arithmetic_errors_are_sandbox_errors():
    with pytest.raises(SandboxError, match="ZeroDivisionError: division by zero") as caught:
        evaluate_arithmetic("1/0")
    assert type(caught.value) is SandboxError
    with pytest.raises(SandboxError, match="invalid syntax at line 1"):
        evaluate_arithmetic("1 +")
    with pytest.raises(SandboxError, match="invalid syntax"):
        evaluate_arithmetic("")


# ---------------------------------------------------------------------------------------------
# run_python: what is allowed


def test_print_output_and_final_value():
    result = run_python("xs = [i * i for i in range(4)]\nprint(sum(xs))\nxs")
    assert result.output == "14\n"  # 0 + 1 + 4 + 9
    assert result.value == [0, 1, 4, 9]
    assert result.value_repr == "[0, 1, 4, 9]"
    assert not result.output_truncated


def test_no_final_expression_gives_no_value():
    result = run_python("x = 1\nprint(x)")  # last statement is a call whose value is None
    assert result.value is None and result.value_repr is None and result.output == "1\n"
    assert run_python("x = 1").value is None
    assert run_python("").output == ""


@pytest.mark.parametrize("source, expected", [
    ("1 if True else 2", 1),
    ("a, b = 1, 2\na, b = b, a\n(a, b)", (2, 1)),
    ("a, (b, c) = 1, (2, 3)\na + b + c", 6),
    ("a = b = 3\na * b", 9),
    ("x = 5\nx **= 2\nx -= 1\nx //= 5\nx", 4),                       # (25 - 1) // 5
    ("total = 0\nfor i in range(1, 11):\n    total += i\ntotal", 55),   # 1 + ... + 10
    ("n = 0\nwhile n < 100:\n    n += 7\nn", 105),                     # 15 * 7
    ("found = -1\nfor i in range(10):\n    if i * i > 20:\n        found = i\n        break\n"
     "else:\n    found = 99\nfound", 5),                                  # 25 > 20
    ("odd = 0\nfor i in range(10):\n    if i % 2 == 0:\n        continue\n    odd += 1\nodd", 5),
    ("for i in range(3):\n    pass\nelse:\n    i = 'done'\ni", "done"),
    ("[x * y for x in range(3) for y in range(3) if x < y]", [0, 0, 2]),  # (0,1) (0,2) (1,2)
    ("{x % 3 for x in range(10)}", {0, 1, 2}),
    ("{k: k * k for k in range(3)}", {0: 0, 1: 1, 2: 4}),
    ("sum(x * x for x in range(4))", 14),
    ("any(x > 5 for x in range(10**5))", True),          # stops at 6, far below the step limit
    ("all(x < 3 for x in [1, 2, 3])", False),
    ("x = 5\n[x for x in range(3)]\nx", 5),                # comprehension variables do not leak
    ("xs = [1, 2, 3, 4, 5]\nxs[1:3], xs[::-1], xs[-1]", ([2, 3], [5, 4, 3, 2, 1], 5)),
    ("'hello'[1:3] + 'abc'[0]", "ela"),
    ("d = {'a': 1}\nd['b'] = 2\nd['a'] += 5\nd", {"a": 6, "b": 2}),
    ("xs = [1, 2, 3]\nxs[1:2] = [9, 9]\nxs[0] += 1\nxs", [2, 9, 9, 3]),
    ("xs = [1]\nys = xs\nxs += [2]\nys", [1, 2]),        # list += is in place, as in Python
    ("s = {1}\ns |= {2}\ns", {1, 2}),
    ("1 <= 2 < 3 != 4", True),
    ("(1 is None, None is None, 3 not in [1], 'b' in 'abc', 2 in {2: 0})",
     (False, True, True, True, True)),
    ("(True + True, 1 << 10, 1024 >> 3, 5 & 3, 5 | 3, 5 ^ 3, ~5)", (2, 1024, 128, 1, 7, 6, -6)),
    ("(abs(-3), min(4, 2), max([1, 5, 3]), round(2.567, 2), round(2.5), divmod(7, 2))",
     (3, 2, 5, 2.57, 2, (3, 1))),                            # round(2.5) rounds half to even
    ("(pow(2, 10), pow(3, 4, 5), len('abc'), sorted([3, 1, 2], reverse=True))",
     (1024, 1, 3, [3, 2, 1])),                               # 81 % 5 == 1
    ("(int('42') + int(3.9), float('1.5'), str(12), bool(0))", (45, 1.5, "12", False)),
    ("(list('ab'), tuple([1]), set([1, 1]), dict(a=1), dict([(1, 2)]))",
     (["a", "b"], (1,), {1}, {"a": 1}, {1: 2})),
    ("(list(zip([1, 2], 'ab')), list(enumerate('ab', 1)), list(reversed(range(3))))",
     ([(1, "a"), (2, "b")], [(1, "a"), (2, "b")], [2, 1, 0])),
    ("max([], default=7)", 7),
    ("int('ff', 16)", 255),
    ("x = 3.14159\nname = 'pi'\nf'{name}={x:.2f} {x:>8.3f}|'", "pi=3.14    3.142|"),
    ("x = 'a'\nf'{x!r}'", "'a'"),
    ("sum = 0\nfor i in range(4):\n    sum += i\nsum", 6),  # a variable may shadow a builtin
    ("_ = 5\n_ + 1", 6),                                       # `_` alone is an ordinary name
    ("2**4095 > 0", True),
    ("len({-1, -2, 1, 1.0, True})", 3),   # hash(-1) == hash(-2): a natural collision is fine
    ("pairs = [(i, i + 1) for i in range(2000)]\ncount = 0\nfor i in range(200):\n"
     "    if (i, i + 1) in pairs:\n        count += 1\ncount", 200),
    ("x = 1; y = 2; x + y", 3),
])
def test_allowed_programs(source, expected):
    assert run_python(source).value == expected


def test_print_options_and_reprs():
    assert run_python("print('a', 'b', sep='-', end='!')").output == "a-b!"
    assert run_python("print(1, [2, 'x'], None)").output == "1 [2, 'x'] None\n"
    assert run_python("g = (i for i in range(3))\nprint(g)").output == \
        "<generator object <genexpr>>\n"
    assert run_python("'a' * 3").value_repr == "'aaa'"


def test_output_is_truncated_at_the_limit():
    result = run_python("for i in range(100):\n    print(i)", SandboxLimits(max_output_chars=10))
    assert result.output == "0\n1\n2\n3\n4\n"  # 5 lines of 2 characters
    assert result.output_truncated


def test_each_run_starts_without_variables():
    run_python("x = 1")
    with pytest.raises(SandboxError, match="NameError: name 'x' is not defined"):
        run_python("x")


# ---------------------------------------------------------------------------------------------
# run_python: what is refused

ESCAPES = [
    ("__import__('os')", "'__import__'"),
    ("import os", "import is not allowed"),
    ("from os import path", "import is not allowed"),
    ("import os as _", "import is not allowed"),
    ("().__class__.__bases__[0].__subclasses__()", "attribute access is not allowed"),
    ("[c for c in ().__class__.__mro__]", "attribute access is not allowed"),
    ("open('/etc/passwd')", "calling 'open' is not allowed"),
    ("exec('1')", "calling 'exec' is not allowed"),
    ("eval('1')", "calling 'eval' is not allowed"),
    ("getattr(1, 'real')", "calling 'getattr' is not allowed"),
    ("globals()", "calling 'globals' is not allowed"),
    ("vars()", "calling 'vars' is not allowed"),
    ("type(1)", "calling 'type' is not allowed"),
    ("compile('1', '', 'eval')", "calling 'compile' is not allowed"),
    ("breakpoint()", "calling 'breakpoint' is not allowed"),
    ("input()", "calling 'input' is not allowed"),
    ("(lambda: 1)()", "lambda is not allowed"),
    ("f = lambda: 1", "lambda is not allowed"),
    ("'{0.__class__}'.format(1)", "attribute access is not allowed"),
    ("f'{().__class__}'", "attribute access is not allowed"),
    ("x = 1\nf'{x + 1}'", "f-string fields may only be plain names or constants"),
    ("x = 1\nw = 5\nf'{x:{w}}'", "format specs must be constant"),
    ("x = [].append", "attribute access is not allowed"),
    ("x = 1\nx.real", "attribute access is not allowed"),
    ("x = [1]\nx.y = 2", "attribute access is not allowed"),
    ("print.__self__", "attribute access is not allowed"),
    ("__builtins__", "names starting with '_'"),
    ("__x = 1", "names starting with '_'"),
    ("def f(): pass", "function definitions"),
    ("async def f(): pass", "function definitions"),
    ("class A: pass", "class definitions"),
    ("with open('x') as f: pass", "with statements"),
    ("try:\n  1\nexcept: pass", "try statements"),
    ("raise SystemExit", "raise is not allowed"),
    ("assert False", "assert is not allowed"),
    ("x = 1\ndel x", "del is not allowed"),
    ("global x", "global is not allowed"),
    ("nonlocal x", "nonlocal is not allowed"),
    ("yield 1", "yield is not allowed"),
    ("(x := 1)", "assignment expressions"),
    ("print(*[1, 2])", "starred expressions"),
    ("a, *b = [1, 2]", "starred expressions"),
    ("dict(**{'a': 1})", "keyword unpacking"),
    ("{**{'a': 1}}", "unpacking in dict literals"),
    ("x: int = 5", "annotated assignments"),
    ("match 1:\n    case 1:\n        pass", "match statements"),
    ("'%s' % 1", "%-formatting"),
    ("max([3, 1], key=abs)", "may only be called"),
    ("f = print", "may only be called"),
    ("x = 1\nx()", "calling 'x' is not allowed"),
    ("[print][0]('x')", "calling the result of an expression"),
    ("1j", "complex literals"),
    ("b'x'", "bytes literals"),
    ("print('before')\nimport os", "import is not allowed"),  # refused before anything runs
]


@pytest.mark.parametrize("source, fragment", ESCAPES)
def test_escape_attempts_are_refused(source, fragment):
    with pytest.raises(SandboxRefused, match=re.escape(fragment)):
        run_python(source)


def test_undefined_names_and_program_errors_are_sandbox_errors():
    cases = [
        ("y + 1", "NameError: name 'y' is not defined"),
        ("1 / 0", "ZeroDivisionError"),
        ("[1][5]", "IndexError"),
        ("{}['k']", "KeyError: 'k'"),
        ("int('abc')", "ValueError"),
        ("len(5)", "TypeError"),
        ("t = (1, 2)\nt[0] = 5", "TypeError: 'tuple' object does not support item assignment"),
        ("sum = 0\nsum([1])", "TypeError: 'int' object is not callable"),
        ("a, b = [1, 2, 3]", "too many values to unpack"),
        ("print('a', file=None)", "unexpected keyword argument 'file'"),
        ("set([[1]])", "unhashable type: 'list'"),
        ("x = [0]\nx[0] = x\nx == x", "contains itself"),
        ("break", "invalid syntax at line 1: 'break' outside loop"),
        ("for i in [1]:\n    pass\nelse:\n    continue", "'continue' outside loop"),
        ("x = (", "invalid syntax at line 1"),
        ("if True:\nprint(1)", "invalid syntax at line 2"),
    ]
    for source, fragment in cases:
        with pytest.raises(SandboxError, match=re.escape(fragment)):
            run_python(source)


# ---------------------------------------------------------------------------------------------
# run_python: limits

LIMIT_CASES = [
    ("9**9**9", "387420489 bits"),                          # 9 ** 9 = 387420489
    ("10**10**10", "bits"),
    ("x = 2**4095\nx * x", "bits"),
    ("1 << 10**6", "bits"),
    ("pow(10, 10**6)", "bits"),
    ("round(5, -10**6)", "ndigits"),
    ("int('9' * 5000)", "int()"),
    ("'a' * 10**9", "a repeated str would have 1000000000 characters"),
    ("[0] * 10**9", "a repeated list would have 1000000000 items"),
    ("list(range(10**12))", "a range would have 1000000000000 items"),
    ("s = 'a' * 100000\ns + 'b'", "100001 characters"),
    ("sum([[0] * 100000] * 100, [])", "a list would have 200000 items"),
    ("xs = []\nwhile True:\n    xs += [1]", "a list would have 100001 items"),
    ("xs = [[0] * 100000 for _ in range(100)]", "memory limit"),  # 100 * 100000 > 5000000
    ("while True: pass", "step limit"),
    ("x = 0\nwhile True:\n    x += 1", "step limit"),
    # Values built by sharing: exponentially larger than the steps that built them.
    ("x = [0]\nfor i in range(100):\n    x = [x, x]\nprint(x)", "nested more than 50"),
    ("x = (0,)\nfor i in range(100):\n    x = (x, x)\ns = {x}", "nested more than 50"),
    ("x = [0] * 1000\ny = [x] * 1000\nz = [y] * 1000\nprint(z)", "step limit"),  # 10**9 items
    ("x = [0] * 1000\ny = [x] * 1000\nz = [y] * 1000\nz == [y] * 1000", "step limit"),
    ("x = 1\nf'{x:>100000}'", "format width"),
    # Hash flooding: i * (2**61 - 1) all hash to 0; a set of n of them costs n**2 / 2 comparisons
    # inside one C call.
    ("P = 2**61 - 1\ns = set([i * P for i in range(100000)])", "share one hash value"),
    ("P = 2**61 - 1\nd = {}\nfor i in range(1000):\n    d[i * P] = i", "share one hash value"),
]


@pytest.mark.parametrize("source, fragment", LIMIT_CASES)
def test_limits_stop_programs_quickly(source, fragment):
    # Each case must hit its own limit, not the 1 s wall clock, however loaded the machine is
    # (two test workers compiling beside it made 10**6 steps take over 1 s).
    limits = SandboxLimits() if "time limit" in fragment else SandboxLimits(timeout_s=60.0)
    start = time.monotonic()
    with pytest.raises(SandboxLimitExceeded, match=re.escape(fragment)):
        run_python(source, limits)
    # A runaway bound, not a speed figure: 10**9 items of work would take minutes.
    assert time.monotonic() - start < 30.0


def test_deeply_nested_source_is_refused_before_parsing():
    nested = "(" * 10000 + "1" + ")" * 10000
    with pytest.raises(SandboxLimitExceeded, match="the source is 20001 characters long"):
        run_python(nested)
    with pytest.raises(SandboxLimitExceeded, match="brackets are nested 10000 deep"):
        run_python(nested, SandboxLimits(max_source_chars=100_000))
    # With the bracket check off, the parser's own failure is still a SandboxError.
    with pytest.raises(SandboxError):
        run_python(nested, SandboxLimits(max_source_chars=100_000, max_nesting_depth=100_000))
    with pytest.raises(SandboxLimitExceeded, match="nested more than 100 levels"):
        run_python("-" * 150 + "1")  # unary minus nests without brackets
    with pytest.raises(SandboxLimitExceeded, match="syntax nodes"):
        run_python("x = 1\n" * 10, SandboxLimits(max_ast_nodes=20))


def test_time_limit():
    limits = SandboxLimits(timeout_s=0.05, max_steps=10**9)
    start = time.monotonic()
    with pytest.raises(SandboxLimitExceeded, match="time limit exceeded"):
        run_python("while True:\n    pass", limits)
    assert time.monotonic() - start < 2.0


def test_small_limits_apply():
    with pytest.raises(SandboxLimitExceeded, match="more than 100 steps"):
        run_python("for i in range(1000):\n    pass", SandboxLimits(max_steps=100))
    with pytest.raises(SandboxLimitExceeded, match="a range would have 11 items"):
        run_python("range(11)", SandboxLimits(max_collection_len=10))
    with pytest.raises(SandboxLimitExceeded, match="memory limit"):
        # s += 'ab' copies s each time: 2 + 4 + ... + 200 = 10100 characters made.
        run_python("s = ''\nfor i in range(100):\n    s += 'ab'",
                   SandboxLimits(max_total_alloc=1000))
    with pytest.raises(SandboxLimitExceeded, match="17 bits"):
        run_python("2 ** 16", SandboxLimits(max_int_bits=16))  # 65536 needs 17 bits


@pytest.mark.parametrize("field, value", [
    ("max_steps", 0), ("max_steps", 1.5), ("max_int_bits", True), ("timeout_s", 0),
    ("timeout_s", float("inf")),
])
def test_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=f"SandboxLimits: {field}="):
        SandboxLimits(**{field: value})
