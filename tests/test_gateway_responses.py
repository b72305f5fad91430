"""The gateway's OpenAI Responses dialect (``POST {base_url}/responses``): the real openai
SDK (``client.responses.create``, streamed and not, its stream accumulator) and the OpenAI
Agents SDK with its defaults (the Responses API), against ``trio_rollouts.gateway.serve``
on the embedded backend (token-in, code points) with the plain renderer.

What is checked is the session: every call committed, no break over a tool loop whichever
way the client continues it (the whole input sent back, or ``previous_response_id``), and
the rollout's sampled ids exactly what the backend sampled. Real sockets on 127.0.0.1;
everything that waits is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import gc
import importlib.util
import json
from typing import Any

import httpx2 as httpx
import openai
import pydantic
import pytest
import trio
from openai.types.responses import Response, ResponseStreamEvent

import trio_rollouts as tr
from trio_rollouts import ChatMessage, GenerationArgs, PlainRenderer, Problem
from trio_rollouts.gateway import serve
from trio_rollouts.gateway._asyncio import run_in_asyncio
from trio_rollouts.gateway._responses import ResponsesDialect, response_object
from trio_rollouts.inference import EmbeddedInference, LatencyModel

R = PlainRenderer()
PROBLEM = Problem(problem_id="p1", prompt="What is 2+3?", answer=5)
#: The calculator as a Responses function tool, and as the same tool in chat's shape.
TOOL: Any = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
    "strict": True,
}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {key: TOOL[key] for key in ("name", "description", "parameters")},
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
THOUGHT = "<think>2 and 3 make 5; check it.</think>"
ANSWER = "The answer is 5."
LIMIT = 30.0
FAST = LatencyModel(first_token=0.0, per_token=0.0)
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)

#: The openai SDK leaves its SSE generators (and its HTTP client's byte streams) unclosed
#: at the end of a stream; Trio warns when it finalizes them: the SDK's, not the gateway's.
SDK_STREAM_GENERATORS = [
    pytest.mark.filterwarnings(f"ignore:Async generator '{module}:ResourceWarning")
    for module in ("openai._streaming", "httpx2._models", "httpcore2._async")
]


def agentic(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """Calls the calculator first, answers with the tool's result after."""
    last = messages[-1]
    if last.role == "tool":
        return [f"The answer is {last.content}."], [1.0]
    return [CALL], [1.0]


def thinking(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
    """As :func:`agentic`, reasoning before the call."""
    texts, weights = agentic(messages)
    return [text if messages[-1].role == "tool" else THOUGHT + text for text in texts], weights


def backend(policy: Any = agentic) -> EmbeddedInference:
    return EmbeddedInference(policy=policy, seed=0, latency=FAST)


def client(session: tr.gateway.GatewaySession) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)


def calculate(arguments: str) -> str:
    expression = json.loads(arguments)["expression"]
    return str(sum(int(term) for term in expression.split("+")))


def sampled_text(rollout: tr.TokenRollout) -> str:
    """The rollout's one element's sampled ids, as text (the embedded ids are code points)."""
    (ids,) = rollout.trajectory
    (mask,) = rollout.generation_mask or [[]]
    return "".join(chr(i) for i, m in zip(ids, mask, strict=True) if m)


def assert_one_exact_element(
    session: tr.gateway.GatewaySession, calls: int, sampled: str
) -> tr.TokenRollout:
    rollout = session.rollout(reward=1.0)
    gateway = rollout.extra["gateway"]
    assert (gateway["calls"], gateway["breaks"]) == (calls, 0)
    assert rollout.fidelity == "exact"
    assert len(rollout.trajectory) == 1  # every call extended the last
    assert sampled_text(rollout) == sampled
    return rollout


