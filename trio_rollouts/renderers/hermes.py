"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3,
QwQ, Hermes, SmolLM3; also :class:`~trio_rollouts.PlainRenderer`'s format). The content
is the text outside the calls; a call with no closing tag runs to the end."""

from __future__ import annotations

import re

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, call_from_json

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for index, found in enumerate(_CALL.finditer(text)):
        raw, closed = found.group(1), bool(found.group(2))
        call_id = f"call_{index}"
        calls.append(
            call_from_json(call_id, raw) if closed else broken(call_id, raw, "no </tool_call>")
        )
    return _CALL.sub("", text), calls
