"""``llama3_json``: Llama 3.x's JSON tool calls, ``{"name": ..., "parameters": {...}}``
(``arguments`` read too), the whole turn, optionally after ``<|python_tag|>`` and several
separated by ``;``. A turn that does not start with ``{`` or the tag is content."""

from __future__ import annotations

import json

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, call_from_object

_TAG = "<|python_tag|>"
_KEYS = ("parameters", "arguments")


def parse(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    tagged = body.startswith(_TAG)
    if tagged:
        body = body[len(_TAG) :].lstrip()
    if not body.startswith("{"):
        return (body if tagged else text), []
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    position = 0
    while position < len(body):
        call_id = f"call_{len(calls)}"
        try:
            data, end = decoder.raw_decode(body, position)
        except ValueError as error:
            calls.append(broken(call_id, body[position:], f"not JSON ({error})"))
            break
        calls.append(call_from_object(call_id, body[position:end], data, arguments_keys=_KEYS))
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
    return "", calls
