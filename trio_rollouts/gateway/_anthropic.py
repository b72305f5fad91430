"""The Anthropic Messages dialect: ``POST /v1/messages``, whole or streamed.

An agent written for Anthropic's API (the ``anthropic`` SDK, a harness that speaks
Messages) is pointed at the session: ``AsyncAnthropic(base_url=<session.base_url without
its /v1>, api_key=session.api_key)``; the SDK appends ``/v1/messages`` and sends the key
as ``X-Api-Key``, which the gateway accepts.

Read (the body into the session's chat terms):

- ``system``, a string or a list of text blocks (joined with nothing between them, as the
  chat dialect joins text parts), is the call's system prompt; an empty one is none;
- a ``user`` message is a user message; its ``tool_result`` blocks are ``tool`` messages
  (``tool_call_id`` is the block's ``tool_use_id``; the content, a string or text blocks,
  is the message's; an ``is_error`` result is its text like any other), and its runs of
  text blocks user messages, all in the order of the blocks;
- an ``assistant`` message is one assistant message: its text blocks joined are the
  content, its ``tool_use`` blocks the ``tool_calls`` in OpenAI's chat shape (arguments
  ``json.dumps(input)``), its ``thinking`` blocks the ``reasoning_content`` (matching
  ignores it; a re-render after a break shows it); ``redacted_thinking`` is dropped.
  So an assistant message the agent echoes back matches the reply the session gave;
- ``tools`` (``name``, ``description``, ``input_schema``; ``type`` absent or
  ``"custom"``) become chat-shape function tools, always the same for the same input;
- ``max_tokens`` is required, as Anthropic requires it; ``temperature``, ``top_p``,
  ``top_k`` and ``max_tokens`` fill what the gateway's sampling leaves unset;
  ``metadata``, ``thinking``, ``service_tier`` and ``tool_choice`` ``{"type": "auto"}``
  are ignored.

Refused with a 400 naming the field, the value and what is allowed: a server tool (a
``tools[i].type`` such as ``web_search_20250305``: Anthropic's servers run those, the
gateway cannot); image, document and any other non-text block; ``stop_sequences``
(a stop string can end inside a token, so the reply could not be the sampled ids);
a ``tool_choice`` other than ``auto`` (the model is sampled freely: nothing forces or
forbids a tool call); a last message from the assistant (a prefill: the gateway renders
a finished assistant turn, it does not continue one).

Answered: the ``message`` object (``id`` ``msg_<hex>``, content blocks ``thinking``
(``signature: ""``), ``text``, ``tool_use`` in that order, ``stop_reason`` ``tool_use``,
``max_tokens`` or ``end_turn``, ``usage``), or, with ``stream: true``, Anthropic's
server-sent events for it (:func:`_message_events`). A tool call the renderer could not
read has its raw text as its chat ``arguments``; Anthropic's ``input`` must be an
object, so such a call's ``input`` is that text parsed when it is a JSON object, else
``{}``. An agent that sends ``{}`` back does not match what was sampled, so that call is
a break (counted): the rollout never holds ids the model did not see. Errors are
Anthropic's shape, ``{"type": "error", "error": {"type", "message", "code"}}``, which
holds the gateway's OpenAI shape too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.gateway._dialect import DialectCall, json_response, streamed
from trio_rollouts.gateway._http import HTTPResponse, StreamingResponse
from trio_rollouts.gateway._session import GatewayError, body_args
from trio_rollouts.gateway._sse import sse_event

__all__ = ["CountTokensDialect", "MessagesDialect"]

#: The body fields that set the sampling (as ``body_args`` reads them).
_SAMPLING_FIELDS: Final = ("temperature", "top_p", "top_k", "max_tokens")
#: Anthropic's error type for a status, where it is not ``invalid_request_error`` (4xx)
#: or ``api_error`` (5xx).
_ERROR_TYPES: Final = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_USER_BLOCKS: Final = ("text", "tool_result")
_ASSISTANT_BLOCKS: Final = ("text", "tool_use", "thinking", "redacted_thinking")


class MessagesDialect:
    """Anthropic Messages, on the session model (see the module's docstring)."""

    route = "messages"

    def read(
        self, body: Mapping[str, Any], generation_args: GenerationArgs, model: str
    ) -> DialectCall:
        messages = _read_messages(body.get("messages"))
        system = _read_system(body.get("system"))
        tools = _read_tools(body.get("tools"))
        _check_tool_choice(body.get("tool_choice"))
        stops = body.get("stop_sequences")
        if stops is not None and stops != []:
            msg = (
                f"stop_sequences={stops!r:.80}: the gateway cannot stop on a sequence "
                "(a stop string can end inside a token, and the reply must be the sampled "
                "ids): send [] or leave it out"
            )
            raise GatewayError(400, msg)
        max_tokens = body.get("max_tokens")
        if max_tokens is None:
            msg = (
                "max_tokens: field required (the Messages API requires max_tokens, "
                "a positive integer), got none"
            )
            raise GatewayError(400, msg)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            msg = f"max_tokens must be a positive integer, got {max_tokens!r:.40}"
            raise GatewayError(400, msg)
        sampling = {key: body[key] for key in _SAMPLING_FIELDS if key in body}
        name = body.get("model")
        return DialectCall(
            messages=messages,
            tools=tools,
            args=body_args(sampling, generation_args),
            model=name if isinstance(name, str) else model,
            stream=body.get("stream") is True,
            system=system,
        )

    def answer(
        self, reply: Mapping[str, Any], call: DialectCall
    ) -> HTTPResponse | StreamingResponse:
        message = _anthropic_message(reply)
        if call.stream:
            return streamed(_message_events(message))
        return json_response(200, message)

    def error(self, error: GatewayError) -> HTTPResponse:
        return anthropic_error(error)


class CountTokensDialect(MessagesDialect):
    """Anthropic's ``POST /v1/messages/count_tokens`` (Claude Code calls it to size its
    context): the body of a Messages call, ``max_tokens`` optional, read as one; the
    gateway answers ``{"input_tokens": N}``, ``N`` the ids the renderer makes of the
    conversation with its tools and generation prompt. Nothing is generated or
    committed."""

    route = "messages/count_tokens"

    def read(
        self, body: Mapping[str, Any], generation_args: GenerationArgs, model: str
    ) -> DialectCall:
        return super().read({"max_tokens": 1, **body}, generation_args, model)

    def answer(
        self, reply: Mapping[str, Any], call: DialectCall
    ) -> HTTPResponse | StreamingResponse:
        """The count of a reply's prompt (the gateway counts without generating, with
        :meth:`answer_count`)."""
        return self.answer_count(reply["usage"]["prompt_tokens"])

    def answer_count(self, tokens: int) -> HTTPResponse:
        return json_response(200, {"input_tokens": tokens})


def anthropic_error(error: GatewayError) -> HTTPResponse:
    """``error`` in Anthropic's error shape (which holds the OpenAI shape's fields too)."""
    body = {
        "type": "error",
        "error": {
            "type": _messages_error_type(error.status),
            "message": str(error),
            "code": error.status,
        },
    }
    return json_response(error.status, body)


def _messages_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (a 405 or a 409, which Anthropic's
    error objects do not name, is an ``invalid_request_error``)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


# --------------------------------------------------------------------------- reading


def _read_system(value: object) -> str | None:
    """The top-level ``system``: a string or a list of text blocks (``None`` if empty)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        return "".join(_text_of(block, f"system[{i}]") for i, block in enumerate(value)) or None
    msg = f"system must be a string or a list of text blocks, got {value!r:.80}"
    raise GatewayError(400, msg)


def _read_messages(value: object) -> list[ChatMessage]:
    """The body's ``messages`` as chat messages (see the module's docstring)."""
    if not isinstance(value, list) or not value:
        msg = (
            "messages must be a non-empty list of {'role': 'user' | 'assistant', "
            f"'content': ...}} objects, got {value!r:.80}"
        )
        raise GatewayError(400, msg)
    messages: list[ChatMessage] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            msg = f"{where} must be an object with role and content, got {message!r:.80}"
            raise GatewayError(400, msg)
        role = message.get("role")
        if role == "user":
            messages.extend(_user_messages(message.get("content"), where))
        elif role == "assistant":
            messages.append(_assistant_message(message.get("content"), where))
        else:
            msg = (
                f"{where}.role must be 'user' or 'assistant' (the system prompt is the "
                f"top-level system field), got {role!r:.40}"
            )
            raise GatewayError(400, msg)
    if value[-1].get("role") == "assistant":
        msg = (
            f"messages[{len(value) - 1}].role='assistant': the last message must be the "
            "user's; the gateway renders a finished assistant turn, it does not continue "
            "one (no prefill)"
        )
        raise GatewayError(400, msg)
    return messages


def _blocks_of(content: object, where: str) -> list[Mapping[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and content:
        for j, block in enumerate(content):
            if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
                msg = f"{where}.content[{j}] must be a content block with a type, got {block!r:.80}"
                raise GatewayError(400, msg)
        return content
    msg = (
        f"{where}.content must be a string or a non-empty list of content blocks, "
        f"got {content!r:.80}"
    )
    raise GatewayError(400, msg)


def _unsupported(at: str, kind: object, role: str, allowed: tuple[str, ...]) -> GatewayError:
    msg = (
        f"{at}.type={kind!r:.40}: the gateway renders text only; a {role} message's "
        f"blocks may be {', '.join(map(repr, allowed))}"
    )
    return GatewayError(400, msg)


def _text_of(block: object, at: str) -> str:
    """A text block's text (400 for any other block)."""
    if isinstance(block, Mapping) and block.get("type") == "text":
        text = block.get("text")
        if isinstance(text, str):
            return text
        msg = f"{at}.text must be a string, got {text!r:.80}"
        raise GatewayError(400, msg)
    kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
    msg = (
        f"{at}.type={kind!r:.40}: only text blocks are allowed here (the gateway renders text only)"
    )
    raise GatewayError(400, msg)