async def raw(url: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(url, content=json.dumps(body).encode())


def error_message(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert error["type"]
    message: str = error["message"]
    return message


def parse_events(body: str) -> list[Any]:
    """The SSE body's events, each checked against the SDK's event union; each frame's
    ``event:`` is its data's type."""
    events = []
    for frame in body.strip().split("\n\n"):
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(EVENTS.validate_python(data))
    return events


# --------------------------------------------------------------------------- the openai SDK


async def responses_tool_loop(sdk: openai.AsyncOpenAI, *, stream: bool) -> list[Any]:
    """The SDK's documented tool loop: the output items and the calls' outputs appended
    to the input, the whole input sent each time."""
    inputs: list[Any] = [{"role": "user", "content": PROBLEM.prompt}]
    responses = []
    for _ in range(4):
        if stream:
            events = await sdk.responses.create(
                model="policy", input=inputs, tools=[TOOL], stream=True
            )
            kinds = []
            async for event in events:
                kinds.append(event.type)
                if event.type == "response.completed":
                    response = event.response
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds[-1] == "response.completed"
        else:
            response = await sdk.responses.create(model="policy", input=inputs, tools=[TOOL])
        responses.append(response)
        inputs += response.output
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            break
        for call in calls:
            output = calculate(call.arguments)
            inputs.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": output}
            )
    return responses


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=SDK_STREAM_GENERATORS)])
async def test_an_sdk_tool_loop_sending_the_whole_input_is_one_exact_element(stream: bool) -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            first, last = await responses_tool_loop(sdk, stream=stream)
            await sdk.close()
    gc.collect()  # the SDK's unclosed stream generators are finalized under this test's filter
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call"
    assert (call.call_id, call.name, call.status) == ("call_1_0", "calculator", "completed")
    assert json.loads(call.arguments) == {"expression": "2+3"}
    assert call.id.startswith("fc_")
    assert first.id.startswith("resp_")
    assert first.usage is not None
    assert first.usage.output_tokens == len(CALL)
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    (message,) = last.output
    assert message.type == "message"
    assert message.id.startswith("msg_")
    assert last.output_text == ANSWER
    assert [tool.name for tool in last.tools] == ["calculator"]  # type: ignore[union-attr]
    rollout = assert_one_exact_element(session, 2, CALL + ANSWER)
    assert rollout.extra["gateway"]["tool_calls"] == 1


async def test_previous_response_id_continues_the_session_without_a_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            instructions = "You are a calculator."
            first = await sdk.responses.create(
                model="policy", instructions=instructions, input=PROBLEM.prompt, tools=[TOOL]
            )
            (call,) = first.output
            assert call.type == "function_call"
            last = await sdk.responses.create(
                model="policy",
                instructions=instructions,
                previous_response_id=first.id,
                input=[
                    {
                        "type": "function_call_output",
                        "call_id": call.call_id,
                        "output": calculate(call.arguments),
                    }
                ],
                tools=[TOOL],
            )
            await sdk.close()
    assert last.previous_response_id == first.id
    assert last.instructions == instructions
    assert last.output_text == ANSWER
    rollout = assert_one_exact_element(session, 2, CALL + ANSWER)
    start = R.render(
        [
            ChatMessage(role="system", content=instructions),
            ChatMessage(role="user", content=PROBLEM.prompt),
        ],
        tools=[CHAT_TOOL],
    )
    assert rollout.trajectory[0][: len(start)] == start


async def test_instructions_are_the_system_message() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            await sdk.responses.create(model="m", instructions="Be brief.", input="x")
            await sdk.close()
    rollout = session.rollout(1.0)
    prompt = R.render(
        [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="x")]
    )
    assert rollout.trajectory[0][: len(prompt)] == prompt


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=SDK_STREAM_GENERATORS)])
async def test_reasoning_is_an_output_item_and_sent_back_is_no_break(stream: bool) -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(thinking), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            first, last = await responses_tool_loop(sdk, stream=stream)
            await sdk.close()
    gc.collect()
    reasoning, call = first.output
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None
    assert [part.text for part in reasoning.content] == ["2 and 3 make 5; check it."]
    assert call.type == "function_call"
    assert last.output_text == ANSWER
    assert_one_exact_element(session, 2, THOUGHT + CALL + ANSWER)


