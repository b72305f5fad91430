"""The Anthropic Messages dialect: the real anthropic SDK against ``POST .../v1/messages``.

``anthropic.AsyncAnthropic`` (httpx and anyio) runs on Trio as it is, pointed at the
session's base URL without its ``/v1`` (the SDK appends ``/v1/messages``), on the
embedded backend (token-in, code points) with the plain renderer. Real sockets on
127.0.0.1 and the real clock; every wait bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import pytest
import trio

import trio_rollouts as tr
from trio_rollouts import ChatMessage, GenerationArgs, PlainRenderer, Problem
from trio_rollouts.gateway import GatewayError, serve
from trio_rollouts.gateway._anthropic import MessagesDialect
from trio_rollouts.inference import EmbeddedInference, LatencyModel

R = PlainRenderer()
LIMIT = 30.0
FAST = LatencyModel(first_token=0.0, per_token=0.0)
PROBLEM = Problem(problem_id="p1", prompt="calculate 2+3", answer=5)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
THOUGHT = "<think>Adding.</think>"
BROKEN = "<tool_call>not json</tool_call>"
SCHEMA = {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}
TOOLS: Any = [{"name": "calculator", "description": "Evaluate arithmetic.", "input_schema": SCHEMA}]
CHAT_TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": SCHEMA,
        },
    }
]
DIALECT = MessagesDialect()
USER: Any = [{"role": "user", "content": "hi"}]

#: The SDKs leave their SSE generators (and their HTTP clients' byte streams) unexhausted
#: when a stream ends, and Trio warns when it finalizes them: the SDKs', not the gateway's.
SDK_STREAM_GENERATORS = pytest.mark.filterwarnings(
    r"ignore:Async generator '(anthropic|httpx2|httpcore2)\.:ResourceWarning"
)


def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """Answers a tool result; thinks, then calls the calculator, for "calculate"; thinks
    and answers for "think"; writes a call it cannot parse for "broken"; else greets."""
    last = messages[-1]
    if last.role == "tool":
        return [f"The answer is {last.content}."], [1.0]
    if "calculate" in last.content:
        return [THOUGHT + CALL], [1.0]
    if "broken" in last.content:
        return [BROKEN], [1.0]
    if "think" in last.content:
        return [THOUGHT + "The sum is 5."], [1.0]
    return ["Hello there."], [1.0]


def backend() -> EmbeddedInference:
    return EmbeddedInference(policy=policy, seed=0, latency=FAST)


def client(session: tr.gateway.GatewaySession, **options: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=session.base_url.removesuffix("/v1"),
        api_key=session.api_key,
        max_retries=0,
        **options,
    )


def sampled_text(rollout: tr.TokenRollout) -> list[str]:
    """Each element's sampled characters (the plain renderer's ids are code points)."""
    return [
        "".join(chr(i) for i, m in zip(ids, mask, strict=True) if m)
        for ids, mask in zip(rollout.trajectory, rollout.generation_mask or [], strict=True)
    ]


async def tool_agent(sdk: anthropic.AsyncAnthropic, *, stream: bool = False) -> list[Any]:
    """An agent as people write them for Anthropic's API: a tool loop, echoing each
    reply's content blocks back and answering its tool_use blocks with tool_result."""
    messages: list[Any] = [{"role": "user", "content": PROBLEM.prompt}]
    replies = []
    for _ in range(4):
        if stream:
            async with sdk.messages.stream(
                model="policy", max_tokens=256, messages=messages, tools=TOOLS
            ) as events:
                reply: Any = await events.get_final_message()
        else:
            reply = await sdk.messages.create(
                model="policy", max_tokens=256, messages=messages, tools=TOOLS
            )
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            break
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                value = str(sum(int(term) for term in block.input["expression"].split("+")))
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": value})
        messages.append({"role": "user", "content": results})
    if stream:
        gc.collect()  # the SDK's unexhausted generators are finalized under this test's filter
    return replies


def dumped(message: Any) -> dict[str, Any]:
    """A message as plain data, without its (random) id."""
    data: dict[str, Any] = message.model_dump(exclude_none=True)
    data.pop("id")
    for block in data["content"]:
        block.pop("parsed_output", None)
    return data


async def raw(url: str, body: Any, headers: Any = None) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(url, content=json.dumps(body).encode(), headers=headers)


def anthropic_error(response: httpx.Response) -> dict[str, Any]:
    """The error of an Anthropic-shaped error response (checked to hold the OpenAI shape)."""
    data = response.json()
    assert data["type"] == "error"
    error: dict[str, Any] = data["error"]
    assert set(error) == {"type", "message", "code"}
    assert error["code"] == response.status_code
    return error


