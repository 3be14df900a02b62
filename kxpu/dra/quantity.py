"""Kubernetes quantities (``4Gi``, ``512Mi``, ``1.5G``, ``25``, ``100m``) as exact numbers.

The scheduler writes a share's consumed capacity as quantities; kxpu turns them into the MiB and
percent its in-container limits use. Parsing is exact (``Fraction``): ``1.5Gi`` is 1536 MiB, not a
float's approximation of it, so a grant is never rounded up past what the scheduler accounted.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1)}
_DECIMAL.update({"k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12)})
_DECIMAL.update({"P": Fraction(10**15), "E": Fraction(10**18)})
_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)$")


def parse_quantity(text: str) -> Fraction:
    """The exact value of a quantity; ValueError naming the text when it is not one."""
    match = _QUANTITY.match(str(text).strip())
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, exponent, suffix = match.groups()
    value = Fraction(number)
    if exponent:
        return value * Fraction(10) ** int(exponent[1:])
    suffix = suffix or ""
    return value * (_BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix])


def as_mib(text: str) -> int:
    """A byte quantity in whole MiB, rounded down (a grant never exceeds what was accounted)."""
    return int(parse_quantity(text) / 2**20)
