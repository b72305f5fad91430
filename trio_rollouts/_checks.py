"""Validators: one copy of each, shared by the models, agents, policies, backends and CLI.

Every check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for one
out of range, with a message that names the field, the value and what is allowed. The
attrs validators take the field's name from the attribute; the plain ``check_*``
functions take it as an argument (for parameters that are not attrs fields).

This is the ground floor: it imports nothing from the package.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

__all__ = [
    "check_bool",
    "check_natural",
    "check_optional_str",
    "check_seconds",
    "check_str",
    "int_at_least",
    "is_int",
    "is_real",
    "non_negative",
    "non_negative_seconds",
    "optional_int_at_least",
    "seconds",
]


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------- integers


def check_natural(name: str, value: object, minimum: int = 0) -> None:
    """``value`` is an int ``>= minimum`` (a bool is not an int)."""
    if not is_int(value):
        msg = f"{name} must be an int >= {minimum}, got {value!r}"
        raise TypeError(msg)
    if value < minimum:  # type: ignore[operator]
        msg = f"{name} must be >= {minimum}, got {value!r}"
        raise ValueError(msg)


def int_at_least(minimum: int) -> Any:
    """An attrs validator: the field is an int ``>= minimum``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_natural(attribute.name, value, minimum)

    return check


def optional_int_at_least(minimum: int) -> Any:
    """An attrs validator: the field is ``None`` or an int ``>= minimum``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None:
            return
        if not is_int(value):
            msg = f"{attribute.name} must be an int >= {minimum} or None, got {value!r}"
            raise TypeError(msg)
        if value < minimum:  # type: ignore[operator]
            msg = f"{attribute.name} must be >= {minimum}, got {value!r}"
            raise ValueError(msg)

    return check


# --------------------------------------------------------------------------- reals


def _check_non_negative(name: str, value: object, unit: str) -> None:
    if not is_real(value):
        msg = f"{name} must be a number{unit} >= 0, got {value!r}"
        raise TypeError(msg)
    if not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        msg = f"{name} must be a finite number{unit} >= 0, got {value!r}"
        raise ValueError(msg)


def non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: a finite real ``>= 0``."""
    _check_non_negative(attribute.name, value, "")


def non_negative_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: a finite number of seconds ``>= 0``."""
    _check_non_negative(attribute.name, value, " of seconds")


def check_seconds(
    name: str,
    value: object,
    *,
    positive: bool = False,
    optional: bool = True,
    finite: bool = False,
) -> None:
    """A duration in seconds: a real ``>= 0`` (``> 0`` when ``positive``), ``inf`` allowed
    unless ``finite``, NaN refused; ``None`` ("no limit") when ``optional``."""
    if value is None and optional:
        return
    bound = "> 0" if positive else ">= 0"
    alternative = " or None for no limit" if optional else ""
    number = "a finite number" if finite else "a number"
    if not is_real(value):
        msg = f"{name} must be {number} of seconds {bound}{alternative}, got {value!r}"
        raise TypeError(msg)
    if finite and math.isinf(value):  # type: ignore[arg-type]
        msg = f"{name} must be {number} of seconds {bound}{alternative}, got {value!r}"
        raise ValueError(msg)
    if math.isnan(value) or value < 0 or (positive and value == 0):  # type: ignore[arg-type,operator]
        msg = f"{name} must be {bound} seconds{alternative}, got {value!r}"
        raise ValueError(msg)


def seconds(*, positive: bool = False, optional: bool = True, prefix: str = "") -> Any:
    """An attrs validator for :func:`check_seconds`; ``prefix`` (such as ``"Timeout."``)
    goes before the field's name in messages."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_seconds(prefix + attribute.name, value, positive=positive, optional=optional)

    return check


# --------------------------------------------------------------------------- others


def check_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        msg = f"{attribute.name} must be a bool, got {value!r}"
        raise TypeError(msg)


def check_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str):
        msg = f"{attribute.name} must be a str, got {value!r}"
        raise TypeError(msg)


def check_optional_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, str):
        msg = f"{attribute.name} must be a str or None, got {value!r}"
        raise TypeError(msg)
