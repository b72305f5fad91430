"""The Chat Completions dialect: ``POST /v1/chat/completions``, whole or streamed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_rollouts._messages import GenerationArgs
from trio_rollouts.gateway._dialect import DialectCall, json_response, streamed
from trio_rollouts.gateway._http import HTTPResponse, StreamingResponse
from trio_rollouts.gateway._session import GatewayError, body_args, parse_messages, parse_tools
from trio_rollouts.gateway._sse import chat_completion_chunks

__all__ = ["ChatDialect"]


class ChatDialect:
    """OpenAI Chat Completions: ``messages`` and ``tools`` are the session's own terms;
    the reply is the session's ``chat.completion`` (or its ``chat.completion.chunk``
    events, with usage when ``stream_options.include_usage`` asks for it). ``n`` other
    than 1 is a 400."""

    route = "chat/completions"

    def read(
        self, body: Mapping[str, Any], generation_args: GenerationArgs, model: str
    ) -> DialectCall:
        messages = parse_messages(body.get("messages"))
        tools = parse_tools(body.get("tools"))
        n = body.get("n")
        if n is not None and n != 1:
            msg = f"n={n!r}: the gateway generates one choice per call (n must be 1)"
            raise GatewayError(400, msg)
        options = body.get("stream_options")
        usage = isinstance(options, Mapping) and options.get("include_usage") is True
        name = body.get("model")
        return DialectCall(
            messages=messages,
            tools=tools,
            args=body_args(body, generation_args),
            model=name if isinstance(name, str) else model,
            stream=body.get("stream") is True,
            options={"include_usage": usage},
        )

    def answer(
        self, reply: Mapping[str, Any], call: DialectCall
    ) -> HTTPResponse | StreamingResponse:
        if call.stream:
            usage = bool(call.options.get("include_usage"))
            return streamed(chat_completion_chunks(reply, include_usage=usage))
        return json_response(200, reply)

    def error(self, error: GatewayError) -> HTTPResponse:
        return json_response(error.status, error.body())