def _string_of(block: Mapping[str, Any], key: str, at: str) -> str:
    """``block[key]``, a non-empty string (400 otherwise)."""
    value = block.get(key)
    if not isinstance(value, str) or not value:
        msg = f"{at}.{key} must be a non-empty string, got {value!r:.80}"
        raise GatewayError(400, msg)
    return value


def _user_messages(content: object, where: str) -> list[ChatMessage]:
    """A user message: its tool results as ``tool`` messages and its runs of text as
    user messages, in block order."""
    messages: list[ChatMessage] = []
    texts: list[str] = []
    for j, block in enumerate(_blocks_of(content, where)):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            if texts:
                messages.append(ChatMessage(role="user", content="".join(texts)))
                texts = []
            call_id = _string_of(block, "tool_use_id", at)
            result = block.get("content")
            if result is None:
                text = ""
            elif isinstance(result, str):
                text = result
            elif isinstance(result, list):
                text = "".join(
                    _text_of(part, f"{at}.content[{k}]") for k, part in enumerate(result)
                )
            else:
                msg = f"{at}.content must be a string or a list of text blocks, got {result!r:.80}"
                raise GatewayError(400, msg)
            messages.append(ChatMessage(role="tool", content=text, extra={"tool_call_id": call_id}))
        else:
            raise _unsupported(at, kind, "user", _USER_BLOCKS)
    if texts:
        messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def _assistant_message(content: object, where: str) -> ChatMessage:
    """An assistant message as the one chat message the session's reply was (no
    blocks: an empty reply, as the session answers one)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate([] if content == [] else _blocks_of(content, where)):
        at = f"{where}.content[{j}]"
        kind = block["type"]
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, Mapping):
                msg = f"{at}.input must be an object (the tool's arguments), got {arguments!r:.80}"
                raise GatewayError(400, msg)
            name = block.get("name")
            if not isinstance(name, str):
                # Empty is allowed: the session names a call it could not read "".
                msg = f"{at}.name must be a string (the tool's name), got {name!r:.80}"
                raise GatewayError(400, msg)
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            call = {"id": _string_of(block, "id", at), "type": "function", "function": function}
            calls.append(call)
        elif kind == "thinking":
            text = block.get("thinking")
            if not isinstance(text, str):
                msg = f"{at}.thinking must be a string, got {text!r:.80}"
                raise GatewayError(400, msg)
            thinking.append(text)
        elif kind != "redacted_thinking":
            raise _unsupported(at, kind, "assistant", _ASSISTANT_BLOCKS)
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = calls
    if thinking:
        extra["reasoning_content"] = "".join(thinking)
    return ChatMessage(role="assistant", content="".join(texts), extra=extra)


def _read_tools(value: object) -> list[dict[str, Any]] | None:
    """Client tools as chat-shape function tools (``None`` for none); a server tool is
    a 400 naming its type."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        msg = f"tools must be a list of tool objects, got {value!r:.80}"
        raise GatewayError(400, msg)
    tools = []
    for i, tool in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            msg = f"{at} must be a tool object (name, description, input_schema), got {tool!r:.80}"
            raise GatewayError(400, msg)
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            msg = (
                f"{at}.type={kind!r:.60}: a server tool, which Anthropic's servers run and the "
                "gateway cannot; only client tools (name, description, input_schema; type "
                "'custom' or none) are served"
            )
            raise GatewayError(400, msg)
        function: dict[str, Any] = {"name": _string_of(tool, "name", at)}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                msg = f"{at}.description must be a string, got {description!r:.80}"
                raise GatewayError(400, msg)
            function["description"] = description
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            msg = f"{at}.input_schema must be a JSON schema object, got {schema!r:.80}"
            raise GatewayError(400, msg)
        function["parameters"] = dict(schema)
        tools.append({"type": "function", "function": function})
    return tools


