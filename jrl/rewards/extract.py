"""Final-answer extraction from response text (GSM8K "####", LaTeX \\boxed{}, last number)."""

from __future__ import annotations

import re

from jrl.data.numbers import normalize_number, numbers_in_text

EXTRACT_MODES = ("hash", "boxed", "last_number", "auto")

HASH_MARKER = "####"
_BOXED_OPENERS = ("\\boxed{", "\\fbox{")

# LaTeX that wraps or decorates a number inside \boxed{}: removed before the number is read.
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*\}")
_LATEX_NOISE = (
    "\\$",
    "\\%",
    "\\!",
    "\\,",
    "\\;",
    "\\ ",
    "{,}",
    "^\\circ",
    "^{\\circ}",
    "\\left",
    "\\right",
)


def _number_in_answer_span(span: str) -> str | None:
    """The number a final-answer span states, or None when it states none or several.

    A span that is exactly one number ("1,234", "$5.", "3/4") gives it. Otherwise the span may
    wrap one number in words ("72 clips", "The answer is 72"); a span with two or more numbers
    ("3 + 4 = 7", "5 or 6") gives None, because picking one would reward answers that hedge.
    """
    whole = normalize_number(span)
    if whole is not None:
        return whole
    numbers = numbers_in_text(span)
    return numbers[0] if len(numbers) == 1 else None


def extract_hash(text: str) -> str | None:
    """The number after the last "####", up to the end of that line; None if absent or malformed."""
    position = text.rfind(HASH_MARKER)
    if position < 0:
        return None
    span = text[position + len(HASH_MARKER) :].lstrip(" \t#").split("\n", 1)[0]
    return _number_in_answer_span(span)


def _last_boxed_content(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (braces balanced); None if none is closed."""
    start = max(text.rfind(opener) for opener in _BOXED_OPENERS)
    if start < 0:
        return None
    opener = next(o for o in _BOXED_OPENERS if text.startswith(o, start))
    depth = 1
    content_start = start + len(opener)
    for offset in range(content_start, len(text)):
        character = text[offset]
        if character == "{":
            depth += 1
        elif character == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:offset]
    return None


def extract_boxed(text: str) -> str | None:
    """The number in the last \\boxed{...}; None without a closed box or a single number in it.

    Handles \\frac{a}{b} (and \\dfrac, \\tfrac), read as a/b; \\$ and \\%; thousands written
    "1{,}234"; units in \\text{...} ("\\boxed{72 \\text{ clips}}" -> "72").
    """
    content = _last_boxed_content(text)
    if content is None:
        return None
    content = _LATEX_TEXT.sub(" ", content)
    content = _LATEX_FRACTION.sub(r"\1/\2", content)
    for noise in _LATEX_NOISE:
        content = content.replace(noise, "," if noise == "{,}" else "")
    return _number_in_answer_span(content.strip())


def extract_last_number(text: str) -> str | None:
    """The last integer or decimal in the text (commas, signs, "$" handled); None if none."""
    numbers = numbers_in_text(text)
    return numbers[-1] if numbers else None


def extract_answer(text: str, *, mode: str = "auto") -> str | None:
    """The final answer stated in `text`, in canonical number form (jrl.data.numbers), or None.

    Modes:
      hash:        the number after the last "####" (GSM8K's format).
      boxed:       the number in the last \\boxed{...}, braces balanced.
      last_number: the last number anywhere in the text.
      auto:        the first of these markers that the text contains decides: "####" -> hash,
                   else "\\boxed" -> boxed, else last_number. A response that writes "####" but
                   no valid number after it gets None, not its last intermediate number: a
                   malformed final answer must not be rescued by a number from the working.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer: text must be a str; got {type(text).__name__}.")
    if mode == "hash":
        return extract_hash(text)
    if mode == "boxed":
        return extract_boxed(text)
    if mode == "last_number":
        return extract_last_number(text)
    if mode == "auto":
        if HASH_MARKER in text:
            return extract_hash(text)
        if any(opener in text for opener in _BOXED_OPENERS):
            return extract_boxed(text)
        return extract_last_number(text)
    raise ValueError(
        f"extract_answer: mode={mode!r} is not allowed; allowed modes: {EXTRACT_MODES}."
    )
