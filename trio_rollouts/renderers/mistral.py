"""``mistral``: ``[TOOL_CALLS]`` then either a JSON list of ``{"name", "arguments", "id"}``
objects (tokenizer v3, Mistral-Nemo) or ``name[ARGS]{...}`` per call, with an optional
``[CALL_ID]id`` (v11 and later, Mistral-Small 3.2). The content is the text before the
first ``[TOOL_CALLS]``; the model's own call ids are kept (a call without one gets
``call_<index>``; :class:`~trio_rollouts.HFRenderer` writes ids as the nine letters and
digits Mistral's templates require). Reasoning is
``[THINK]...[/THINK]`` (:func:`reasoning`)."""

from __future__ import annotations

import json

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken, call_from_object, call_from_parts, json_items
from trio_rollouts.renderers._think import split

_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"


def parse(text: str) -> tuple[str, list[ToolCall]]:
    content, found, rest = text.partition(_CALLS)
    if not found:
        return text, []
    calls: list[ToolCall] = []
    for chunk in rest.split(_CALLS):
        if chunk.lstrip().startswith("["):
            calls.extend(_json_list(chunk, len(calls)))
        else:
            calls.append(_named(chunk, len(calls)))
    return content, calls


def _json_list(chunk: str, first: int) -> list[ToolCall]:
    items = json_items(chunk)
    if items is None:
        try:
            json.loads(chunk)
        except ValueError as error:
            return [broken(f"call_{first}", chunk, f"not JSON ({error})")]
        return [broken(f"call_{first}", chunk, "not a JSON list")]
    calls = []
    for offset, (raw, item) in enumerate(items):
        call_id = f"call_{first + offset}"
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            call_id = item["id"]
        calls.append(call_from_object(call_id, raw, item))
    return calls


def _named(chunk: str, index: int) -> ToolCall:
    call_id = f"call_{index}"
    head, found, arguments = chunk.partition(_ARGS)
    if not found:
        return broken(call_id, chunk, "no [ARGS]")
    name, has_id, written_id = head.partition(_CALL_ID)
    if has_id and written_id:
        call_id = written_id
    return call_from_parts(call_id, chunk, name.strip(), arguments)


def reasoning(text: str, *, opened: bool) -> tuple[str | None, str]:
    """``[THINK]...[/THINK]`` at the start of the turn (or to the end, when cut)."""
    return split(text, "[THINK]", "[/THINK]", opened=opened)
