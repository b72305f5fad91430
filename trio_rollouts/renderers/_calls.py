"""Reading one tool call: the helpers every tool-call format shares.

A call is valid when it has a string name and arguments that are a JSON object, given
either as an object or as a JSON string holding one (the OpenAI wire form). Anything else
is still a :class:`~trio_rollouts.ToolCall`, with ``arguments=None`` and a
``parse_error`` saying why: never repaired.
"""

from __future__ import annotations

import json
from typing import Any

from trio_rollouts.renderers._base import ToolCall

__all__ = [
    "broken",
    "call_from_json",
    "call_from_object",
    "call_from_parts",
    "json_items",
    "loose_value",
    "object_arguments",
]


def broken(call_id: str, raw: str, why: str, name: str | None = None) -> ToolCall:
    """A call that could not be read: its raw text kept, ``why`` as its error."""
    return ToolCall(id=call_id, name=name, arguments=None, raw=raw, parse_error=why)


def object_arguments(value: object) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as an object: a dict as is, a JSON string holding an object decoded;
    ``(None, why)`` otherwise."""
    if isinstance(value, dict):
        return value, None
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            return None, "'arguments' is a string that is not JSON"
        if isinstance(decoded, dict):
            return decoded, None
        return None, f"'arguments' is a JSON string holding a {type(decoded).__name__}"
    return None, f"'arguments' is a {type(value).__name__}, not an object"


def call_from_json(
    call_id: str, raw: str, *, arguments_keys: tuple[str, ...] = ("arguments",)
) -> ToolCall:
    """A call written as one JSON object with ``name`` and arguments (under the first
    of ``arguments_keys`` present; none present is no arguments)."""
    try:
        data = json.loads(raw)
    except ValueError as error:
        return broken(call_id, raw, f"not JSON ({error})")
    return call_from_object(call_id, raw, data, arguments_keys=arguments_keys)


def call_from_object(
    call_id: str, raw: str, data: object, *, arguments_keys: tuple[str, ...] = ("arguments",)
) -> ToolCall:
    """A call from an already decoded JSON value (see :func:`call_from_json`)."""
    if not isinstance(data, dict):
        return broken(call_id, raw, f"a {type(data).__name__}, not an object")
    name = data.get("name")
    if not isinstance(name, str):
        return broken(call_id, raw, f"'name' is {name!r}, not a string")
    value: object = {}
    for key in arguments_keys:
        if key in data:
            value = data[key]
            break
    arguments, why = object_arguments(value)
    if arguments is None:
        return broken(call_id, raw, why or "no arguments", name=name)
    return ToolCall(id=call_id, name=name, arguments=arguments, raw=raw)


def call_from_parts(call_id: str, raw: str, name: str, arguments_text: str) -> ToolCall:
    """A call whose format writes the name apart from a JSON arguments text."""
    if not name:
        return broken(call_id, raw, "no function name")
    try:
        value = json.loads(arguments_text) if arguments_text.strip() else {}
    except ValueError as error:
        return broken(call_id, raw, f"arguments not JSON ({error})", name=name)
    arguments, why = object_arguments(value)
    if arguments is None:
        return broken(call_id, raw, why or "no arguments", name=name)
    return ToolCall(id=call_id, name=name, arguments=arguments, raw=raw)


def json_items(text: str) -> list[tuple[str, object]] | None:
    """The items of a JSON list, each with its text as written; ``None`` when ``text``
    is not one JSON list (trailing whitespace allowed)."""
    decoder = json.JSONDecoder()
    body = text.strip()
    if not body.startswith("["):
        return None
    items: list[tuple[str, object]] = []
    position = _skip(body, 1)
    if position < len(body) and body[position] == "]":
        return items if _skip(body, position + 1) == len(body) else None
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            return None
        items.append((body[position:end], value))
        position = _skip(body, end)
        if position < len(body) and body[position] == ",":
            position = _skip(body, position + 1)
            continue
        if position < len(body) and body[position] == "]":
            return items if _skip(body, position + 1) == len(body) else None
        return None
    return None


def _skip(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def loose_value(text: str) -> Any:
    """A parameter value written as text (GLM, Qwen3-Coder): JSON when it reads as JSON,
    else the text itself (templates write strings unquoted)."""
    try:
        return json.loads(text)
    except ValueError:
        return text