@pytest.mark.filterwarnings("ignore:Async generator 'httpx2._models:ResourceWarning")
@pytest.mark.filterwarnings("ignore:Async generator 'httpcore2._async:ResourceWarning")
async def test_the_sdk_stream_accumulator_rebuilds_the_response() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(thinking), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            inputs: list[Any] = [{"role": "user", "content": PROBLEM.prompt}]
            async with sdk.responses.stream(model="m", input=inputs, tools=[TOOL]) as stream:
                deltas = [event async for event in stream]
                first = await stream.get_final_response()
            inputs += first.output
            (call,) = (item for item in first.output if item.type == "function_call")
            inputs.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
            async with sdk.responses.stream(model="m", input=inputs, tools=[TOOL]) as stream:
                last = await stream.get_final_response()
            whole = await sdk.responses.create(model="m", input=inputs, tools=[TOOL])
            await sdk.close()
    gc.collect()
    arguments = [
        event for event in deltas if event.type == "response.function_call_arguments.delta"
    ]
    assert [event.snapshot for event in arguments] == [call.arguments]
    assert json.loads(call.arguments) == {"expression": "2+3"}
    assert call.parsed_arguments == {"expression": "2+3"}  # the SDK parsed it: a strict tool
    assert last.output_text == ANSWER
    # What the accumulator rebuilt is what the whole response says, but for the ids.
    assert last.model_dump(exclude={"id", "created_at", "completed_at", "output"}) == (
        whole.model_dump(exclude={"id", "created_at", "completed_at", "output"})
    )
    # (The accumulator's content has "parsed": None besides.)
    assert [item.model_dump(exclude={"id"}, exclude_none=True) for item in last.output] == [
        item.model_dump(exclude={"id"}, exclude_none=True) for item in whole.output
    ]
    # The third call re-sent the second's input: a break, which is the client's doing.
    assert session.breaks == 1


async def test_the_wire_is_what_the_sdk_types_validate() -> None:
    """Whole and streamed bodies validate (not only construct) as the SDK's models; the
    stream's events are numbered in order, and its final response equals the whole one
    but for its ids."""
    body = {"model": "m", "input": PROBLEM.prompt, "tools": [TOOL]}
    with trio.fail_after(LIMIT):
        async with serve(backend(thinking), R) as gw:
            async with gw.session(PROBLEM) as session:
                whole = await raw(session.base_url + "/responses", body)
            async with gw.session(PROBLEM) as session:
                streamed = await raw(session.base_url + "/responses", {**body, "stream": True})
    assert whole.status_code == streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    response = Response.model_validate(whole.json())
    events = parse_events(streamed.text)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1].response
    assert events[0].response.status == "in_progress"
    assert events[0].response.output == []

    def shape(value: Response) -> dict[str, Any]:
        data = value.model_dump(exclude={"id", "created_at", "completed_at"})
        data["output"] = [{**item, "id": item["id"][:3]} for item in data["output"]]
        return data

    assert shape(final) == shape(response)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_cut_at_max_output_tokens_is_incomplete(stream: bool) -> None:
    body = {"model": "m", "input": "q", "max_output_tokens": 4, "stream": stream}
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            reply = await raw(session.base_url + "/responses", body)
    assert reply.status_code == 200, reply.text
    if stream:
        events = parse_events(reply.text)
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
    else:
        response = Response.model_validate(reply.json())
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == 4
    (message,) = response.output
    assert message.type == "message"
    assert message.status == "incomplete"
    assert response.output_text == CALL[:4]
    (span,) = (session.rollout(1.0).sampling or [[]])[0]
    assert span.args.max_tokens == 4


