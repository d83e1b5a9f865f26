"""Number parsing for data and verifiers: numbers in free text, in one canonical form.

The canonical form is what `normalize_number` returns and what `PromptExample.answer` holds:
no thousands separators, no leading "+", no currency or percent sign, no trailing zeros after
the decimal point, "-0" written "0"; a fraction becomes an integer or decimal when it has one
("4/2" -> "2", "3/4" -> "0.75") and is otherwise reduced ("2/6" -> "1/3").
Two canonical strings denote the same number iff they are equal as strings, so exact-match
grading needs no float arithmetic. Parsing uses regular expressions and `decimal`/`fractions`,
never `eval`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# Minus signs seen in model output and scraped data: ASCII hyphen-minus and U+2212. The en dash is
# left out on purpose: in text it mostly writes ranges ("3\u20135").
_MINUS_CHARS = "-\u2212"

# A number inside free text. The thousands alternative only matches well-formed groups of three
# ("1,234,567"), so a list such as "1,2,3" reads as three numbers, not one. The look-behind keeps
# digits glued to letters ("x2", "CO2") or to a previous decimal point ("1.2.3") out, and keeps a
# minus after a digit ("10-3") as subtraction rather than a negative sign. A sign counts only when
# it touches the digits (or a "$" before them): in "10 - 3" the "-" is an operator.
_NUMBER_IN_TEXT = re.compile(
    r"(?<![\w.])"
    rf"(?P<sign>[{_MINUS_CHARS}+])?\$?"
    r"(?P<integer>\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?P<fraction>\.\d+)?"
)

# A whole string that is a single number after the surrounding noise has been stripped.
_WHOLE_NUMBER = re.compile(
    rf"(?P<sign>[{_MINUS_CHARS}+])?\$?"
    r"(?P<integer>\d{1,3}(?:,\d{3})+|\d+)?"
    r"(?P<fraction>\.\d+)?"
)
_WHOLE_FRACTION = re.compile(rf"(?P<sign>[{_MINUS_CHARS}+])?(?P<num>\d+)\s*/\s*(?P<den>\d+)")


def _canonical(value: Fraction) -> str:
    """Canonical text of an exact rational: integer, terminating decimal, or reduced "n/d"."""
    if value.denominator == 1:
        return str(value.numerator)
    # A reduced fraction has a terminating decimal expansion iff its denominator is 2^a * 5^b;
    # then value = numerator * (10^k / denominator) / 10^k exactly, with k = max(a, b).
    twos = fives = 0
    rest = value.denominator
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * (10**places // value.denominator)
    digits = str(scaled).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}".rstrip("0")
    return ("-" if value.numerator < 0 else "") + text


def _from_parts(sign: str | None, integer: str | None, fraction: str | None) -> str | None:
    if not integer and not fraction:
        return None
    digits = (integer or "0").replace(",", "") + (fraction or "")
    try:
        value = Fraction(Decimal(digits))
    except InvalidOperation:  # the regexes only pass digit strings; kept to fail loudly if not
        raise ValueError(f"internal error: {digits!r} did not parse as a decimal") from None
    if sign and sign in _MINUS_CHARS:
        value = -value
    return _canonical(value)


def normalize_number(text: str) -> str | None:
    """Canonical form of a string that is one number, or None if it is not exactly one number.

    Accepts: surrounding whitespace, a sign ("-", "+", U+2212), "$" before or after the sign,
    thousands commas in groups of three ("1,234"), decimals ("3.50", ".5"), a trailing "%"
    (dropped: "50%" -> "50", since GSM8K-style references store the number a percentage
    question asks for), a trailing sentence period ("72."), and simple fractions ("3/4").
    Rejects everything else ("abc", "", "3 apples", "1,23", "1e5") with None.

    Examples: "1,234" -> "1234"; "-$5.00" -> "-5"; "3.50" -> "3.5"; "007" -> "7"; "-0" -> "0";
    "6/8" -> "0.75"; "2/6" -> "1/3"; "1/0" -> None.
    """
    if not isinstance(text, str):
        raise TypeError(f"normalize_number: text must be a str; got {type(text).__name__}.")
    cleaned = text.strip()
    if cleaned.endswith("."):
        cleaned = cleaned[:-1].rstrip()
    if cleaned.endswith("%"):
        cleaned = cleaned[:-1].rstrip()
    cleaned = cleaned.replace(" ", "")
    if cleaned.startswith("$") and len(cleaned) > 1 and cleaned[1] in _MINUS_CHARS + "+":
        cleaned = cleaned[1] + cleaned[2:]  # "$-5" reads as "-5"
    match = _WHOLE_NUMBER.fullmatch(cleaned)
    if match:
        return _from_parts(match["sign"], match["integer"], match["fraction"])
    match = _WHOLE_FRACTION.fullmatch(cleaned)
    if match:
        denominator = int(match["den"])
        if denominator == 0:
            return None
        value = Fraction(int(match["num"]), denominator)
        if match["sign"] and match["sign"] in _MINUS_CHARS:
            value = -value
        return _canonical(value)
    return None


def numbers_in_text(text: str) -> list[str]:
    """Every number in free text, in order, in canonical form.

    Only integers and decimals are found here ("48/2 = 24" gives ["48", "2", "24"], not a
    fraction), because in running text a slash is usually a division being worked out.
    "$1,234." gives ["1234"]; "10-3" gives ["10", "3"]; "-3" gives ["-3"].
    """
    numbers = []
    for match in _NUMBER_IN_TEXT.finditer(text):
        number = _from_parts(match["sign"], match["integer"], match["fraction"])
        if number is not None:
            numbers.append(number)
    return numbers


def parse_number(text: str) -> Fraction:
    """Exact value of a canonical (or normalisable) number string; ValueError if it is not one."""
    canonical = normalize_number(text)
    if canonical is None:
        raise ValueError(
            f"parse_number: {text!r} is not a number (allowed: integers, decimals, a/b)."
        )
    if "/" in canonical:
        numerator, denominator = canonical.split("/")
        return Fraction(int(numerator), int(denominator))
    return Fraction(Decimal(canonical))


def numbers_equal(a: str | None, b: str | None, *, tol: float = 1e-6) -> bool:
    """Whether two number strings denote the same number.

    Both are normalised first, so "3.50" == "3.5", "1,234" == "1234", "0.5" == "1/2". Values
    compare exactly as rationals; when they differ, they still count as equal if
    |a - b| <= tol (absolute), which forgives a rounded repeating decimal ("0.333333" vs "1/3").
    tol=0 asks for exact equality. None or a non-number on either side gives False.
    """
    if tol < 0:
        raise ValueError(f"numbers_equal: tol={tol!r} is not allowed; it must be >= 0.")
    if a is None or b is None:
        return False
    canonical_a, canonical_b = normalize_number(a), normalize_number(b)
    if canonical_a is None or canonical_b is None:
        return False
    value_a, value_b = parse_number(canonical_a), parse_number(canonical_b)
    if value_a == value_b:
        return True
    return abs(value_a - value_b) <= Fraction(tol)