# --------------------------------------------------------------------------- calls


async def test_a_plain_call_is_an_anthropic_message() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            reply = await sdk.messages.create(
                model="claude-x",
                max_tokens=64,
                system="Be brief.",
                messages=[{"role": "user", "content": "hi"}],
                metadata={"user_id": "u1"},
                tool_choice={"type": "auto"},
                service_tier="auto",
            )
            await sdk.close()
    assert isinstance(reply, anthropic.types.Message)
    assert reply.id.startswith("msg_")
    assert len(reply.id) > len("msg_") + 16
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", "claude-x")
    assert [block.model_dump(exclude_none=True) for block in reply.content] == [
        {"type": "text", "text": "Hello there."}
    ]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    assert reply.usage.output_tokens == len("Hello there.")
    assert reply.usage.cache_read_input_tokens == reply.usage.cache_creation_input_tokens == 0
    rollout = session.rollout(1.0)
    (ids,) = rollout.trajectory
    # The system prompt is the conversation's first message; input_tokens is all before the reply.
    assert R.decode(ids).startswith("<|system|>\nBe brief.\n<|user|>\nhi\n")
    assert reply.usage.input_tokens == len(ids) - len("Hello there.")


async def test_a_tool_loop_is_one_exact_element_with_no_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            first, last = await tool_agent(sdk)
            await sdk.close()
    assert first.stop_reason == "tool_use"
    thinking, call = first.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "Adding.", "")
    assert (call.type, call.id, call.name) == ("tool_use", "call_1_0", "calculator")
    assert call.input == {"expression": "2+3"}
    assert last.stop_reason == "end_turn"
    assert [block.text for block in last.content] == ["The answer is 5."]
    rollout = session.rollout(1.0)
    assert rollout.fidelity == "exact"
    assert rollout.extra["gateway"]["calls"] == 2
    assert rollout.extra["gateway"]["breaks"] == 0
    assert rollout.extra["gateway"]["tool_calls"] == 1
    assert sampled_text(rollout) == [THOUGHT + CALL + "The answer is 5."]
    text = R.decode(rollout.trajectory[0])
    assert text.startswith("<|tools|>\n" + json.dumps(CHAT_TOOLS) + "\n")
    assert "<|tool|>\n5\n<|assistant|>\nThe answer is 5." in text
    assert first.usage.output_tokens == len(THOUGHT + CALL)


@SDK_STREAM_GENERATORS
async def test_messages_stream_accumulates_the_message_create_gives() -> None:
    async def run(stream: bool) -> list[Any]:
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            replies = await tool_agent(sdk, stream=stream)
            await sdk.close()
        assert session.rollout(1.0).extra["gateway"]["breaks"] == 0
        return replies

    with trio.fail_after(LIMIT):
        whole, streamed = await run(False), await run(True)
    assert [dumped(message) for message in streamed] == [dumped(message) for message in whole]
    assert [message.stop_reason for message in streamed] == ["tool_use", "end_turn"]


@SDK_STREAM_GENERATORS
async def test_raw_stream_events_are_anthropics_and_add_up_to_the_message() -> None:
    """``stream=True`` gives the raw events; accumulated by hand, they are the message."""
    messages: Any = [{"role": "user", "content": "calculate, then say so"}]
    with trio.fail_after(LIMIT):
        async with (
            serve(backend(), R) as gw,
            gw.session(PROBLEM) as one,
            gw.session(PROBLEM) as other,
        ):
            sdk = client(one)
            whole = await sdk.messages.create(
                model="m", max_tokens=256, messages=messages, tools=TOOLS
            )
            await sdk.close()
            sdk = client(other)
            stream = await sdk.messages.create(
                model="m", max_tokens=256, messages=messages, tools=TOOLS, stream=True
            )
            events = [event async for event in stream]
            await sdk.close()
            gc.collect()
            response = await raw(
                other.base_url + "/messages",
                {"model": "m", "max_tokens": 256, "messages": messages, "stream": True},
            )
    assert [event.type for event in events] == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta"],
        "content_block_stop",
        *["content_block_start", "content_block_delta", "content_block_stop"],
        "message_delta",
        "message_stop",
    ]
    start = events[0].message
    assert (start.content, start.stop_reason, start.usage.output_tokens) == ([], None, 0)
    message: dict[str, Any] = start.model_dump(exclude_none=True)
    partial: dict[int, str] = {}
    for event in events[1:]:
        if event.type == "content_block_start":
            message["content"].append(event.content_block.model_dump(exclude_none=True))
        elif event.type == "content_block_delta":
            block, delta = message["content"][event.index], event.delta
            if delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] = delta.signature
            elif delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + delta.partial_json
                block["input"] = json.loads(partial[event.index])
        elif event.type == "message_delta":
            message["stop_reason"] = event.delta.stop_reason
            message["usage"]["output_tokens"] = event.usage.output_tokens
    expected = whole.model_dump(exclude_none=True)
    message["id"] = expected["id"]
    assert message == expected
    # On the wire: each event is "event: <type>" then its data, whose type is the same.
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-1] == ""
    for frame in frames[:-1]:
        head, data = frame.split("\n")
        assert head.startswith("event: ")
        assert data.startswith("data: ")
        assert json.loads(data.removeprefix("data: "))["type"] == head.removeprefix("event: ")


