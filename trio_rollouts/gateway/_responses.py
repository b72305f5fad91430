"""The OpenAI Responses dialect: ``POST /v1/responses``, whole or streamed.

The OpenAI Agents SDK's default API (and Codex's only one). A call is read into the
session's terms:

- ``input``: a string (one user message) or a list of items: messages (``role`` user,
  system, developer or assistant; ``content`` a string or a list of ``input_text`` /
  ``output_text`` parts; ``"type": "message"`` or not), ``function_call`` items,
  ``function_call_output`` items and ``reasoning`` items. An assistant message and the
  ``function_call`` items after it (or such items alone) are one assistant chat message,
  ``content`` and ``tool_calls`` (``id`` = ``call_id``): the reply the session gave, so the
  call extends it. A ``function_call_output`` is a ``tool`` message (``tool_call_id`` =
  ``call_id``). A ``reasoning`` item's text becomes the ``reasoning_content`` of the
  assistant message that follows it (matching ignores it); it is no message of its own.
- ``instructions``: the system prompt (:attr:`DialectCall.system`);
  ``previous_response_id``: the response the call continues (:attr:`DialectCall.previous`;
  a response ``resp_<hex>`` is the session's chat reply ``chatcmpl-<hex>``).
- ``tools``: function tools (``{"type": "function", "name", "description", "parameters",
  "strict"}``), as chat tools ``{"type": "function", "function": {"name", "description",
  "parameters"}}`` (always the same for the same tools, so a tool set that did not change
  is no break); a built-in tool (``web_search``, ``file_search``, ...) is a 400.
- ``temperature``, ``top_p``, ``max_output_tokens`` (as ``max_tokens``; also ``top_k`` and
  ``seed``, as vLLM takes them): fill what the gateway's sampling leaves unset.
- ``conversation``, ``prompt`` (stored server-side: the gateway has neither) and
  ``background: true`` are 400s; an image, file or audio part is a 400 naming where it is.
  Other fields the SDKs send (``store``, ``include``, ``tool_choice``, ``truncation``,
  ``reasoning``, ``text``, ``metadata``, ``user``, ...) are accepted and ignored.

The reply is a ``response`` object: ``output`` holds a ``reasoning`` item when the model
reasoned, a ``message`` item when it wrote text (or called no tool), and a
``function_call`` item per tool call (``call_id`` = the chat tool call's id); ``status``
is ``"incomplete"`` (``incomplete_details.reason: "max_output_tokens"``) when the reply hit
its token limit. With ``stream: true`` the reply, generated whole, is sent as the events
OpenAI sends (``event: <type>`` and ``data: <json>``, numbered by ``sequence_number``):
``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, its content's events, ``response.output_item.done``, then
``response.completed`` (or ``response.incomplete``) carrying the whole response.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final

from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.gateway._dialect import DialectCall, json_response, streamed
from trio_rollouts.gateway._http import HTTPResponse, StreamingResponse
from trio_rollouts.gateway._session import GatewayError, body_args
from trio_rollouts.gateway._sse import sse_event

__all__ = ["ResponsesDialect", "response_events", "response_object"]

#: The input item types the gateway reads.
_ITEM_TYPES: Final = ("message", "function_call", "function_call_output", "reasoning")
#: The roles a Responses message may have.
_ROLES: Final = ("user", "system", "developer", "assistant")
#: Content parts read as text.
_TEXT_PARTS: Final = ("input_text", "output_text")
#: Sampling fields of the body, by the chat field ``body_args`` reads them as.
_SAMPLING: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_output_tokens": "max_tokens",
    "top_k": "top_k",
    "seed": "seed",
}
#: Fields that ask for what the gateway does not keep or do, and why they are refused.
_REFUSED: Final = {
    "conversation": (
        "the gateway keeps no stored conversations: send the conversation as input, or "
        "continue a response with previous_response_id"
    ),
    "prompt": "the gateway keeps no stored prompts: send instructions and input",
    "background": "the gateway answers in the call; background responses are not served",
}
#: A response id the dialect gives: ``resp_`` and the hex of the chat reply's id.
_RESPONSE_ID: Final = re.compile(r"resp_([0-9a-f]+)")
#: The session's error for an unknown ``previous``, which names the chat reply id.
_UNKNOWN_PREVIOUS: Final = re.compile(r"^previous response 'chatcmpl-([0-9a-f]+)'")
_TOOL_CHOICES: Final = ("auto", "none", "required")


class ResponsesDialect:
    """OpenAI Responses (see the module's docstring): ``input`` items read into chat
    messages, the reply written as a ``response`` object or its stream of events."""

    route = "responses"

    def read(
        self, body: Mapping[str, Any], generation_args: GenerationArgs, model: str
    ) -> DialectCall:
        for key, why in _REFUSED.items():
            value = body.get(key)
            if value is not None and value is not False:
                raise GatewayError(400, f"{key}={value!r:.80} is not served: {why}")
        system = body.get("instructions")
        if system is not None and not isinstance(system, str):
            msg = f"instructions must be a string or null, got {system!r:.80}"
            raise GatewayError(400, msg)
        previous_id = body.get("previous_response_id")
        tools, shown = _tools(body.get("tools"))
        messages = _input(body.get("input"))
        name = body.get("model")
        choice = body.get("tool_choice")
        if not (choice in _TOOL_CHOICES or isinstance(choice, Mapping)):
            choice = "auto"
        parallel = body.get("parallel_tool_calls")
        options = {
            "tools": shown,
            "tool_choice": choice,
            "parallel_tool_calls": parallel if isinstance(parallel, bool) else True,
            "previous_response_id": previous_id,
            # Echoed in the response when of the type it has there.
            **{key: _kept(body, key, Mapping) for key in ("metadata", "reasoning", "text")},
            "store": _kept(body, "store", bool),
            "user": _kept(body, "user", str),
        }
        return DialectCall(
            messages=messages,
            tools=tools,
            args=_args(body, generation_args),
            model=name if isinstance(name, str) else model,
            stream=body.get("stream") is True,
            options=options,
            system=system,
            previous=_previous(previous_id),
        )

    def answer(
        self, reply: Mapping[str, Any], call: DialectCall
    ) -> HTTPResponse | StreamingResponse:
        response = response_object(reply, call)
        if call.stream:
            return streamed(response_events(response))
        return json_response(200, response)

    def error(self, error: GatewayError) -> HTTPResponse:
        # The session names the reply by its chat id; the client sent its response id.
        message = _UNKNOWN_PREVIOUS.sub(r"previous response 'resp_\1'", str(error))
        return json_response(error.status, GatewayError(error.status, message, error.type).body())


# --------------------------------------------------------------------------- the request


def _kept(body: Mapping[str, Any], key: str, kind: type) -> Any:
    """``body[key]`` if it is a ``kind``, else ``None``."""
    value = body.get(key)
    return value if isinstance(value, kind) else None


def _previous(value: object) -> str | None:
    """The chat reply id a ``previous_response_id`` names (``None`` for none)."""
    if value is None:
        return None
    match = _RESPONSE_ID.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        msg = (
            f"previous_response_id must be the id of a response this session gave "
            f"('resp_' and hex digits), got {value!r:.80}"
        )
        raise GatewayError(400, msg)
    return f"chatcmpl-{match[1]}"


def _args(body: Mapping[str, Any], base: GenerationArgs) -> GenerationArgs:
    """``base`` with the fields it leaves unset from the body's sampling."""
    given = {field: body[key] for key, field in _SAMPLING.items() if body.get(key) is not None}
    try:
        return body_args(given, base)
    except GatewayError as exc:
        # The body's name for the field, not the chat one.
        message = re.sub(r"\bmax_tokens\b", "max_output_tokens", str(exc))
        raise GatewayError(400, message) from None


def _tools(value: object) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The body's ``tools``: as chat tools (``None`` for none), and as the response
    echoes them."""
    if value is None or value == []:
        return None, []
    if not isinstance(value, list):
        msg = f"tools must be a list of function tools, got {value!r:.80}"
        raise GatewayError(400, msg)
    chat: list[dict[str, Any]] = []
    shown: list[dict[str, Any]] = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise GatewayError(400, f"{where} must be a tool object, got {tool!r:.80}")
        kind = tool.get("type")
        if kind != "function":
            msg = (
                f"{where}.type must be 'function': the gateway serves function tools only "
                f"(built-in tools such as web_search or file_search run on OpenAI's "
                f"servers), got {kind!r:.40}"
            )
            raise GatewayError(400, msg)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            msg = f"{where}.name must be a non-empty string, got {name!r:.80}"
            raise GatewayError(400, msg)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            msg = f"{where}.description must be a string or null, got {description!r:.80}"
            raise GatewayError(400, msg)
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            msg = f"{where}.parameters must be a JSON schema object or null, got {parameters!r:.80}"
            raise GatewayError(400, msg)
        # Built the same way each time: equal tools give equal chat tools (no break).
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        if parameters is not None:
            function["parameters"] = dict(parameters)
        chat.append({"type": "function", "function": function})
        strict = tool.get("strict")
        shown.append(
            {
                "type": "function",
                "name": name,
                "description": description,
                "parameters": parameters,
                "strict": strict if isinstance(strict, bool) else None,
            }
        )
    return chat, shown


def _input(value: object) -> list[ChatMessage]:
    """The body's ``input`` as chat messages (see the module's docstring)."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not isinstance(value, list) or not value:
        msg = (
            f"input must be a string or a non-empty list of input items "
            f"({', '.join(_ITEM_TYPES)}), got {value!r:.80}"
        )
        raise GatewayError(400, msg)
    messages: list[ChatMessage] = []
    # The assistant message being built (its text, its calls), and reasoning waiting
    # for the assistant message after it.
    turn: ChatMessage | None = None
    reasoning: list[str] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise GatewayError(400, f"{where} must be an input item object, got {item!r:.80}")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "reasoning":
            reasoning.extend(_reasoning(item))
            turn = None
            continue
        if kind == "message" and item.get("role") == "assistant":
            text = _text(item.get("content"), f"{where}.content")
            turn = _assistant(text, reasoning)
            messages.append(turn)
        elif kind == "function_call":
            if turn is None:
                turn = _assistant("", reasoning)
                messages.append(turn)
            turn.extra.setdefault("tool_calls", []).append(_call(item, where))
        else:
            messages.append(_message(item, kind, where))
            turn = None
        reasoning = []
    if not messages:
        msg = f"input holds no message, function_call or function_call_output, got {value!r:.80}"
        raise GatewayError(400, msg)
    return messages


