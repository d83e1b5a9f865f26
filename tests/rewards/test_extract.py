import pytest

from jrl.rewards import extract_answer

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
    "#### 72"
)


@pytest.mark.parametrize("mode", ["hash", "last_number", "auto"])
def test_gsm8k_reference_answer(mode):
    assert extract_answer(GSM8K_ANSWER, mode=mode) == "72"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so #### 1,234", "1234"),
        ("#### -5", "-5"),
        ("#### 3.50.", "3.5"),
        ("#### $18", "18"),
        ("#### 72 clips", "72"),
        ("#### 7\nsome trailing chatter 99", "7"),
        ("#### 1\n#### 2", "2"),  # the last marker wins
        ("#### ", None),
        ("####", None),
        ("#### abc", None),
        ("#### 3 + 4 = 7", None),  # several numbers: no single final answer
    ],
)
def test_hash_mode(text, expected):
    assert extract_answer(text, mode="hash") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{-7}", "-7"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac{2}{6}}", "1/3"),
        ("\\boxed{1{,}234}", "1234"),
        ("\\boxed{\\$18.00}", "18"),
        ("\\boxed{72 \\text{ clips}}", "72"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{{12}}", "12"),  # nested braces balance
        ("\\boxed{12", None),  # never closed
        ("\\boxed{}", None),
        ("\\boxed{abc}", None),
        ("no box 5", None),
    ],
)
def test_boxed_mode(text, expected):
    assert extract_answer(text, mode="boxed") == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $1,234.", "1234"),
        ("It is -3 degrees.", "-3"),
        ("Each costs 3.50 so", "3.5"),
        ("no number at all", None),
        ("", None),
    ],
)
def test_last_number_mode(text, expected):
    assert extract_answer(text, mode="last_number") == expected


def test_auto_mode_uses_the_first_marker_present():
    assert extract_answer("I think 5. \\boxed{6}", mode="auto") == "6"
    assert extract_answer("\\boxed{6} #### 7", mode="auto") == "7"
    assert extract_answer("The answer is $1,234.", mode="auto") == "1234"
    # A malformed "####" answer is not rescued by a number from the working.
    assert extract_answer("3 + 4 = 7\n#### abc", mode="auto") is None
    assert extract_answer("3 + 4 = 7\n#### ", mode="auto") is None


def test_unknown_mode_names_the_allowed_modes():
    with pytest.raises(ValueError, match=r"mode='last'.*'hash', 'boxed', 'last_number', 'auto'"):
        extract_answer("5", mode="last")


def test_non_string_text():
    with pytest.raises(TypeError, match="text must be a str"):
        extract_answer(5, mode="auto")