@SDK_STREAM_GENERATORS
async def test_a_thinking_reply_streams_and_echoes_back_without_a_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            messages: list[Any] = [{"role": "user", "content": "think"}]
            async with sdk.messages.stream(model="m", max_tokens=64, messages=messages) as events:
                first: Any = await events.get_final_message()
            messages += [
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ]
            second: Any = await sdk.messages.create(model="m", max_tokens=64, messages=messages)
            await sdk.close()
            gc.collect()
    assert [block.type for block in first.content] == ["thinking", "text"]
    assert first.content[0].thinking == "Adding."
    assert first.content[0].signature == ""
    assert first.content[1].text == "The sum is 5."
    assert [block.text for block in second.content] == ["Hello there."]
    rollout = session.rollout(1.0)
    assert rollout.extra["gateway"]["breaks"] == 0
    assert sampled_text(rollout) == [THOUGHT + "The sum is 5." + "Hello there."]


async def test_max_tokens_fills_the_sampling_and_a_length_stop_is_max_tokens() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            cut: Any = await sdk.messages.create(
                model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
            await sdk.close()
        # The gateway's sampling wins over the body's.
        async with (
            serve(backend(), R, generation_args=GenerationArgs(max_tokens=3)) as gw,
            gw.session(PROBLEM) as session,
        ):
            sdk = client(session)
            mine = await sdk.messages.create(
                model="m", max_tokens=100, messages=[{"role": "user", "content": "hi"}]
            )
            await sdk.close()
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 5)
    assert cut.content[0].text == "Hello"
    assert (mine.stop_reason, mine.usage.output_tokens) == ("max_tokens", 3)


def test_the_body_fills_only_the_sampling_the_gateway_leaves_unset() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 5,
        "messages": [{"role": "user", "content": "x"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    call = DIALECT.read(body, GenerationArgs(temperature=0.5), "served")
    assert call.args == GenerationArgs(temperature=0.5, top_p=0.9, top_k=5, max_tokens=64)
    assert (call.model, call.stream, call.system) == ("m", False, None)
    again = DIALECT.read({**body, "tools": TOOLS}, GenerationArgs(), "served")
    assert again.tools == CHAT_TOOLS
    assert DIALECT.read({**body, "tools": TOOLS}, GenerationArgs(), "served").tools == again.tools


def test_blocks_read_into_chat_messages_in_block_order() -> None:
    body = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": "A."}, {"type": "text", "text": " B."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Calling."},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    {"type": "tool_use", "id": "t2", "name": "g", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                    {"type": "text", "text": "between"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "failed"}],
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "and "},
                    {"type": "text", "text": "after"},
                ],
            },
        ],
    }
    call = DIALECT.read(body, GenerationArgs(), "m")
    assert call.system == "A. B."
    empty = {"max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": []}, *USER]}
    assert DIALECT.read(empty, GenerationArgs(), "m").messages[1] == ChatMessage(
        role="assistant", content=""
    )
    calls = [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert call.messages == [
        ChatMessage(role="user", content="q"),
        ChatMessage(
            role="assistant",
            content="Calling.",
            extra={"tool_calls": calls, "reasoning_content": "hm"},
        ),
        ChatMessage(role="tool", content="one", extra={"tool_call_id": "t1"}),
        ChatMessage(role="user", content="between"),
        ChatMessage(role="tool", content="failed", extra={"tool_call_id": "t2"}),
        ChatMessage(role="user", content="and after"),
    ]


async def test_a_broken_call_has_an_empty_input_and_echoing_it_is_a_break() -> None:
    """A call the renderer cannot read has no JSON object to give as ``input``: it is
    ``{}``, and the agent echoing ``{}`` back did not send what was sampled (a break)."""
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            messages: list[Any] = [{"role": "user", "content": "broken"}]
            first = await sdk.messages.create(model="m", max_tokens=64, messages=messages)
            (call,) = first.content
            assert call.type == "tool_use"
            messages += [
                {"role": "assistant", "content": first.content},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "bad call"}
                    ],
                },
            ]
            await sdk.messages.create(model="m", max_tokens=64, messages=messages)
            await sdk.close()
    assert (call.input, first.stop_reason) == ({}, "tool_use")
    assert session.rollout(1.0).extra["gateway"]["breaks"] == 1