def _message(item: Mapping[str, Any], kind: object, where: str) -> ChatMessage:
    """A user, system or developer message, or a ``function_call_output``'s tool message."""
    if kind == "function_call_output":
        call_id = _call_id(item, where)
        content = _text(item.get("output"), f"{where}.output")
        return ChatMessage(role="tool", content=content, extra={"tool_call_id": call_id})
    if kind != "message":
        msg = (
            f"{where}.type must be one of {list(_ITEM_TYPES)} (the gateway renders text "
            f"and function calls), got {kind!r:.40}"
        )
        raise GatewayError(400, msg)
    role = item.get("role")
    if role not in _ROLES:
        msg = f"{where}.role must be one of {list(_ROLES)}, got {role!r:.40}"
        raise GatewayError(400, msg)
    if role == "developer" and role not in ChatMessage.allowed_roles():
        # As the chat dialect: the system message, unless the renderer has the role.
        role = "system"
    return ChatMessage(role=str(role), content=_text(item.get("content"), f"{where}.content"))


def _assistant(text: str, reasoning: list[str]) -> ChatMessage:
    extra: dict[str, Any] = {}
    if reasoning:
        extra["reasoning_content"] = "".join(reasoning)
    return ChatMessage(role="assistant", content=text, extra=extra)


def _call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as an OpenAI chat tool call."""
    call_id = _call_id(item, where)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise GatewayError(400, f"{where}.name must be a non-empty string, got {name!r:.80}")
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_id(item: Mapping[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        msg = f"{where}.call_id must be a non-empty string, got {call_id!r:.80}"
        raise GatewayError(400, msg)
    return call_id


def _text(content: object, where: str) -> str:
    """Text content: a string, or a list of ``input_text`` / ``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        msg = f"{where} must be a string or a list of text parts, got {content!r:.80}"
        raise GatewayError(400, msg)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, Mapping) else None
            msg = (
                f"{where}[{j}].type must be one of {list(_TEXT_PARTS)} (the gateway renders "
                f"text only), got {kind!r:.40} in {part!r:.80}"
            )
            raise GatewayError(400, msg)
        text = part.get("text")
        if not isinstance(text, str):
            raise GatewayError(400, f"{where}[{j}].text must be a string, got {text!r:.80}")
        texts.append(text)
    return "".join(texts)


