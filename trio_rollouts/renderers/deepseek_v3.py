"""``deepseek_v3`` and ``deepseek_v31``: DeepSeek's calls between
``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each
``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``: V3 writes
``function<｜tool▁sep｜>NAME`` then the arguments in a ```` ```json ```` fence, V3.1
``NAME<｜tool▁sep｜>{JSON}``."""

from __future__ import annotations

import re

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, call_from_parts

_SECTION = re.compile(r"<｜tool▁calls▁begin｜>(.*?)(<｜tool▁calls▁end｜>|$)", re.DOTALL)
_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)(<｜tool▁call▁end｜>|$)", re.DOTALL)
_SEP = "<｜tool▁sep｜>"
_FENCE = re.compile(r"^\s*```(?:json)?\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def _calls(text: str, read: str) -> tuple[str, list[ToolCall]]:
    calls: list[ToolCall] = []
    for section in _SECTION.finditer(text):
        for found in _CALL.finditer(section.group(1)):
            raw, closed = found.group(1), bool(found.group(2))
            call_id = f"call_{len(calls)}"
            head, has_sep, tail = raw.partition(_SEP)
            if not has_sep:
                calls.append(broken(call_id, raw, "no <｜tool▁sep｜>"))
                continue
            if read == "v3":
                name, _, arguments = tail.partition("\n")
                fenced = _FENCE.match(arguments)
                arguments = fenced.group(1) if fenced else arguments
            else:
                name, arguments = head, tail
            name = name.strip()
            if not closed:
                calls.append(broken(call_id, raw, "no <｜tool▁call▁end｜>", name or None))
            else:
                calls.append(call_from_parts(call_id, raw, name, arguments))
    return _SECTION.sub("", text), calls


def parse(text: str) -> tuple[str, list[ToolCall]]:
    return _calls(text, "v3")


def parse_v31(text: str) -> tuple[str, list[ToolCall]]:
    return _calls(text, "v31")
