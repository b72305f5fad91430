"""``kimi_k2``: Kimi-K2's calls, in ``<|tool_calls_section_begin|>`` ...
``<|tool_calls_section_end|>``, each ``<|tool_call_begin|>functions.NAME:INDEX
<|tool_call_argument_begin|>{JSON}<|tool_call_end|>``. The written id
(``functions.NAME:INDEX``) is the call's id, as the template writes it back."""

from __future__ import annotations

import re

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, call_from_parts

_SECTION = re.compile(
    r"<\|tool_calls_section_begin\|>(.*?)(<\|tool_calls_section_end\|>|$)", re.DOTALL
)
_CALL = re.compile(
    r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)(<\|tool_call_end\|>|$)",
    re.DOTALL,
)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for section in _SECTION.finditer(text):
        for found in _CALL.finditer(section.group(1)):
            written, arguments, closed = found.group(1).strip(), found.group(2), found.group(3)
            call_id = written or f"call_{len(calls)}"
            name = written.split(":", 1)[0].removeprefix("functions.")
            if not closed:
                calls.append(broken(call_id, found.group(0), "no <|tool_call_end|>", name))
            else:
                calls.append(call_from_parts(call_id, found.group(0), name, arguments))
    return _SECTION.sub("", text), calls
