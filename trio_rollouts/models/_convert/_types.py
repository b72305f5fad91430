"""The kinds of type annotation the hooks tell apart, and the hooks' own types."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = ["NoneType", "StructureHook", "UnstructureFn", "is_list", "is_tuple", "is_union"]

StructureHook = Callable[[Any, Any], Any]
UnstructureFn = Callable[[Any], Any]

NoneType = type(None)


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def is_list(tp: Any) -> bool:
    origin: Any = typing.get_origin(tp)
    return origin is list


def is_tuple(tp: Any) -> bool:
    origin: Any = typing.get_origin(tp)
    return origin is tuple