async def test_sampling_fills_what_the_gateway_leaves_unset_and_sdk_fields_are_ignored() -> None:
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "max_output_tokens": 500,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "truncation": "auto",
        "metadata": {"run": "7"},
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "user": "me",
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "stream_options": {"include_obfuscation": False},
    }
    args = GenerationArgs(temperature=1.0)
    with trio.fail_after(LIMIT):
        async with serve(backend(), R, generation_args=args) as gw, gw.session() as session:
            reply = await raw(session.base_url + "/responses", body)
    assert reply.status_code == 200, reply.text
    response = Response.model_validate(reply.json())
    assert (response.temperature, response.top_p, response.max_output_tokens) == (1.0, 0.9, 500)
    assert response.parallel_tool_calls is False
    assert response.metadata == {"run": "7"}
    (span,) = (session.rollout(1.0).sampling or [[]])[0]
    assert span.args == GenerationArgs(temperature=1.0, top_p=0.9, max_tokens=500)


def test_function_tools_read_the_same_every_time() -> None:
    dialect = ResponsesDialect()
    body = {"input": "q", "tools": [TOOL]}
    one = dialect.read(body, GenerationArgs(), "m")
    two = dialect.read(json.loads(json.dumps(body)), GenerationArgs(), "m")
    assert one.tools == two.tools == [CHAT_TOOL]
    assert json.dumps(one.tools) == json.dumps(two.tools)


