"""``glm45``: GLM-4.5/4.6's calls, ``<tool_call>NAME`` then ``<arg_key>K</arg_key>
<arg_value>V</arg_value>`` pairs, then ``</tool_call>``. A value is JSON when it reads as
JSON, else the text itself (the template writes strings unquoted). Reasoning is
``<think>...</think>``."""

from __future__ import annotations

import re

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, loose_value

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for index, found in enumerate(_CALL.finditer(text)):
        raw, closed = found.group(1), bool(found.group(2))
        call_id = f"call_{index}"
        name = raw.split("<arg_key>", 1)[0].strip()
        if not closed:
            calls.append(broken(call_id, raw, "no </tool_call>", name=name or None))
        elif not name:
            calls.append(broken(call_id, raw, "no function name"))
        else:
            arguments = {key.strip(): loose_value(value) for key, value in _PAIR.findall(raw)}
            calls.append(ToolCall(id=call_id, name=name, arguments=arguments, raw=raw))
    return _CALL.sub("", text), calls
