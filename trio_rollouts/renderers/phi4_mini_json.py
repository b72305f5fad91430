"""``phi4_mini_json``: Phi-4-mini's calls, ``functools[{"name": ..., "arguments": {...}},
...]``; the content is the text before ``functools``."""

from __future__ import annotations

import json

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, call_from_object, json_items

_MARK = "functools"


def parse(text: str) -> tuple[str, list[ToolCall]]:
    content, found, rest = text.partition(_MARK)
    if not found or not rest.lstrip().startswith("["):
        return text, []
    items = json_items(rest)
    if items is None:
        try:
            json.loads(rest)
        except ValueError as error:
            return content, [broken("call_0", rest, f"not JSON ({error})")]
        return content, [broken("call_0", rest, "not a JSON list")]
    calls = [
        call_from_object(f"call_{index}", raw, item, arguments_keys=("arguments", "parameters"))
        for index, (raw, item) in enumerate(items)
    ]
    return content, calls