def test_input_items_read_into_chat_messages() -> None:
    """An assistant message and the calls after it are one message; calls alone are one;
    reasoning goes to the assistant message after it; outputs are tool messages."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'}
    items = [
        {"role": "developer", "content": "sys"},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "let me see", "annotations": []}],
        },
        call,
        {**call, "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "2"}],
        },
        {**call, "call_id": "c3"},
        {"type": "function_call_output", "call_id": "c3", "output": "3"},
        {"role": "assistant", "content": "done"},
    ]
    call = ResponsesDialect().read({"input": items}, GenerationArgs(), "m")

    def tool_call(call_id: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'},
        }

    assert call.messages == [
        ChatMessage(role="system", content="sys"),
        ChatMessage(role="user", content="ab"),
        ChatMessage(
            role="assistant",
            content="let me see",
            extra={"reasoning_content": "hm", "tool_calls": [tool_call("c1"), tool_call("c2")]},
        ),
        ChatMessage(role="tool", content="1", extra={"tool_call_id": "c1"}),
        ChatMessage(role="tool", content="2", extra={"tool_call_id": "c2"}),
        ChatMessage(role="assistant", content="", extra={"tool_calls": [tool_call("c3")]}),
        ChatMessage(role="tool", content="3", extra={"tool_call_id": "c3"}),
        ChatMessage(role="assistant", content="done"),
    ]
    assert (call.system, call.previous, call.tools) == (None, None, None)


def test_a_reply_with_text_and_calls_is_a_message_then_its_calls() -> None:
    """Reasoning first, the text, each call; sent back, they read as the reply again."""
    calls = [
        {"id": f"call_3_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in range(2)
    ]
    reply = {
        "id": "chatcmpl-00ff",
        "created": 7,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Two calls.",
                    "tool_calls": calls,
                    "reasoning_content": "why",
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    dialect = ResponsesDialect()
    call = dialect.read({"model": "m", "input": "q"}, GenerationArgs(), "m")
    response = Response.model_validate(response_object(reply, call))
    assert [(item.type, item.id) for item in response.output] == [
        ("reasoning", "rs_00ff"),
        ("message", "msg_00ff"),
        ("function_call", "fc_00ff_0"),
        ("function_call", "fc_00ff_1"),
    ]
    assert (response.id, response.status, response.output_text) == (
        "resp_00ff",
        "completed",
        "Two calls.",
    )
    sent = [item.model_dump(exclude_none=True) for item in response.output]
    (again,) = dialect.read({"input": sent}, GenerationArgs(), "m").messages
    assert again == ChatMessage(
        role="assistant",
        content="Two calls.",
        extra={"reasoning_content": "why", "tool_calls": calls},
    )


# --------------------------------------------------------------------------- mixed dialects


async def test_a_chat_call_continued_by_a_responses_call_is_no_break() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            chat = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROBLEM.prompt}], tools=[CHAT_TOOL]
            )
            (call,) = chat.choices[0].message.tool_calls or []
            assert call.type == "function"
            inputs: list[Any] = [
                {"role": "user", "content": PROBLEM.prompt},
                {
                    "type": "function_call",
                    "call_id": call.id,
                    "name": call.function.name,
                    "arguments": call.function.arguments,
                },
                {"type": "function_call_output", "call_id": call.id, "output": "5"},
            ]
            last = await sdk.responses.create(model="m", input=inputs, tools=[TOOL])
            await sdk.close()
    assert last.output_text == ANSWER
    assert_one_exact_element(session, 2, CALL + ANSWER)


async def test_a_chat_reply_may_be_continued_by_its_response_id() -> None:
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            sdk = client(session)
            chat = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROBLEM.prompt}], tools=[CHAT_TOOL]
            )
            (call,) = chat.choices[0].message.tool_calls or []
            last = await sdk.responses.create(
                model="m",
                previous_response_id="resp_" + chat.id.removeprefix("chatcmpl-"),
                input=[{"type": "function_call_output", "call_id": call.id, "output": "5"}],
                tools=[TOOL],
            )
            await sdk.close()
    assert last.output_text == ANSWER
    assert_one_exact_element(session, 2, CALL + ANSWER)


# --------------------------------------------------------------------------- errors


async def test_errors_name_the_field_and_the_value() -> None:
    def body(**fields: Any) -> dict[str, Any]:
        return {"model": "m", "input": "q", **fields}

    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    bad = {
        "unknown_previous": body(previous_response_id="resp_0123abcd"),
        "foreign_previous": body(previous_response_id="chatcmpl-0123"),
        "web_search": body(tools=[TOOL, {"type": "web_search"}]),
        "image": body(
            input=[{"role": "user", "content": [{"type": "input_text", "text": "a"}, image]}]
        ),
        "image_output": body(
            input=[
                {"role": "user", "content": "q"},
                {"type": "function_call_output", "call_id": "c", "output": [image]},
            ]
        ),
        "role": body(input=[{"role": "tool", "content": "x"}]),
        "item": body(input=[{"type": "item_reference", "id": "msg_1"}]),
        "no_input": body(input=[]),
        "only_reasoning": body(input=[{"type": "reasoning", "id": "rs", "summary": []}]),
        "call_id": body(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
        "conversation": body(conversation="conv_1"),
        "instructions": body(instructions=["x"]),
        "max_output_tokens": body(max_output_tokens=0),
        "temperature": body(temperature=-1),
    }
    with trio.fail_after(LIMIT):
        async with serve(backend(), R) as gw, gw.session(PROBLEM) as session:
            replies = {
                name: await raw(session.base_url + "/responses", value)
                for name, value in bad.items()
            }
            sdk = client(session)
            with pytest.raises(openai.BadRequestError, match="web_search"):
                await sdk.responses.create(model="m", input="q", tools=[{"type": "web_search"}])
            await sdk.close()
    messages = {name: error_message(reply) for name, reply in replies.items()}
    expected = {
        "unknown_previous": ["'resp_0123abcd'", "not one this session gave"],
        "foreign_previous": ["previous_response_id", "'chatcmpl-0123'", "resp_"],
        "web_search": ["tools[1].type", "'web_search'", "'function'"],
        "image": ["input[0].content[1].type", "'input_image'", "input_text"],
        "image_output": ["input[1].output[0].type", "'input_image'"],
        "role": ["input[0].role", "'tool'", "'user'"],
        "item": ["input[0].type", "'item_reference'", "function_call_output"],
        "no_input": ["input must be", "[]"],
        "only_reasoning": ["input holds no message"],
        "call_id": ["input[0].call_id", "None"],
        "conversation": ["conversation='conv_1'", "previous_response_id"],
        "instructions": ["instructions must be", "['x']"],
        "max_output_tokens": ["max_output_tokens", "0"],
        "temperature": ["temperature", "-1"],
    }
    for name, parts in expected.items():
        for part in parts:
            assert part in messages[name], (name, messages[name])
    assert "chatcmpl" not in messages["unknown_previous"]


# --------------------------------------------------------------------------- the Agents SDK

needs_agents = pytest.mark.skipif(
    importlib.util.find_spec("agents") is None,
    reason="the OpenAI Agents SDK is not installed (pip install openai-agents)",
)


async def run_agents_sdk(
    session: tr.gateway.GatewaySession, *, stream: bool, chain: bool
) -> tuple[str, list[str], list[tuple[str, Any]]]:
    """An OpenAI Agents SDK agent with a function tool and its defaults (the Responses
    API, the default model and settings), run in an asyncio loop of its own; returns its
    final output, the tool's log and the bodies the SDK posted."""
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    log: list[str] = []

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as '2+3'.

        Args:
            expression: the expression.
        """
        log.append(expression)
        return str(sum(int(term) for term in expression.split("+")))

    posted: list[tuple[str, Any]] = []

    async def record(request: httpx.Request) -> None:
        posted.append((request.url.path, json.loads(request.content)))

    async def main() -> str:
        set_tracing_disabled(True)
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [record]})
        async with openai.AsyncOpenAI(
            base_url=session.base_url, api_key=session.api_key, max_retries=0, http_client=http
        ) as sdk:
            agent = Agent(name="calculator", instructions="Use the tool.", tools=[calculator])
            config = RunConfig(model_provider=OpenAIProvider(openai_client=sdk))
            if stream:
                result: Any = Runner.run_streamed(
                    agent, PROBLEM.prompt, run_config=config, auto_previous_response_id=chain
                )
                async for _ in result.stream_events():
                    pass
            else:
                result = await Runner.run(
                    agent, PROBLEM.prompt, run_config=config, auto_previous_response_id=chain
                )
            return str(result.final_output)

    output = await run_in_asyncio(main, cancel_timeout=5.0, name="agents-sdk")
    return output, log, posted


@needs_agents
@pytest.mark.parametrize(
    ("stream", "chain"),
    [(False, False), (True, False), (False, True)],
    ids=["whole", "streamed", "previous_response_id"],
)
async def test_the_openai_agents_sdk_with_its_defaults_is_one_exact_element(
    stream: bool, chain: bool
) -> None:
    from agents.models.default_models import get_default_model

    with trio.fail_after(LIMIT):
        async with serve(backend(thinking), R) as gw, gw.session(PROBLEM) as session:
            output, log, posted = await run_agents_sdk(session, stream=stream, chain=chain)
    assert output == ANSWER
    assert log == ["2+3"]
    # Its default API, model and settings; the second call sends back the first's
    # output items (or names the first response), then the tool's output.
    (path, first), (_, second) = posted
    assert path == f"/sessions/{session.id}/v1/responses"
    assert first["model"] == second["model"] == get_default_model()
    assert first["instructions"] == "Use the tool."
    assert first["tools"][0]["name"] == "calculator"
    assert bool(first.get("stream")) is bool(second.get("stream")) is stream
    kinds = [item.get("type", "message") for item in second["input"]]
    if chain:
        assert second["previous_response_id"].startswith("resp_")
        assert kinds == ["function_call_output"]
    else:
        assert "previous_response_id" not in second
        assert kinds == ["message", "reasoning", "function_call", "function_call_output"]
    rollout = assert_one_exact_element(session, 2, THOUGHT + CALL + ANSWER)
    assert rollout.extra["gateway"]["tool_calls"] == 1
    # The agent's instructions are the system message, and its tool is the chat tool.
    assert R.decode(rollout.trajectory[0]).startswith("<|tools|>\n")
    assert "Use the tool." in R.decode(rollout.trajectory[0])