def _check_tool_choice(value: object) -> None:
    """``tool_choice``: only ``auto`` (or none) can be honoured."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind != "auto":
        msg = (
            f"tool_choice={value!r:.80}: the gateway samples the model freely and cannot force "
            "or forbid a tool call; send {'type': 'auto'} or leave it out"
        )
        raise GatewayError(400, msg)


# --------------------------------------------------------------------------- answering


def _tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's chat ``arguments`` as Anthropic's ``input`` object: parsed when they
    are a JSON object, else ``{}`` (a call the renderer could not read; see the module's
    docstring)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _anthropic_message(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The Messages API's ``message`` object for the session's ``chat.completion``."""
    choice = reply["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _tool_input(function.get("arguments") or ""),
            }
        )
    if calls:
        stop = "tool_use"
    elif choice["finish_reason"] == "length":
        stop = "max_tokens"
    else:
        stop = "end_turn"
    usage = reply["usage"]
    return {
        "id": "msg_" + str(reply["id"]).removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": reply["model"],
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _event(data: Mapping[str, Any]) -> bytes:
    """One of Anthropic's server-sent events: ``event: <type>``, then the data."""
    return b"event: " + str(data["type"]).encode() + b"\n" + sse_event(data)


def _message_events(message: Mapping[str, Any]) -> list[bytes]:
    """The server-sent events Anthropic streams ``message`` (a whole ``message``
    object) in, which the anthropic SDK accumulates back into the same message:
    ``message_start`` (the message with no content, no stop reason and no output
    tokens yet); per block, ``content_block_start`` (the block empty), its deltas
    (``thinking_delta`` then ``signature_delta``, ``text_delta``, or ``input_json_delta``
    with the input as JSON) and ``content_block_stop``; ``message_delta`` (the stop
    reason and the usage); ``message_stop``."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    events = [_event({"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "thinking":
            empty: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        elif kind == "text":
            empty = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": block["text"]}]
        else:
            empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            partial = json.dumps(block["input"], ensure_ascii=False)
            deltas = [{"type": "input_json_delta", "partial_json": partial}]
        events.append(
            _event({"type": "content_block_start", "index": index, "content_block": empty})
        )
        for delta in deltas:
            events.append(_event({"type": "content_block_delta", "index": index, "delta": delta}))
        events.append(_event({"type": "content_block_stop", "index": index}))
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(_event({"type": "message_delta", "delta": stop, "usage": usage}))
    events.append(_event({"type": "message_stop"}))
    return events