# --------------------------------------------------------------------------- sessions


async def test_a_session_by_header_on_the_gateway_root() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session, gw.session():
            sdk = anthropic.AsyncAnthropic(
                base_url=gw.url,
                api_key=session.api_key,
                default_headers={"X-Session-ID": session.id},
                max_retries=0,
            )
            await tool_agent(sdk)
            await sdk.close()
    rollout = session.rollout(1.0)
    assert rollout.extra["gateway"]["calls"] == 2
    assert rollout.extra["gateway"]["breaks"] == 0


async def test_the_api_key_goes_as_x_api_key_and_a_wrong_one_is_an_authentication_error() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, api_key="s3cret") as gw, gw.session(PROBLEM) as session:
            wrong = anthropic.AsyncAnthropic(
                base_url=session.base_url.removesuffix("/v1"), api_key="nope", max_retries=0
            )
            with pytest.raises(anthropic.AuthenticationError, match="wrong API key") as caught:
                await wrong.messages.create(
                    model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
                )
            await wrong.close()
            sdk = client(session)
            assert session.api_key == "s3cret"
            good = await sdk.messages.create(
                model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
            )
            await sdk.close()
    assert caught.value.status_code == 401
    assert caught.value.type == "authentication_error"
    assert good.stop_reason == "end_turn"


async def test_a_rewritten_history_is_a_counted_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            first = await sdk.messages.create(
                model="m", max_tokens=256, messages=[{"role": "user", "content": "calculate"}]
            )
            # A summarising harness replaces the tool call by a sentence.
            await sdk.messages.create(
                model="m",
                max_tokens=256,
                messages=[
                    {"role": "user", "content": "calculate"},
                    {"role": "assistant", "content": "I used the calculator."},
                    {"role": "user", "content": "go on"},
                ],
            )
            await sdk.close()
    assert first.stop_reason == "tool_use"
    rollout = session.rollout(1.0)
    assert rollout.extra["gateway"]["breaks"] == 1
    assert len(rollout.trajectory) == 2


async def test_a_chat_call_continued_by_a_messages_call_has_no_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            chat = openai.AsyncOpenAI(
                base_url=session.base_url, api_key=session.api_key, max_retries=0
            )
            completion = await chat.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "calculate"}], tools=CHAT_TOOLS
            )
            await chat.close()
            (call,) = completion.choices[0].message.tool_calls or []
            assert call.type == "function"
            sdk = client(session)
            reply: Any = await sdk.messages.create(
                model="m",
                max_tokens=256,
                tools=TOOLS,
                messages=[
                    {"role": "user", "content": "calculate"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "Adding.", "signature": ""},
                            {
                                "type": "tool_use",
                                "id": call.id,
                                "name": "calculator",
                                "input": {"expression": "2+3"},
                            },
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": call.id, "content": "5"}
                        ],
                    },
                ],
            )
            await sdk.close()
    assert [block.text for block in reply.content] == ["The answer is 5."]
    rollout = session.rollout(1.0)
    assert rollout.extra["gateway"]["calls"] == 2
    assert rollout.extra["gateway"]["breaks"] == 0
    assert sampled_text(rollout) == [THOUGHT + CALL + "The answer is 5."]


# --------------------------------------------------------------------------- errors


