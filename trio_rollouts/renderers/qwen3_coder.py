"""``qwen3_coder``: Qwen3-Coder's XML calls, ``<tool_call><function=NAME>`` then
``<parameter=K>V</parameter>`` per argument, then ``</function></tool_call>``. A value is
JSON when it reads as JSON, else the text itself (one newline around it is the format's)."""

from __future__ import annotations

import re

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, loose_value

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _value(text: str) -> object:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return loose_value(text)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for index, found in enumerate(_CALL.finditer(text)):
        raw, closed = found.group(1), bool(found.group(2))
        call_id = f"call_{index}"
        function = _FUNCTION.search(raw)
        if function is None:
            calls.append(broken(call_id, raw, "no <function=NAME>"))
        elif not closed or not function.group(3):
            why = "no </tool_call>" if not closed else "no </function>"
            calls.append(broken(call_id, raw, why, name=function.group(1).strip()))
        else:
            arguments = {
                key.strip(): _value(value) for key, value in _PARAMETER.findall(function.group(2))
            }
            calls.append(
                ToolCall(id=call_id, name=function.group(1).strip(), arguments=arguments, raw=raw)
            )
    return _CALL.sub("", text), calls
