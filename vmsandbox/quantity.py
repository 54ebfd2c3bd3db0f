"""Kubernetes ``resource.Quantity`` strings ("500m", "1.5", "2Gi", "1e3"), parsed and printed exactly.

This module owns the grammar, the exact value (a ``Fraction`` of base units: cores, bytes, ...),
the canonical form Kubernetes prints, and the bounds we accept. Pure: no IO, no floats.

Semantics follow k8s.io/apimachinery ``pkg/api/resource`` (``ParseQuantity``, ``CanonicalizeBytes``):

* Grammar: ``[+-]`` digits with an optional fraction (``1``, ``1.5``, ``1.``, ``.5``), then a suffix:
  decimal SI ``n u m "" k M G T P E``, binary SI ``Ki Mi Gi Ti Pi Ei``, or an exponent
  ``e``/``E`` followed by a signed integer (``1e3``, ``1.5E-3``). ``E`` alone is exa.
* Precision: like upstream, a value is kept down to the nano (1e-9); a non-zero value with finer
  digits is rounded *away from zero* to the next nano ("0.9n" -> 1n, "3.001n" -> 4n,
  "1e-999" -> 1n, "-0.1n" -> -1n).
* Format: the suffix chooses it (DecimalSI, BinarySI, DecimalExponent). A binary quantity whose
  non-zero magnitude is below 1 becomes DecimalSI ("0.000000000001Ki" -> 2n), as upstream.
* Canonical form (``Quantity.String()`` upstream): the largest suffix with an integer mantissa,
  so "1000m" -> "1", "0.5" -> "500m", "1000" -> "1k", "1e3" -> "1e3", "1.5Gi" -> "1536Mi".
  BinarySI prints as DecimalSI when the magnitude is below 1024 or not a whole number of bytes
  ("0.5Ki" -> "512", "100.035Ki" -> "102435840m"), and bare when no multiple of 1Ki
  ("1.5Ki" -> "1536"). DecimalSI has no suffix beyond ``E`` or below ``n``; such values print in
  exponent form ("1e21"), never losing magnitude.
  Every canonical string parses back to the same value. It also reprints unchanged, with one
  upstream exception: a BinarySI whole number of bytes that is no multiple of 1Ki prints bare
  ("1.953125Ki" -> "2000"), and the bare string parses as DecimalSI ("2000" -> "2k").

Where we deliberately differ from upstream:

* A number must contain a digit: upstream reads ".", "+", "-" and a bare "Ki" as zero; we reject.
* Bound: a value whose magnitude exceeds ``MAX_ABS_VALUE`` = (2**63 - 1) / 1000 base units (its
  milli-value would not fit an int64) is rejected as too large. Upstream silently caps binary
  quantities at 2**63 - 1 ("8Ei") and lets decimal ones grow without limit; neither is a request
  a VM can honour. The check looks at the number of digits and the exponent first, so
  "1e999999999" is refused without building a giant integer.
* An exponent beyond the int32 range is rejected (upstream wraps it to int32 silently).
* ``milli_value``/``value_int`` are ceilings for every sign (upstream rounds negative values
  inconsistently between its two internal representations).

Equality, hashing and ordering use the numeric value only: ``parse_quantity("1000m") ==
parse_quantity("1")`` and ``parse_quantity("1Gi") == parse_quantity("1073741824")``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal, get_args

from vmsandbox.errors import InvalidArgument

__all__ = [
    "MAX_ABS_VALUE",
    "Format",
    "Quantity",
    "QuantityError",
    "format_quantity",
    "parse_nonnegative_quantity",
    "parse_quantity",
]

Format = Literal["DecimalSI", "BinarySI", "DecimalExponent"]
_FORMATS: frozenset[str] = frozenset(get_args(Format))

_INT64_MAX = 2**63 - 1
_NANO = 10**9
#: Largest magnitude accepted, in base units: the milli-value of any quantity fits an int64.
MAX_ABS_VALUE = Fraction(_INT64_MAX, 1000)
_MAX_ABS_NANOS = _INT64_MAX * 10**6  # MAX_ABS_VALUE expressed in nanos (exact: 10**9 / 10**3)
# 10**16 > MAX_ABS_VALUE: a number with a leading digit at 10**16 or above is too large.
_TOO_LARGE_DECIMAL_EXPONENT = 16
_INT32_MAX = 2**31 - 1

# suffix -> (power of 10, power of 2, format)
_SUFFIXES: dict[str, tuple[int, int, Format]] = {
    "n": (-9, 0, "DecimalSI"),
    "u": (-6, 0, "DecimalSI"),
    "m": (-3, 0, "DecimalSI"),
    "": (0, 0, "DecimalSI"),
    "k": (3, 0, "DecimalSI"),
    "M": (6, 0, "DecimalSI"),
    "G": (9, 0, "DecimalSI"),
    "T": (12, 0, "DecimalSI"),
    "P": (15, 0, "DecimalSI"),
    "E": (18, 0, "DecimalSI"),
    "Ki": (0, 10, "BinarySI"),
    "Mi": (0, 20, "BinarySI"),
    "Gi": (0, 30, "BinarySI"),
    "Ti": (0, 40, "BinarySI"),
    "Pi": (0, 50, "BinarySI"),
    "Ei": (0, 60, "BinarySI"),
}
_DECIMAL_SUFFIX_BY_EXPONENT: dict[int, str] = {
    exp10: name for name, (exp10, _, fmt) in _SUFFIXES.items() if fmt == "DecimalSI"
}
_BINARY_SUFFIXES = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")  # index = power of 1024

# [+-] digits [. digits]; the rest of the string is the suffix. Explicit ASCII classes on purpose:
# Python's \d and int() accept other digits, underscores and surrounding whitespace.
_NUMBER_RE = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?")
_EXPONENT_RE = re.compile(r"[eE]([+-]?)([0-9]+)")
_EXPECTED = (
    "expected [+-]<digits>[.<digits>] and an optional suffix: n u m k M G T P E, Ki Mi Gi Ti Pi Ei, "
    'or an exponent such as "e3" (examples: "500m", "1.5", "2Gi", "1e3")'
)
_MESSAGE_TEXT_LIMIT = 64


class QuantityError(InvalidArgument):
    """A string is not a Kubernetes quantity we accept, or a value cannot be one."""


def _ceil(value: Fraction) -> int:
    return -(-value.numerator // value.denominator)


def _quote(text: str) -> str:
    """The offending string for a message: double-quoted, escaped, shortened when huge."""
    if len(text) > _MESSAGE_TEXT_LIMIT:
        text = text[:_MESSAGE_TEXT_LIMIT] + "..."
    return json.dumps(text)


def _invalid(text: str, why: str) -> QuantityError:
    return QuantityError(f"invalid quantity {_quote(text)}: {why}")


def _too_large(text: str) -> QuantityError:
    return _invalid(text, f"too large: the magnitude must not exceed {format_quantity(MAX_ABS_VALUE, 'DecimalSI')}")


@dataclass(frozen=True, eq=False)
class Quantity:
    """An exact quantity and the format it prints in.

    ``value`` is in base units and is a whole number of nanos with magnitude at most
    ``MAX_ABS_VALUE``; the constructor checks both (``QuantityError`` otherwise), so every
    ``Quantity`` has an exact canonical string that parses back to the same value.
    Comparison and hashing use ``value`` only.
    """

    value: Fraction
    format: Format = "DecimalSI"

    def __post_init__(self) -> None:
        value: object = self.value
        if isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(self, "value", Fraction(value))
        elif not isinstance(value, Fraction):
            raise QuantityError(f"quantity value must be a Fraction or an int, got {type(value).__name__}")
        if self.format not in _FORMATS:
            raise QuantityError(f"unknown quantity format {self.format!r}; expected one of {sorted(_FORMATS)}")
        if _NANO % self.value.denominator != 0:
            raise QuantityError(f"quantity value {self.value} is not a whole number of nanos (1e-9)")
        if abs(self.value) > MAX_ABS_VALUE:
            raise QuantityError(
                f"quantity value {self.value} is too large: the magnitude must not exceed "
                f"{format_quantity(MAX_ABS_VALUE, 'DecimalSI')}"
            )

    def canonical(self) -> str:
        """The string Kubernetes prints for this quantity (see the module docstring); computed once."""
        cached: str | None = self.__dict__.get("_canonical")
        if cached is None:
            cached = format_quantity(self.value, self.format)
            self.__dict__["_canonical"] = cached  # a cache, not a field: eq, hash and repr ignore it
        return cached

    def milli_value(self) -> int:
        """``ceil(value * 1000)``; always fits an int64."""
        return _ceil(self.value * 1000)

    def value_int(self) -> int:
        """``ceil(value)``."""
        return _ceil(self.value)

    def is_zero(self) -> bool:
        return self.value == 0

    def __str__(self) -> str:
        return self.canonical()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            return NotImplemented
        # Fractions are kept in lowest terms: equal values have equal ratios (and this is 3x cheaper)
        return self.value.as_integer_ratio() == other.value.as_integer_ratio()

    def __hash__(self) -> int:
        return hash(self.value)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            return NotImplemented
        return self.value < other.value

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            return NotImplemented
        return self.value <= other.value

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            return NotImplemented
        return self.value > other.value

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            return NotImplemented
        return self.value >= other.value


def _power(base: int, exponent: int) -> int:
    """``base**exponent`` for ``exponent >= 0``, typed as the int it is."""
    result: int = base**exponent
    return result


def _nanos_rounded_up(digits: str, exp10: int, exp2: int) -> int:
    """``ceil(int(digits) * 10**exp10 * 2**exp2 * 1e9)`` for a magnitude the caller bounded above.

    ``digits`` is non-empty, without leading or trailing zeros. Digits far below the nano are
    never turned into an integer: keeping ``k = exp2 + 1`` places past the nano, the head ``H``
    gives ``A = H * 2**exp2 / 10**k``, a multiple of ``2**exp2 / 10**k`` (because ``k >= exp2``),
    while the dropped, non-zero tail adds less than that step (and less than 1), so the ceiling is
    ``floor(A) + 1`` whether or not ``A`` is whole.
    """
    shift = exp10 + 9  # value in nanos = int(digits) * 10**shift * 2**exp2
    if shift >= 0:
        return int(digits) * _power(10, shift) * _power(2, exp2)
    places = -shift
    keep_places = exp2 + 1
    if places <= keep_places:
        quotient, remainder = divmod(int(digits) * _power(2, exp2), _power(10, places))
        return quotient + (remainder != 0)
    head_len = len(digits) - (places - keep_places)
    head = int(digits[:head_len]) if head_len > 0 else 0
    return (head * _power(2, exp2)) // _power(10, keep_places) + 1


def parse_quantity(text: str) -> Quantity:
    """Parse a Kubernetes quantity string exactly; negative values are allowed.

    Raises ``QuantityError`` (an ``InvalidArgument``) naming the string for anything
    Kubernetes would reject, for the stricter cases listed in the module docstring, and for
    magnitudes above ``MAX_ABS_VALUE``.
    """
    if not isinstance(text, str):
        raise QuantityError(f"a quantity must be a string, got {type(text).__name__}")
    if text == "":
        raise _invalid(text, "empty string; " + _EXPECTED)
    if any(ch.isspace() for ch in text):
        raise _invalid(text, "whitespace is not allowed")

    number = _NUMBER_RE.match(text)
    assert number is not None  # every part of the pattern may be empty
    sign, whole, fraction = number.group(1), number.group(2), number.group(3) or ""
    suffix = text[number.end() :]
    if suffix[:1] in (".", "+", "-"):
        raise _invalid(text, "malformed number; " + _EXPECTED)
    if not whole and not fraction:
        raise _invalid(text, "no digits; " + _EXPECTED)

    fmt: Format
    if suffix in _SUFFIXES:
        exp10, exp2, fmt = _SUFFIXES[suffix]
    else:
        exponent = _EXPONENT_RE.fullmatch(suffix)
        if exponent is None:
            raise _invalid(text, f"unknown suffix {_quote(suffix)}; " + _EXPECTED)
        exp_digits = exponent.group(2).lstrip("0") or "0"
        if len(exp_digits) > len(str(_INT32_MAX)) or int(exp_digits) > _INT32_MAX:
            raise _invalid(text, f"exponent out of range: its magnitude must not exceed {_INT32_MAX}")
        exp10 = -int(exp_digits) if exponent.group(1) == "-" else int(exp_digits)
        exp2 = 0
        fmt = "DecimalExponent"

    # value = int(digits) * 10**exp10 * 2**exp2, digits without leading or trailing zeros
    digits = (whole + fraction).lstrip("0")
    exp10 -= len(fraction)
    stripped = digits.rstrip("0")
    exp10 += len(digits) - len(stripped)
    digits = stripped

    if not digits:
        return Quantity(Fraction(0), fmt)
    # The leading digit alone is worth 10**(len - 1 + exp10) (times 2**exp2 >= 1).
    if len(digits) - 1 + exp10 >= _TOO_LARGE_DECIMAL_EXPONENT:
        raise _too_large(text)
    nanos = _nanos_rounded_up(digits, exp10, exp2)
    if nanos > _MAX_ABS_NANOS:
        raise _too_large(text)
    if fmt == "BinarySI" and nanos < _NANO:
        fmt = "DecimalSI"  # as upstream: a fraction of one byte does not print as binary
    return Quantity(Fraction(-nanos if sign == "-" else nanos, _NANO), fmt)


def parse_nonnegative_quantity(text: str) -> Quantity:
    """``parse_quantity`` for resources, which must not be negative ("-0" is zero and passes)."""
    quantity = parse_quantity(text)
    if quantity.value < 0:
        raise _invalid(text, "must not be negative")
    return quantity


def format_quantity(value: Fraction | int, fmt: Format = "DecimalSI") -> str:
    """The canonical Kubernetes string of ``value`` in ``fmt`` (see the module docstring).

    Works for any value with a terminating decimal expansion, without the bounds ``Quantity``
    enforces; raises ``QuantityError`` for values such as 1/3 that no quantity string can spell.
    """
    if isinstance(value, bool) or not isinstance(value, int | Fraction):
        raise QuantityError(f"quantity value must be a Fraction or an int, got {type(value).__name__}")
    if fmt not in _FORMATS:
        raise QuantityError(f"unknown quantity format {fmt!r}; expected one of {sorted(_FORMATS)}")
    exact = Fraction(value)
    if exact == 0:
        return "0"
    sign = "-" if exact < 0 else ""
    magnitude = abs(exact)

    if fmt == "BinarySI":
        if magnitude >= 1024 and magnitude.denominator == 1:
            mantissa, power = magnitude.numerator, 0
            while power < len(_BINARY_SUFFIXES) - 1 and mantissa % 1024 == 0:
                mantissa //= 1024
                power += 1
            return f"{sign}{mantissa}{_BINARY_SUFFIXES[power]}"
        fmt = "DecimalSI"  # below 1Ki or not a whole number of bytes: decimal, as upstream

    # magnitude = mantissa * 10**exponent with an integer mantissa
    denominator = magnitude.denominator
    twos = fives = 0
    while denominator % 2 == 0:
        denominator //= 2
        twos += 1
    while denominator % 5 == 0:
        denominator //= 5
        fives += 1
    if denominator != 1:
        raise QuantityError(f"quantity value {exact} has no exact decimal representation")
    places = max(twos, fives)
    mantissa = magnitude.numerator * (_power(10, places) // magnitude.denominator)
    exponent = -places
    while mantissa % 10 == 0:
        mantissa //= 10
        exponent += 1
    while exponent % 3 != 0:
        mantissa *= 10
        exponent -= 1

    if fmt == "DecimalSI" and exponent in _DECIMAL_SUFFIX_BY_EXPONENT:
        suffix = _DECIMAL_SUFFIX_BY_EXPONENT[exponent]
    else:  # DecimalExponent, or DecimalSI beyond E / below n (upstream falls back to "e" too)
        suffix = f"e{exponent}" if exponent != 0 else ""
    return f"{sign}{mantissa}{suffix}"
