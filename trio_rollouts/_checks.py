"""attrs validators shared by the models, agents, policies and backends.

Each one raises ``TypeError`` for a value of the wrong type and ``ValueError`` for one
out of range, with a message that names the field, the value and what is allowed.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["check_bool", "check_optional_str", "check_str", "int_at_least", "is_int", "is_real"]


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_at_least(minimum: int) -> Any:
    """A validator: the field is an int ``>= minimum``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not is_int(value):
            msg = f"{attribute.name} must be an int >= {minimum}, got {value!r}"
            raise TypeError(msg)
        if value < minimum:  # type: ignore[operator]
            msg = f"{attribute.name} must be >= {minimum}, got {value!r}"
            raise ValueError(msg)

    return check


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
