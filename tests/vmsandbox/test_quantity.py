"""Tests of vmsandbox.quantity: Kubernetes resource.Quantity parsing and canonical form.

The expected values and canonical strings in the tables are facts taken from the upstream
k8s.io/apimachinery pkg/api/resource tests (TestQuantityParse, TestQuantityString,
TestQuantityParseEmit), restricted to the magnitudes this module accepts, plus the cases where we
are deliberately stricter (documented in the module docstring).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmsandbox.errors import InvalidArgument
from vmsandbox.quantity import (
    MAX_ABS_VALUE,
    Format,
    Quantity,
    QuantityError,
    format_quantity,
    parse_nonnegative_quantity,
    parse_quantity,
)

F = Fraction
KI, MI, GI, TI, PI, EI = (1024**k for k in range(1, 7))
NANO = F(1, 10**9)
MAX_NANOS = (2**63 - 1) * 10**6
FORMATS: tuple[Format, ...] = ("DecimalSI", "BinarySI", "DecimalExponent")


def case(*values: object, id: str | None = None) -> object:
    return pytest.param(*values, id=id if id is not None else str(values[0]))


# --- parsing: exact value and format ------------------------------------------------------------

PARSE_CASES = [
    # zero in every suffix keeps the suffix's format
    case("0", F(0), "DecimalSI"),
    case("0n", F(0), "DecimalSI"),
    case("0m", F(0), "DecimalSI"),
    case("0Ki", F(0), "BinarySI"),
    case("0Gi", F(0), "BinarySI"),
    case("0T", F(0), "DecimalSI"),
    case("00", F(0), "DecimalSI"),
    case("-0", F(0), "DecimalSI"),
    case("0e999999999", F(0), "DecimalExponent"),
    # plain and binary
    case("1", F(1), "DecimalSI"),
    case("1Ki", F(KI), "BinarySI"),
    case("8Ki", F(8 * KI), "BinarySI"),
    case("7Mi", F(7 * MI), "BinarySI"),
    case("6Gi", F(6 * GI), "BinarySI"),
    case("5Ti", F(5 * TI), "BinarySI"),
    case("4Pi", F(4 * PI), "BinarySI"),
    case("100Ti", F(100 * TI), "BinarySI"),
    # decimal SI
    case("5n", F(5, 10**9), "DecimalSI"),
    case("4u", F(4, 10**6), "DecimalSI"),
    case("3m", F(3, 1000), "DecimalSI"),
    case("8k", F(8000), "DecimalSI"),
    case("50k", F(50000), "DecimalSI"),
    case("7M", F(7 * 10**6), "DecimalSI"),
    case("6G", F(6 * 10**9), "DecimalSI"),
    case("300T", F(3 * 10**14), "DecimalSI"),
    case("2P", F(2 * 10**15), "DecimalSI"),
    # exponents
    case("1E-3", F(1, 1000), "DecimalExponent"),
    case("1e3", F(1000), "DecimalExponent"),
    case("1E6", F(10**6), "DecimalExponent"),
    case("1e15", F(10**15), "DecimalExponent"),
    case("1e+3", F(1000), "DecimalExponent"),
    case("1e003", F(1000), "DecimalExponent"),
    case("1.2e3", F(1200), "DecimalExponent"),
    case("1.3E+6", F(1_300_000), "DecimalExponent"),
    case("1.53E12", F(153 * 10**10), "DecimalExponent"),
    case("1.5e-3", F(15, 10**4), "DecimalExponent"),
    case("0.5e0", F(1, 2), "DecimalExponent"),
    case("0.5e-2", F(5, 1000), "DecimalExponent"),
    case(".001e12", F(10**9), "DecimalExponent"),
    # things that look like floating point
    case("0.001", F(1, 1000), "DecimalSI"),
    case("0.0005k", F(1, 2), "DecimalSI"),
    case("0.00050k", F(1, 2), "DecimalSI"),
    case("0.50000", F(1, 2), "DecimalSI"),
    case("100.035k", F(100035), "DecimalSI"),
    case("10.035M", F(10_035_000), "DecimalSI"),
    case("9.01", F(901, 100), "DecimalSI"),
    case("7.123456M", F(7123456), "DecimalSI"),
    case("6.987654321G", F(6987654321), "DecimalSI"),
    case("5.444T", F(5444 * 10**9), "DecimalSI"),
    case("2.5P", F(25 * 10**14), "DecimalSI"),
    # finer than a nano: rounded away from zero to the next nano, as upstream
    case("3.001n", F(4, 10**9), "DecimalSI"),
    case("1.1E-9", F(2, 10**9), "DecimalExponent"),
    case("0.0000000001", NANO, "DecimalSI"),
    case("0.0000000005", NANO, "DecimalSI"),
    case("0.00000000050", NANO, "DecimalSI"),
    case("0.5e-9", NANO, "DecimalExponent"),
    case("0.9n", NANO, "DecimalSI"),
    case("0.00000012345", F(124, 10**9), "DecimalSI"),
    case("0.00000012354", F(124, 10**9), "DecimalSI"),
    case("1.0000000001", 1 + NANO, "DecimalSI"),
    case("1e-999999999", NANO, "DecimalExponent"),
    case("-0.1n", -NANO, "DecimalSI"),
    # fractional binary
    case("100.035Ki", F(10243584, 100), "BinarySI"),
    case("0.5Mi", F(MI // 2), "BinarySI"),
    case("0.05Gi", F(536870912, 10), "BinarySI"),
    case("0.025Ti", F(274877906944, 10), "BinarySI"),
    case("1.5Gi", F(3 * GI // 2), "BinarySI"),
    # a non-zero binary quantity below one becomes DecimalSI
    case("0.000000000001Ki", F(2, 10**9), "DecimalSI"),
    case(".001Ki", F(1024, 1000), "BinarySI"),  # 1.024: not below one
    # odd but valid spellings
    case(".001", F(1, 1000), "DecimalSI"),
    case(".0001k", F(1, 10), "DecimalSI"),
    case("1.", F(1), "DecimalSI"),
    case("1.G", F(10**9), "DecimalSI"),
    case("+1", F(1), "DecimalSI"),
    case("+.5", F(1, 2), "DecimalSI"),
    case("-.5", F(-1, 2), "DecimalSI"),
    case("007", F(7), "DecimalSI"),
    # negatives parse
    case("-1", F(-1), "DecimalSI"),
    case("-1.025Ti", -F(1025 * TI, 1000), "BinarySI"),
    case("-100m", F(-1, 10), "DecimalSI"),
    case("-1e3", F(-1000), "DecimalExponent"),
    # the bound itself is accepted, in either sign
    case("9223372036854775807m", MAX_ABS_VALUE, "DecimalSI"),
    case("-9223372036854775.807", -MAX_ABS_VALUE, "DecimalSI"),
    case("8191Ti", F(8191 * TI), "BinarySI"),
    case("8Pi", F(8 * PI), "BinarySI"),
    case("8388Ti", F(8388 * TI), "BinarySI"),
]


@pytest.mark.parametrize(("text", "value", "fmt"), PARSE_CASES)
def test_parse_value_and_format(text: str, value: Fraction, fmt: str) -> None:
    quantity = parse_quantity(text)
    assert quantity.value == value
    assert isinstance(quantity.value, Fraction)
    assert quantity.format == fmt


# --- canonical strings ----------------------------------------------------------------------------

CANONICAL_CASES = [
    # the brief's examples, checked against upstream's rules
    case("1000m", "1"),
    case("1536Mi", "1536Mi"),
    case("1.5Gi", "1536Mi"),
    case("0.5", "500m"),
    case("1e3", "1e3"),
    case("1000", "1k"),
    # upstream TestQuantityString alternates -> canonical
    case("1024Mi", "1Gi"),
    case("307200Ki", "300Mi"),
    case("1025024Mi", "1001Gi"),
    case("1024Gi", "1Ti"),
    case("5000m", "5"),
    case("1000M", "1G"),
    case("0.001T", "1G"),
    case("1000u", "1m"),
    case("1.08", "1080m"),
    case("1080000000n", "1080m"),
    case(".001e12", "1e9"),
    case("0.001e0", "1e-3"),
    case("1000e-12", "1e-9"),
    case("00", "0"),
    # upstream TestQuantityParseEmit
    case("1Ki", "1Ki"),
    case("1Mi", "1Mi"),
    case("1Gi", "1Gi"),
    case(".001Ki", "1024m"),
    case(".000001Ki", "1024u"),
    case(".000000001Ki", "1024n"),
    case(".000000000001Ki", "2n"),
    case("-1Ki", "-1Ki"),
    case("-1024Mi", "-1Gi"),
    case("-.001Ki", "-1024m"),
    case("-.000000000001Ki", "-2n"),
    # canonical strings parse back to themselves
    case("1G", "1G"),
    case("300M", "300M"),
    case("1234567M", "1234567M"),
    case("3k", "3k"),
    case("80m", "80m"),
    case("1n", "1n"),
    case("1080n", "1080n"),
    case("80u", "80u"),
    case("1e9", "1e9"),
    case("80e-3", "80e-3"),
    case("300e6", "300e6"),
    case("3e3", "3e3"),
    case("1P", "1P"),
    # binary below 1Ki or not whole bytes prints as decimal
    case("1.5Ki", "1536"),
    case("0.5Ki", "512"),
    case("1025", "1025"),
    case("100.035Ki", "102435840m"),
    case("1.5Mi", "1536Ki"),
    case("0.0009765625Ki", "1"),
    # zero never keeps a suffix or a sign
    case("0Ki", "0"),
    case("-0", "0"),
    case("0e5", "0"),
    # misc
    case("1.5", "1500m"),
    case("-9.01", "-9010m"),
    case("0.1", "100m"),
    case("2.5P", "2500T"),
    case("129M", "129M"),
    case("1e0", "1"),
    case("1.5e-3", "1500e-6"),
    case("12e2", "1200"),
    case("12e1", "120"),
    case("10e2", "1e3"),
]


@pytest.mark.parametrize(("text", "expected"), CANONICAL_CASES)
def test_canonical(text: str, expected: str) -> None:
    quantity = parse_quantity(text)
    assert quantity.canonical() == expected
    assert str(quantity) == expected
    again = parse_quantity(expected)
    assert again == quantity
    assert again.canonical() == expected


# format_quantity works on any terminating decimal, beyond the bounds a Quantity enforces.
FORMAT_CASES = [
    # upstream TestQuantityString
    case(GI, "BinarySI", "1Gi", id="1Gi"),
    case(300 * MI, "BinarySI", "300Mi", id="300Mi"),
    case(6 * KI, "BinarySI", "6Ki", id="6Ki"),
    case(1001 * GI, "BinarySI", "1001Gi", id="1001Gi"),
    case(TI, "BinarySI", "1Ti", id="1Ti"),
    case(5, "BinarySI", "5", id="binary-5"),
    case(F(1, 2), "BinarySI", "500m", id="binary-half"),
    case(10**9, "DecimalSI", "1G", id="1G"),
    case(F(1, 1000), "DecimalSI", "1m", id="1m"),
    case(F(108, 100), "DecimalSI", "1080m", id="1080m"),
    case(3 * 10**8, "DecimalSI", "300M", id="300M"),
    case(10**18, "DecimalSI", "1E", id="1E"),
    case(10**21, "DecimalSI", "1e21", id="1e21-beyond-E"),
    case(5 * 10**21, "DecimalSI", "5e21", id="5e21-beyond-E"),
    case(10**24, "DecimalSI", "1e24", id="1e24-beyond-E"),
    case(F(1234567, 1000), "BinarySI", "1234567m", id="binary-1234567m"),
    case(1025, "BinarySI", "1025", id="1025"),
    case(0, "DecimalSI", "0", id="zero-decimal"),
    case(0, "BinarySI", "0", id="zero-binary"),
    case(0, "DecimalExponent", "0", id="zero-exponent"),
    case(10**9, "DecimalExponent", "1e9", id="1e9"),
    case(F(1, 1000), "DecimalExponent", "1e-3", id="1e-3"),
    case(F(1, 10**9), "DecimalExponent", "1e-9", id="1e-9"),
    case(F(8, 100), "DecimalExponent", "80e-3", id="80e-3"),
    case(3 * 10**8, "DecimalExponent", "300e6", id="300e6"),
    case(3000, "DecimalExponent", "3e3", id="3e3"),
    case(F(108, 10**8), "DecimalSI", "1080n", id="1080n"),
    case(F(1080, 10**6), "DecimalSI", "1080u", id="1080u"),
    # beyond upstream's table
    case(3 * EI, "BinarySI", "3Ei", id="3Ei"),
    case(2**70, "BinarySI", "1024Ei", id="binary-beyond-Ei"),
    case(F(1, 10**12), "DecimalSI", "1e-12", id="below-n"),
    case(F(-1, 8), "DecimalSI", "-125m", id="negative-eighth"),
    case(-3 * MI, "BinarySI", "-3Mi", id="negative-binary"),
    case(-1023, "BinarySI", "-1023", id="negative-binary-below-1Ki"),
    case(MAX_ABS_VALUE, "DecimalSI", "9223372036854775807m", id="max"),
]


@pytest.mark.parametrize(("value", "fmt", "expected"), FORMAT_CASES)
def test_format_quantity(value: Fraction | int, fmt: Format, expected: str) -> None:
    assert format_quantity(value, fmt) == expected
    if value != 0:
        negated = format_quantity(-value, fmt)
        assert negated == (expected[1:] if expected.startswith("-") else "-" + expected)


@pytest.mark.parametrize(
    "value",
    [F(1, 3), F(1, 7), F(2, 3), F(1, 1024 * 3)],
    ids=str,
)
def test_format_quantity_rejects_non_terminating_decimals(value: Fraction) -> None:
    with pytest.raises(QuantityError, match="no exact decimal"):
        format_quantity(value, "DecimalSI")


def test_format_quantity_rejects_bad_arguments() -> None:
    with pytest.raises(QuantityError, match="format"):
        format_quantity(1, "Decimal")  # type: ignore[arg-type]
    with pytest.raises(QuantityError, match="float"):
        format_quantity(1.5, "DecimalSI")  # type: ignore[arg-type]
    with pytest.raises(QuantityError, match="bool"):
        format_quantity(True, "DecimalSI")


# --- equality, hashing and ordering by value ----------------------------------------------------

EQUAL_CASES = [
    case("1000m", "1"),
    case("1Gi", "1073741824"),
    case("1Gi", "1024Mi"),
    case("1k", "1e3"),
    case("1k", "1000"),
    case("0.5", "500m"),
    case("500m", "5e-1"),
    case("1.5Gi", "1536Mi"),
    case("1.5Ki", "1536"),
    case("0", "0Ki"),
    case("0", "-0"),
    case("1M", "1000k"),
    case("1m", "1000000n"),
    case("1E-3", "1m"),
    case(".000000001Ki", "1024n"),
    case("0.9n", "1n"),
]


@pytest.mark.parametrize(("left", "right"), EQUAL_CASES)
def test_equal_across_forms(left: str, right: str) -> None:
    a, b = parse_quantity(left), parse_quantity(right)
    assert a == b
    assert hash(a) == hash(b)
    assert not a < b
    assert not a > b
    assert a <= b
    assert a >= b
    assert len({a, b}) == 1


ORDER_CASES = [
    case("100m", "50m", 1),
    case("50m", "100m", -1),
    case("1000T", "100Gi", 1),
    case("1Ki", "1k", 1),
    case("1Mi", "1M", 1),
    case("999m", "1", -1),
    case("-1", "0", -1),
    case("1n", "0", 1),
    case("1e3", "1Ki", -1),
]


@pytest.mark.parametrize(("left", "right", "sign"), ORDER_CASES)
def test_ordering(left: str, right: str, sign: int) -> None:
    a, b = parse_quantity(left), parse_quantity(right)
    assert (a > b) == (sign > 0)
    assert (a < b) == (sign < 0)
    assert (a == b) == (sign == 0)
    assert (a >= b) == (sign >= 0)
    assert (a <= b) == (sign <= 0)


def test_quantity_is_not_equal_to_other_types() -> None:
    one = parse_quantity("1")
    assert one != 1
    assert one != "1"
    with pytest.raises(TypeError):
        _ = one < 1


def test_quantity_is_frozen() -> None:
    quantity = parse_quantity("1")
    with pytest.raises(AttributeError):
        quantity.value = F(2)  # type: ignore[misc]


# --- milli_value and value_int --------------------------------------------------------------------

ROUNDING_CASES = [
    case("1", 1000, 1),
    case("1.5", 1500, 2),
    case("100m", 100, 1),
    case("1n", 1, 1),
    case("1u", 1, 1),
    case("1001u", 2, 1),
    case("1Ki", 1024000, 1024),
    case("0", 0, 0),
    case("-1.5", -1500, -1),
    case("-1n", 0, 0),
    case("-1001u", -1, 0),
    case("-1.001", -1001, -1),
    case("9223372036854775807m", 2**63 - 1, 9223372036854776),
    case("-9223372036854775807m", -(2**63 - 1), -9223372036854775),
]


@pytest.mark.parametrize(("text", "milli", "whole"), ROUNDING_CASES)
def test_milli_value_and_value_int_are_ceilings(text: str, milli: int, whole: int) -> None:
    quantity = parse_quantity(text)
    assert quantity.milli_value() == milli
    assert quantity.value_int() == whole


# --- invalid strings -------------------------------------------------------------------------------

INVALID_CASES = [
    case("", "empty", id="empty"),
    case(" 1", "whitespace", id="leading-space"),
    case("1 ", "whitespace", id="trailing-space"),
    case("1 Gi", "whitespace"),
    case("\t1", "whitespace", id="tab"),
    case("1\n", "whitespace", id="newline"),
    case("1\u00a0Gi", "whitespace", id="nbsp"),
    case("NaN", "no digits"),
    case("Inf", "no digits"),
    case("-Inf", "no digits"),
    case("aoeu", "no digits"),
    case(".", "no digits"),
    case("-", "no digits"),
    case("+", "no digits"),
    case("-.", "no digits"),
    case("Ki", "no digits"),
    case("m", "no digits"),
    case("e3", "no digits"),
    case("1.2.3", "malformed number"),
    case("1.1.M", "malformed number"),
    case("--1", "malformed number"),
    case("+-1", "malformed number"),
    case("1+1.0M", "malformed number"),
    case("1-", "malformed number"),
    case("1..", "malformed number"),
    case("1Kb", "unknown suffix"),
    case("0x10", "unknown suffix"),
    case("0.1mi", "unknown suffix"),
    case("0.1am", "unknown suffix"),
    case(".5i", "unknown suffix"),
    case("1i", "unknown suffix"),
    case("-3.01i", "unknown suffix"),
    case("1K", "unknown suffix"),
    case("1ki", "unknown suffix"),
    case("1KI", "unknown suffix"),
    case("1KiB", "unknown suffix"),
    case("1Gb", "unknown suffix"),
    case("1kk", "unknown suffix"),
    case("1e", "unknown suffix"),
    case("1E+", "unknown suffix"),
    case("-3.01e-", "unknown suffix"),
    case("1e3.5", "unknown suffix"),
    case("1e1e1", "unknown suffix"),
    case("1ee3", "unknown suffix"),
    case("1e1_0", "unknown suffix"),
    case("1_000", "unknown suffix"),
    case("1,5", "unknown suffix"),
    case("1\u0663", "unknown suffix", id="arabic-indic-digit"),
    case("\u0661", "no digits", id="arabic-indic-only"),
    case("1e\u0663", "unknown suffix", id="exponent-non-ascii-digit"),
    case("1e2147483648", "exponent out of range"),
    case("1e-2147483648", "exponent out of range"),
    case("0e99999999999999999999", "exponent out of range"),
]


@pytest.mark.parametrize(("text", "reason"), INVALID_CASES)
def test_invalid_strings(text: str, reason: str) -> None:
    with pytest.raises(QuantityError) as caught:
        parse_quantity(text)
    message = str(caught.value)
    assert message.startswith(f"invalid quantity {json.dumps(text)}: ")
    assert reason in message
    assert isinstance(caught.value, InvalidArgument)


# Valid upstream but above our bound: the milli-value must fit an int64.
TOO_LARGE_CASES = [
    "1e30",
    "10E27",
    "1E",
    "12E",
    "1.01E",
    "1E18",
    "1.7E18",
    "3Ei",
    "8Ei",
    "9Ei",
    "9223372036854775807Ki",
    "8389Ti",
    "9Pi",
    "9223372036854775.808",
    "-9223372036854775.808",
    "10000000000000000",
    "1e16",
    "1e999999999",
    "1e2147483647",
    "-1e2147483647",
    "18446744073709551616",
    "0.00000001e30",
]


@pytest.mark.parametrize("text", TOO_LARGE_CASES)
def test_too_large(text: str) -> None:
    with pytest.raises(QuantityError) as caught:
        parse_quantity(text)
    message = str(caught.value)
    assert json.dumps(text) in message
    assert "too large" in message


def test_long_strings_are_parsed_without_giant_integers() -> None:
    # More digits than int() converts by default, far below the nano or balanced by the exponent.
    assert parse_quantity("0." + "0" * 100_000 + "1").value == NANO
    assert parse_quantity("1" + "0" * 100_000 + "e-100000").value == 1
    assert parse_quantity("9" * 10_000 + "e-9990").value == 10**10
    assert parse_quantity("1e-2147483647").value == NANO
    assert parse_quantity("0" * 10_000 + "1").value == 1
    with pytest.raises(QuantityError, match="too large"):
        parse_quantity("1" * 100_000)


def test_long_strings_are_shortened_in_messages() -> None:
    text = "1" + "x" * 10_000
    with pytest.raises(QuantityError) as caught:
        parse_quantity(text)
    assert len(str(caught.value)) < 500
    assert json.dumps(text[:64] + "...") in str(caught.value)


def test_non_string_is_rejected() -> None:
    with pytest.raises(QuantityError, match="string"):
        parse_quantity(5)  # type: ignore[arg-type]


# --- non-negative parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["-1", "-1n", "-0.5Gi", "-1e3", "-.1n"])
def test_nonnegative_rejects_negatives(text: str) -> None:
    with pytest.raises(QuantityError) as caught:
        parse_nonnegative_quantity(text)
    assert json.dumps(text) in str(caught.value)
    assert "negative" in str(caught.value)
    # the plain parser accepts the same string
    assert parse_quantity(text).value < 0


@pytest.mark.parametrize("text", ["0", "-0", "-0Gi", "1", "500m", "2Gi", "+1"])
def test_nonnegative_accepts_zero_and_positive(text: str) -> None:
    assert parse_nonnegative_quantity(text) == parse_quantity(text)


def test_nonnegative_still_reports_syntax_errors() -> None:
    with pytest.raises(QuantityError, match="malformed number"):
        parse_nonnegative_quantity("--1")


# --- the constructor's invariants -------------------------------------------------------------------


def test_constructor_accepts_int_and_defaults_to_decimal() -> None:
    quantity = Quantity(3)  # type: ignore[arg-type]
    assert quantity.value == 3
    assert isinstance(quantity.value, Fraction)
    assert quantity.format == "DecimalSI"
    assert quantity.canonical() == "3"


@pytest.mark.parametrize(
    ("value", "fmt", "reason"),
    [
        case(F(1, 3), "DecimalSI", "nanos", id="one-third"),
        case(F(1, 10**10), "DecimalSI", "nanos", id="below-nano"),
        case(MAX_ABS_VALUE + NANO, "DecimalSI", "too large", id="above-max"),
        case(-MAX_ABS_VALUE - NANO, "BinarySI", "too large", id="below-min"),
        case(F(1), "Binary", "format", id="bad-format"),
        case(1.5, "DecimalSI", "float", id="float"),
        case(True, "DecimalSI", "bool", id="bool"),
        case("1", "DecimalSI", "str", id="string"),
    ],
)
def test_constructor_rejects(value: object, fmt: str, reason: str) -> None:
    with pytest.raises(QuantityError, match=reason):
        Quantity(value, fmt)  # type: ignore[arg-type]


# --- properties -------------------------------------------------------------------------------------

_BOUNDED_NANOS = st.integers(min_value=-MAX_NANOS, max_value=MAX_NANOS)
_NANOS = st.one_of(
    _BOUNDED_NANOS,
    st.integers(min_value=-(10**12), max_value=10**12),  # around one unit, with fractions
    # round decimal numbers: 1k, 250M, 3m, ...
    st.builds(lambda m, k: m * 10**k, st.integers(-999_999, 999_999), st.integers(0, 24)).filter(
        lambda n: abs(n) <= MAX_NANOS
    ),
    # whole binary numbers of bytes: 1Ki, 1536Mi, ...
    st.builds(lambda m, k: m * 1024**k * 10**9, st.integers(-99_999, 99_999), st.integers(0, 5)).filter(
        lambda n: abs(n) <= MAX_NANOS
    ),
)
_FORMAT = st.sampled_from(FORMATS)


@st.composite
def quantities(draw: st.DrawFn) -> Quantity:
    return Quantity(F(draw(_NANOS), 10**9), draw(_FORMAT))


@settings(max_examples=300)
@given(quantities())
def test_canonical_round_trips_exactly(quantity: Quantity) -> None:
    text = quantity.canonical()
    parsed = parse_quantity(text)
    assert parsed == quantity
    assert parsed.value == quantity.value


@settings(max_examples=300)
@given(quantities())
def test_canonical_is_idempotent(quantity: Quantity) -> None:
    first = quantity.canonical()
    second = parse_quantity(first).canonical()
    assert parse_quantity(second).canonical() == second
    if first != second:
        # Upstream's one exception: a whole BinarySI number of bytes that is no multiple of 1Ki
        # prints bare ("2000"), and the bare string parses as DecimalSI ("2k").
        assert quantity.format == "BinarySI"
        assert first == str(quantity.value)
        assert second == format_quantity(quantity.value, "DecimalSI")


@pytest.mark.parametrize(
    ("text", "first", "second"),
    [
        case("1.953125Ki", "2000", "2k"),
        case("4.8828125Ki", "5000", "5k"),
        case("-1.953125Ki", "-2000", "-2k"),
    ],
)
def test_bare_binary_numbers_reprint_as_decimal(text: str, first: str, second: str) -> None:
    quantity = parse_quantity(text)
    assert quantity.format == "BinarySI"
    assert quantity.canonical() == first
    assert parse_quantity(first).canonical() == second
    assert parse_quantity(first) == parse_quantity(second) == quantity


@pytest.mark.parametrize("text", [c.values[0] for c in CANONICAL_CASES])  # type: ignore[attr-defined]
def test_canonical_strings_are_fixed_points(text: str) -> None:
    once = parse_quantity(text).canonical()
    assert parse_quantity(once).canonical() == once


@settings(max_examples=200)
@given(quantities(), _FORMAT)
def test_every_format_spells_the_same_value(quantity: Quantity, fmt: Format) -> None:
    assert parse_quantity(format_quantity(quantity.value, fmt)).value == quantity.value


@settings(max_examples=200)
@given(quantities(), quantities())
def test_ordering_matches_fraction_ordering(a: Quantity, b: Quantity) -> None:
    assert (a < b) == (a.value < b.value)
    assert (a <= b) == (a.value <= b.value)
    assert (a > b) == (a.value > b.value)
    assert (a >= b) == (a.value >= b.value)
    assert (a == b) == (a.value == b.value)
    if a == b:
        assert hash(a) == hash(b)
    assert sorted([a, b]) == sorted([a, b], key=lambda q: q.value)


@settings(max_examples=200)
@given(quantities())
def test_milli_value_and_value_int_are_ceil(quantity: Quantity) -> None:
    assert quantity.milli_value() == math.ceil(quantity.value * 1000)
    assert quantity.value_int() == math.ceil(quantity.value)
    assert -(2**63) <= quantity.milli_value() <= 2**63 - 1


_SUFFIX_VALUES: dict[str, Fraction] = {
    "": F(1),
    "n": F(1, 10**9),
    "u": F(1, 10**6),
    "m": F(1, 1000),
    "k": F(10**3),
    "M": F(10**6),
    "G": F(10**9),
    "T": F(10**12),
    "P": F(10**15),
    "E": F(10**18),
    "Ki": F(KI),
    "Mi": F(MI),
    "Gi": F(GI),
    "Ti": F(TI),
    "Pi": F(PI),
    "Ei": F(EI),
}


@st.composite
def quantity_strings(draw: st.DrawFn) -> tuple[str, Fraction]:
    """A valid string and its exact value before rounding, built from the grammar."""
    sign = draw(st.sampled_from(["", "+", "-"]))
    whole = draw(st.text("0123456789", max_size=20))
    fraction = draw(st.one_of(st.none(), st.text("0123456789", max_size=40)))
    if not whole and not fraction:
        whole = draw(st.text("0123456789", min_size=1, max_size=3))
    if draw(st.booleans()):
        suffix = draw(st.sampled_from(sorted(_SUFFIX_VALUES)))
        multiplier = _SUFFIX_VALUES[suffix]
    else:
        exponent = draw(st.integers(-40, 40))
        exp_sign = "-" if exponent < 0 else draw(st.sampled_from(["", "+"]))
        suffix = draw(st.sampled_from("eE")) + exp_sign + str(abs(exponent)).zfill(draw(st.integers(1, 3)))
        multiplier = F(10) ** exponent
    text = sign + whole + ("" if fraction is None else "." + fraction) + suffix
    digits = (whole or "0") + (fraction or "")
    value = F(int(digits), 10 ** len(fraction or "")) * multiplier
    return text, -value if sign == "-" else value


@settings(max_examples=400)
@given(quantity_strings())
def test_parse_matches_an_exact_oracle(generated: tuple[str, Fraction]) -> None:
    text, exact = generated
    nanos = math.ceil(abs(exact) * 10**9)  # rounded away from zero to the nano
    if nanos > MAX_NANOS:
        with pytest.raises(QuantityError, match="too large"):
            parse_quantity(text)
        return
    expected = F(nanos if exact >= 0 else -nanos, 10**9)
    quantity = parse_quantity(text)
    assert quantity.value == expected
    assert parse_quantity(quantity.canonical()) == quantity
