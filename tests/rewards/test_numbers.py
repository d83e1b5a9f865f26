import pytest

from jrl.rewards import normalize_number, numbers_equal, numbers_in_text, parse_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72", "72"),
        ("1,234", "1234"),
        ("1,234,567", "1234567"),
        ("-5", "-5"),
        ("\u22125", "-5"),  # U+2212 minus sign
        ("+5", "5"),
        ("-0", "0"),
        ("007", "7"),
        ("3.50", "3.5"),
        ("3.0", "3"),
        (".5", "0.5"),
        ("$1,234.", "1234"),
        ("-$5.00", "-5"),
        ("$-5", "-5"),
        ("50%", "50"),
        (" 18 ", "18"),
        ("6/8", "0.75"),  # one canonical string per value: a terminating fraction is a decimal
        ("-4/2", "-2"),
        ("2/6", "1/3"),
        ("1,234.50", "1234.5"),
    ],
)
def test_normalize_number_canonical_forms(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ", "abc", "3 apples", "1,23", "1e5", "-", "$", "1/0", "1.2.3", "--5"]
)
def test_normalize_number_rejects_non_numbers(text):
    assert normalize_number(text) is None


def test_numbers_in_text_reads_commas_signs_and_sentence_periods():
    assert numbers_in_text("The answer is $1,234.") == ["1234"]
    assert numbers_in_text("48/2 = <<48/2=24>>24") == ["48", "2", "48", "2", "24", "24"]
    # A minus after a digit or separated from the digits by a space is an operator.
    assert numbers_in_text("10-3 and 10 - 3 but -3") == ["10", "3", "10", "3", "-3"]
    assert numbers_in_text("lists 1,2,3 and CO2 and x2") == ["1", "2", "3"]
    assert numbers_in_text("it costs 3.50 dollars") == ["3.5"]


def test_numbers_equal():
    assert numbers_equal("3.50", "3.5")
    assert numbers_equal("1,234", "1234")
    assert numbers_equal("0.5", "1/2")
    assert numbers_equal("0.3333333", "1/3")  # |diff| = 3.3e-8 <= tol 1e-6
    assert not numbers_equal("0.3333333", "1/3", tol=0)
    assert not numbers_equal("72", "73")
    assert not numbers_equal(None, "72")
    assert not numbers_equal("abc", "abc")
    with pytest.raises(ValueError, match="tol=-1"):
        numbers_equal("1", "1", tol=-1)


def test_parse_number_error_names_the_text():
    with pytest.raises(ValueError, match="'abc' is not a number"):
        parse_number("abc")