def _reasoning(item: Mapping[str, Any]) -> list[str]:
    """The text of a reasoning item's ``reasoning_text`` parts (its summary is not the
    reasoning; encrypted content is not readable)."""
    content = item.get("content")
    if not isinstance(content, list):
        return []
    return [
        part["text"]
        for part in content
        if isinstance(part, Mapping)
        and part.get("type") == "reasoning_text"
        and isinstance(part.get("text"), str)
    ]


# --------------------------------------------------------------------------- the reply


def response_object(reply: Mapping[str, Any], call: DialectCall) -> dict[str, Any]:
    """The ``response`` object for ``reply`` (the session's ``chat.completion``)."""
    key = str(reply["id"]).removeprefix("chatcmpl-")
    choice = reply["choices"][0]
    message = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        output.append(
            {
                "id": f"rs_{key}",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": status,
            }
        )
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if content or not calls:
        # Also an empty reply has its message: sent back, it is the reply the session gave.
        text: dict[str, Any] = {
            "type": "output_text",
            "text": content,
            "annotations": [],
            "logprobs": [],
        }
        output.append(
            {
                "id": f"msg_{key}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [text],
            }
        )
    for index, tool_call in enumerate(calls):
        function = tool_call["function"]
        output.append(
            {
                "id": f"fc_{key}_{index}",
                "type": "function_call",
                "call_id": tool_call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    usage = reply["usage"]
    options = call.options
    return {
        "id": f"resp_{key}",
        "object": "response",
        "created_at": reply["created"],
        "status": status,
        "completed_at": None if incomplete else reply["created"],
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": call.system,
        "max_output_tokens": call.args.max_tokens,
        "metadata": options.get("metadata") or {},
        "model": call.model,
        "output": output,
        "parallel_tool_calls": options.get("parallel_tool_calls", True),
        "previous_response_id": options.get("previous_response_id"),
        "reasoning": options.get("reasoning"),
        "service_tier": "default",
        "store": options.get("store") is not False,
        "temperature": call.args.temperature,
        "text": options.get("text") or {"format": {"type": "text"}},
        "tool_choice": options.get("tool_choice", "auto"),
        "tools": list(options.get("tools", ())),
        "top_p": call.args.top_p,
        "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "user": options.get("user"),
    }


def response_events(response: Mapping[str, Any]) -> list[bytes]:
    """The server-sent events streaming ``response`` (a :func:`response_object`), as
    OpenAI sends them (see the module's docstring)."""
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        data = {"type": kind, "sequence_number": len(events), **fields}
        events.append(b"event: " + kind.encode() + b"\n" + sse_event(data))

    started = {
        **response,
        "status": "in_progress",
        "completed_at": None,
        "incomplete_details": None,
        "output": [],
        "usage": None,
    }
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        kind = item["type"]
        at = {"item_id": item["id"], "output_index": index}
        if kind == "function_call":
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            if item["arguments"]:
                emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit(
                "response.function_call_arguments.done",
                **at,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:  # a message or reasoning: one part of text
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "content": [], "status": "in_progress"},
            )
            (part,) = item["content"]
            at = {**at, "content_index": 0}
            emit("response.content_part.added", **at, part={**part, "text": ""})
            text = part["text"]
            if kind == "message":
                if text:
                    emit("response.output_text.delta", **at, delta=text, logprobs=[])
                emit("response.output_text.done", **at, text=text, logprobs=[])
            else:
                if text:
                    emit("response.reasoning_text.delta", **at, delta=text)
                emit("response.reasoning_text.done", **at, text=text)
            emit("response.content_part.done", **at, part=part)
        emit("response.output_item.done", output_index=index, item=item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    emit(final, response=response)
    return events