async def test_refusals_are_anthropic_errors_naming_the_field() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw:
            async with gw.session(PROBLEM) as session:
                sdk = client(session)
                with pytest.raises(
                    anthropic.BadRequestError, match="web_search_20250305"
                ) as server:
                    await sdk.messages.create(
                        model="m",
                        max_tokens=8,
                        messages=USER,
                        tools=[{"type": "web_search_20250305", "name": "web_search"}],
                    )
                with pytest.raises(
                    anthropic.BadRequestError, match=r"messages\[0\]\.content\[1\]\.type='image'"
                ):
                    await sdk.messages.create(
                        model="m",
                        max_tokens=8,
                        messages=[
                            {"role": "user", "content": [{"type": "text", "text": "see"}, image]}
                        ],
                    )
                with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
                    await sdk.messages.create(
                        model="m", max_tokens=8, messages=USER, stop_sequences=["\n"]
                    )
                with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
                    await sdk.messages.create(
                        model="m",
                        max_tokens=8,
                        messages=USER,
                        tools=TOOLS,
                        tool_choice={"type": "any"},
                    )
                with pytest.raises(anthropic.BadRequestError, match="prefill"):
                    await sdk.messages.create(
                        model="m",
                        max_tokens=8,
                        messages=[*USER, {"role": "assistant", "content": "The answer is"}],
                    )
                url = session.base_url + "/messages"
                no_max = await raw(url, {"model": "m", "messages": USER})
                bad_max = await raw(url, {"model": "m", "max_tokens": 0, "messages": USER})
                unknown = await raw(
                    f"{gw.url}/sessions/nope/v1/messages", {"max_tokens": 8, "messages": USER}
                )
                await sdk.close()
            sdk = client(session)  # the session is left: closed
            with pytest.raises(anthropic.ConflictError, match="closed") as closed:
                await sdk.messages.create(model="m", max_tokens=8, messages=USER)
            await sdk.close()
    assert server.value.type == "invalid_request_error"
    body: Any = server.value.body
    assert body["error"]["code"] == 400
    assert no_max.status_code == 400
    assert "max_tokens: field required" in anthropic_error(no_max)["message"]
    assert bad_max.status_code == 400
    assert "max_tokens must be a positive integer, got 0" in anthropic_error(bad_max)["message"]
    assert unknown.status_code == 404
    assert anthropic_error(unknown)["type"] == "not_found_error"
    assert closed.value.type == "invalid_request_error"
    assert session.calls == 0


def test_error_types_are_anthropics_and_keep_the_status_as_code() -> None:
    cases = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        405: "invalid_request_error",
        409: "invalid_request_error",
        500: "api_error",
    }
    for status, kind in cases.items():
        response = DIALECT.error(GatewayError(status, f"status {status}"))
        assert response.status == status
        assert json.loads(response.body) == {
            "type": "error",
            "error": {"type": kind, "message": f"status {status}", "code": status},
        }


def test_bad_bodies_are_400s_naming_the_field_and_the_value() -> None:
    def refused(**fields: Any) -> str:
        body = {"max_tokens": 8, "messages": USER, **fields}
        with pytest.raises(GatewayError) as caught:
            DIALECT.read(body, GenerationArgs(), "m")
        assert caught.value.status == 400
        return str(caught.value)

    assert "messages must be a non-empty list" in refused(messages=[])
    assert "messages[0].content must be a string or a non-empty list" in refused(
        messages=[{"role": "user", "content": []}]
    )
    assert "messages[0].role must be 'user' or 'assistant'" in refused(
        messages=[{"role": "system", "content": "x"}]
    )
    assert "'tool_use'" in refused(
        messages=[
            {
                "role": "user",
                "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
            }
        ]
    )
    assert "messages[0].content[0].input must be an object" in refused(
        messages=[
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 3}],
            },
            *USER,
        ]
    )
    assert "tool_use_id must be a non-empty string" in refused(
        messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]
    )
    assert "content[0].content[0].type='image'" in refused(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}
                ],
            }
        ]
    )
    assert "system must be a string or a list of text blocks, got 3" in refused(system=3)
    assert "tools[0].input_schema must be a JSON schema object" in refused(tools=[{"name": "f"}])
    assert "temperature" in refused(temperature=-1.0)


async def test_count_tokens_counts_the_prompt_the_next_call_would_send_and_commits_nothing() -> (
    None
):
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            conversation: Any = [{"role": "user", "content": "calculate 2+3"}]
            counted = await sdk.messages.count_tokens(
                model="claude-x", system="Be brief.", messages=conversation, tools=TOOLS
            )
            assert session.calls == 0  # counting generates and commits nothing
            reply = await sdk.messages.create(
                model="claude-x",
                max_tokens=64,
                system="Be brief.",
                messages=conversation,
                tools=TOOLS,
            )
            await sdk.close()
    assert counted.input_tokens == reply.usage.input_tokens > 0
    assert session.calls == 1


async def test_count_tokens_errors_are_anthropics() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            with pytest.raises(anthropic.BadRequestError, match="image"):
                await sdk.messages.count_tokens(
                    model="claude-x",
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "image",
                                    "source": {
                                        "type": "base64",
                                        "media_type": "image/png",
                                        "data": "AA==",
                                    },
                                }
                            ],
                        }
                    ],
                )
            await sdk.close()
