"""``pythonic``: a Python list of calls, ``[name(key=value, ...), ...]`` (Llama 3.2 and
Llama 4's pythonic templates), with literal values only. A turn that is not such a
list is content."""

from __future__ import annotations

import ast

from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._calls import broken

_WRAPS = (("<|python_start|>", "<|python_end|>"),)


def parse(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    for start, end in _WRAPS:
        if body.startswith(start):
            body = body[len(start) :].removesuffix(end).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as error:
        return "", [broken("call_0", body, f"not a Python list of calls ({error.msg})")]
    if not isinstance(tree, ast.List) or not tree.elts:
        return text, []
    calls: list[ToolCall] = []
    for index, node in enumerate(tree.elts):
        call_id = f"call_{index}"
        raw = ast.get_source_segment(body, node) or ""
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            calls.append(broken(call_id, raw, "not a call of a named function"))
            continue
        name = node.func.id
        if node.args:
            calls.append(broken(call_id, raw, "positional arguments", name))
            continue
        try:
            arguments = {
                str(keyword.arg): ast.literal_eval(keyword.value) for keyword in node.keywords
            }
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            calls.append(broken(call_id, raw, "a value that is not a literal", name))
            continue
        calls.append(ToolCall(id=call_id, name=name, arguments=arguments, raw=raw))
    return "", calls
