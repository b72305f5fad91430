"""The gateway's HTTP/1.1 server (``gateway/_http.py``) and its SSE chunks (``gateway/_sse.py``),
specified against real sockets on 127.0.0.1: the openai SDK and httpx2 as clients, and a raw
h11 client where a test needs exact bytes. No test waits for time to pass: each waits for an
event, or for every task to block (``wait_all_tasks_blocked``)."""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import h11
import httpx2
import openai
import pytest
import trio
import trio.testing
from openai.types.chat import (
    ChatCompletionMessageParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionToolParam,
)

from trio_rollouts.gateway._http import (
    HTTPRequest,
    HTTPResponse,
    StreamingResponse,
    serve_http,
)
from trio_rollouts.gateway._sse import SSE_DONE, chat_completion_chunks, sse_event

REPLY: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1_700_000_000,
    "model": "test-model",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Let me look that up.",
                "tool_calls": [
                    {
                        "id": "call_0_0",
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"query": "trio"}'},
                    },
                    {
                        "id": "call_0_1",
                        "type": "function",
                        "function": {"name": "clock", "arguments": "{}"},
                    },
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
}
TOOL_ONLY_REPLY: dict[str, Any] = {
    **REPLY,
    "choices": [
        {
            **REPLY["choices"][0],
            "message": {**REPLY["choices"][0]["message"], "content": None},
        }
    ],
}
TEXT_REPLY: dict[str, Any] = {
    **REPLY,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello there."},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("search", "clock")
]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

# The openai SDK (3.63) stops iterating its inner async generators at ``[DONE]`` without
# closing them, and Trio warns when they are garbage-collected: the SDK's doing, not the
# server's. Tests streaming through the SDK ignore that warning and collect the garbage
# before they end (some of it is in reference cycles), so it never reaches a later test.
sdk_stream_leaves_generators_open = pytest.mark.filterwarnings(
    r"ignore:Async generator '(openai|httpx2|httpcore2)\.:ResourceWarning"
)


# --------------------------------------------------------------------------- helpers


@asynccontextmanager
async def serving(handler: Any, **kwargs: Any) -> AsyncIterator[int]:
    """Serve ``handler`` on 127.0.0.1 for the block; yields the port."""
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(partial(serve_http, handler, "127.0.0.1", 0, **kwargs))
        yield port
        nursery.cancel_scope.cancel()


async def echo(request: HTTPRequest) -> HTTPResponse:
    """Answers with what it received."""
    received = {
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "headers": dict(request.headers),
        "body": request.body.decode(),
    }
    return HTTPResponse(200, json.dumps(received).encode())


async def iterate(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def make_openai_handler(reply: dict[str, Any]) -> Any:
    """A ``/v1/chat/completions`` that always gives ``reply``, streamed when asked."""

    async def handler(request: HTTPRequest) -> HTTPResponse | StreamingResponse:
        if request.method != "POST" or request.path != "/v1/chat/completions":
            return HTTPResponse(404, b'{"error": {"message": "no", "type": "x", "code": 404}}')
        body = json.loads(request.body)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = chat_completion_chunks(reply, include_usage=usage)
            return StreamingResponse(200, iterate(chunks))
        return HTTPResponse(200, json.dumps(reply).encode())

    return handler


@asynccontextmanager
async def openai_client(port: int) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
    ) as client:
        yield client


class RawClient:
    """One connection driven by an h11 client, for tests that need exact requests."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int) -> RawClient:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, *events: h11.Event) -> None:
        await self.stream.send_all(b"".join(self.h11.send(event) or b"" for event in events))

    async def request(
        self, method: str, target: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        all_headers = [("host", "127.0.0.1"), ("content-length", str(len(body))), *headers]
        await self.send(
            h11.Request(method=method, target=target, headers=all_headers),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some())

    async def response(self) -> tuple[h11.Response, bytes]:
        """The next final response and its body (1xx responses are skipped)."""
        head = await self.next_event()
        while isinstance(head, h11.InformationalResponse):
            head = await self.next_event()
        assert isinstance(head, h11.Response)
        body = b""
        while isinstance(event := await self.next_event(), h11.Data):
            body += event.data
        assert isinstance(event, h11.EndOfMessage)
        return head, body


async def receive_until_eof(stream: trio.SocketStream) -> bytes:
    received = b""
    while data := await stream.receive_some():
        received += data
    return received


def error_body(status: int, message: str, error_type: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "code": status}}


def client_address(response: httpx2.Response) -> Any:
    """The client side's address of the connection ``response`` came on (while it is open)."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


# --------------------------------------------------------------------------- requests


async def test_the_handler_gets_method_path_query_headers_and_body() -> None:
    async with serving(echo) as port, httpx2.AsyncClient() as client:
        response = await client.post(
            f"http://127.0.0.1:{port}/a%20b/c?x=1&y=%2F",
            content=b"hello",
            headers={"X-Custom": "Value"},
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    received = response.json()
    assert received["method"] == "POST"
    assert received["path"] == "/a%20b/c"
    assert received["query"] == "x=1&y=%2F"
    assert received["headers"]["x-custom"] == "Value"
    assert received["headers"]["content-length"] == "5"
    assert received["body"] == "hello"


async def test_a_target_without_query_has_an_empty_query() -> None:
    async with serving(echo) as port, httpx2.AsyncClient() as client:
        received = (await client.get(f"http://127.0.0.1:{port}/models")).json()
    assert (received["method"], received["path"], received["query"]) == ("GET", "/models", "")


async def test_many_requests_share_one_keep_alive_connection() -> None:
    async with serving(echo) as port, httpx2.AsyncClient() as client:
        sizes, addresses = [], set()
        for n in range(5):
            response = await client.post(f"http://127.0.0.1:{port}/n", content=b"x" * n)
            sizes.append(len(response.json()["body"]))
            addresses.add(client_address(response))
    assert sizes == list(range(5))
    assert len(addresses) == 1


async def test_the_openai_sdk_reuses_its_connection() -> None:
    async with serving(make_openai_handler(REPLY)) as port, openai_client(port) as client:
        contents, addresses = [], set()
        for _ in range(3):
            raw = await client.chat.completions.with_raw_response.create(
                model="test-model",
                messages=MESSAGES,
            )
            contents.append(raw.parse().choices[0].message.content)
            addresses.add(client_address(raw.http_response))
    assert contents == ["Let me look that up."] * 3
    assert len(addresses) == 1


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving(echo) as port:
        client = await RawClient.open(port)
        await client.stream.send_all(  # both requests before any response
            b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
        )
        received = []
        for target, body in [("/first", b""), ("/second", b"hi")]:
            # Tell the client's state machine what is already on the wire, then read.
            headers = [("host", "x"), ("content-length", str(len(body)))]
            client.h11.send(h11.Request(method="GET", target=target, headers=headers))
            client.h11.send(h11.Data(data=body))
            client.h11.send(h11.EndOfMessage())
            _, response_body = await client.response()
            received.append(json.loads(response_body))
            client.h11.start_next_cycle()
        await client.stream.aclose()
    assert [(r["method"], r["path"], r["body"]) for r in received] == [
        ("GET", "/first", ""),
        ("POST", "/second", "hi"),
    ]


async def test_a_chunked_request_body_arrives_whole() -> None:
    async with serving(echo) as port:
        client = await RawClient.open(port)
        headers = [("host", "x"), ("transfer-encoding", "chunked")]
        await client.send(
            h11.Request(method="POST", target="/chunked", headers=headers),
            h11.Data(data=b"abc"),
            h11.Data(data=b"defg"),
            h11.EndOfMessage(),
        )
        head, body = await client.response()
        await client.stream.aclose()
    assert head.status_code == 200
    assert json.loads(body)["body"] == "abcdefg"


async def test_expect_100_continue_is_answered_before_the_body_is_read() -> None:
    async with serving(echo) as port:
        client = await RawClient.open(port)
        headers = [("host", "x"), ("content-length", "4"), ("expect", "100-continue")]
        await client.send(h11.Request(method="POST", target="/e", headers=headers))
        interim = await client.next_event()
        assert isinstance(interim, h11.InformationalResponse)
        assert interim.status_code == 100
        await client.send(h11.Data(data=b"body"), h11.EndOfMessage())
        head, body = await client.response()
        await client.stream.aclose()
    assert head.status_code == 200
    assert json.loads(body)["body"] == "body"


async def test_a_request_with_connection_close_is_answered_then_the_connection_closes() -> None:
    async with serving(echo) as port:
        client = await RawClient.open(port)
        await client.request("GET", "/last", headers=[("connection", "close")])
        head, body = await client.response()
        assert head.status_code == 200
        assert json.loads(body)["path"] == "/last"
        assert await receive_until_eof(client.stream) == b""
        await client.stream.aclose()


async def test_head_requests_reach_the_handler_and_get_no_body() -> None:
    async with serving(echo) as port, httpx2.AsyncClient() as client:
        head = await client.head(f"http://127.0.0.1:{port}/h")
        after = await client.get(f"http://127.0.0.1:{port}/after")
        assert client_address(head) == client_address(after)
    assert head.status_code == 200
    assert head.content == b""
    assert int(head.headers["content-length"]) > 0  # what a GET's body would be
    assert after.json()["path"] == "/after"


async def test_unknown_methods_reach_the_handler() -> None:
    async with serving(echo) as port, httpx2.AsyncClient() as client:
        response = await client.request("BREW", f"http://127.0.0.1:{port}/pot")
    assert response.json()["method"] == "BREW"


async def test_response_headers_are_sent() -> None:
    async def handler(request: HTTPRequest) -> HTTPResponse:
        return HTTPResponse(201, b"ok", content_type="text/plain", headers=(("x-id", "7"),))

    async with serving(handler) as port, httpx2.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
    assert (response.status_code, response.text) == (201, "ok")
    assert response.headers["content-type"] == "text/plain"
    assert response.headers["x-id"] == "7"


# --------------------------------------------------------------------------- refusals


async def test_a_body_over_max_body_gets_413_and_the_handler_is_not_called() -> None:
    calls: list[HTTPRequest] = []

    async def handler(request: HTTPRequest) -> HTTPResponse:
        calls.append(request)
        return HTTPResponse(200, b"{}")

    async with serving(handler, max_body=1000) as port, httpx2.AsyncClient() as client:
        at_limit = await client.post(f"http://127.0.0.1:{port}/", content=b"x" * 1000)
        over = await client.post(f"http://127.0.0.1:{port}/", content=b"x" * 5000)
    assert at_limit.status_code == 200
    assert over.status_code == 413
    assert over.headers["connection"] == "close"
    assert over.json()["error"]["type"] == "invalid_request_error"
    assert over.json()["error"]["code"] == 413
    assert len(calls) == 1


async def test_a_chunked_body_over_max_body_gets_413() -> None:
    async with serving(echo, max_body=10) as port:
        client = await RawClient.open(port)
        headers = [("host", "x"), ("transfer-encoding", "chunked")]
        await client.send(
            h11.Request(method="POST", target="/", headers=headers),
            h11.Data(data=b"x" * 8),
            h11.Data(data=b"x" * 8),
        )
        head, _ = await client.response()
        assert head.status_code == 413
        assert await client.next_event() == h11.ConnectionClosed()  # closed after
        await client.stream.aclose()


async def test_a_declared_oversized_body_is_refused_without_100_continue() -> None:
    async with serving(echo, max_body=10) as port:
        client = await RawClient.open(port)
        headers = [("host", "x"), ("content-length", "11"), ("expect", "100-continue")]
        await client.send(h11.Request(method="POST", target="/", headers=headers))
        head = await client.next_event()  # no 100 first: the refusal itself
        assert isinstance(head, h11.Response)
        assert head.status_code == 413
        await client.stream.aclose()


async def test_a_malformed_request_gets_400_and_the_connection_is_closed() -> None:
    async with serving(echo) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"THIS IS NOT HTTP\r\n\r\n")
        received = await receive_until_eof(stream)
        await stream.aclose()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"\r\nconnection: close" in head.lower()
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", 400)
    assert error["message"].startswith("malformed HTTP request")


async def test_an_oversized_request_head_gets_431() -> None:
    async with serving(echo) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        # h11 refuses a head once over 16 KiB are buffered without its end.
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
        received = await receive_until_eof(stream)
        await stream.aclose()
    assert received.startswith(b"HTTP/1.1 431 ")


async def test_a_malformed_request_does_not_disturb_other_connections() -> None:
    async with serving(echo) as port, httpx2.AsyncClient() as client:
        first = await client.get(f"http://127.0.0.1:{port}/before")
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nbad header line\r\n\r\n")
        assert (await receive_until_eof(stream)).startswith(b"HTTP/1.1 400 ")
        await stream.aclose()
        second = await client.get(f"http://127.0.0.1:{port}/after")
        assert client_address(first) == client_address(second)
    assert second.json()["path"] == "/after"


# --------------------------------------------------------------------------- handler failures


async def test_a_handler_exception_becomes_a_500_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: HTTPRequest) -> HTTPResponse:
        if request.path == "/boom":
            raise ZeroDivisionError("no")
        return HTTPResponse(200, b'{"ok": true}')

    async with serving(handler) as port, httpx2.AsyncClient() as client:
        failed = await client.get(f"http://127.0.0.1:{port}/boom")
        after = await client.get(f"http://127.0.0.1:{port}/fine")
        assert client_address(failed) == client_address(after)  # the connection lived on
    assert failed.status_code == 500
    assert failed.json() == error_body(500, "internal error: ZeroDivisionError", "server_error")
    assert after.json() == {"ok": True}
    [record] = [r for r in caplog.records if r.name == "trio_rollouts.gateway"]
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.exc_info[0] is ZeroDivisionError


async def test_a_handler_returning_no_response_becomes_a_500(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: HTTPRequest) -> Any:
        return {"not": "a response"}

    async with serving(handler) as port, httpx2.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert any(r.name == "trio_rollouts.gateway" for r in caplog.records)


async def test_a_client_that_disconnects_mid_request_does_not_cancel_the_handler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, release, finished = trio.Event(), trio.Event(), trio.Event()
    outcome: list[str] = []

    async def handler(request: HTTPRequest) -> HTTPResponse:
        if request.path == "/slow":
            started.set()
            try:
                await release.wait()
            except trio.Cancelled:
                outcome.append("cancelled")
                raise
            outcome.append("committed")
            finished.set()
        return HTTPResponse(200, b"{}")

    async with serving(handler) as port:
        client = await RawClient.open(port)
        await client.request("POST", "/slow", b"{}")
        await started.wait()
        await client.stream.aclose()
        await trio.testing.wait_all_tasks_blocked()  # the server's chance to notice, if it would
        release.set()
        await finished.wait()
        await trio.testing.wait_all_tasks_blocked()  # the response's write has failed by now
        async with httpx2.AsyncClient() as other:
            still = await other.get(f"http://127.0.0.1:{port}/")
    assert outcome == ["committed"]
    assert still.status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- streaming


@sdk_stream_leaves_generators_open
@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_streamed_reply_round_trips_through_the_openai_sdk(include_usage: bool) -> None:
    stream_options: ChatCompletionStreamOptionsParam | openai.Omit = (
        {"include_usage": True} if include_usage else openai.omit
    )
    async with serving(make_openai_handler(REPLY)) as port, openai_client(port) as client:
        chunks = [
            chunk
            async for chunk in await client.chat.completions.create(
                model="test-model",
                messages=MESSAGES,
                stream=True,
                stream_options=stream_options,
            )
        ]
    gc.collect()  # see sdk_stream_leaves_generators_open
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me look that up."
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += (delta.function and delta.function.name) or ""
            call["arguments"] += (delta.function and delta.function.arguments) or ""
    assert [calls[i] for i in sorted(calls)] == [
        {"id": "call_0_0", "name": "search", "arguments": '{"query": "trio"}'},
        {"id": "call_0_1", "name": "clock", "arguments": "{}"},
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert all(c.id == "chatcmpl-1" and c.model == "test-model" for c in chunks)
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert chunks[-1].choices == []
        assert [u.total_tokens for u in usage] == [19]
    else:
        assert usage == []


@sdk_stream_leaves_generators_open
@pytest.mark.parametrize(
    "reply", [REPLY, TOOL_ONLY_REPLY, TEXT_REPLY], ids=["both", "tools", "text"]
)
async def test_the_sdk_stream_helper_rebuilds_the_reply(reply: dict[str, Any]) -> None:
    async with (
        serving(make_openai_handler(reply)) as port,
        openai_client(port) as client,
        client.chat.completions.stream(
            model="test-model",
            messages=MESSAGES,
            tools=TOOLS,
            stream_options={"include_usage": True},
        ) as stream,
    ):
        events = [event.type async for event in stream]
        completion = await stream.get_final_completion()
    gc.collect()  # see sdk_stream_leaves_generators_open
    expected = reply["choices"][0]["message"]
    message = completion.choices[0].message
    assert message.role == "assistant"
    assert message.content == expected["content"]
    got_calls = [
        {
            "id": c.id,
            "type": c.type,
            "function": {"name": c.function.name, "arguments": c.function.arguments},
        }
        for c in message.tool_calls or []
    ]
    assert got_calls == expected.get("tool_calls", [])
    assert completion.choices[0].finish_reason == reply["choices"][0]["finish_reason"]
    assert completion.usage is not None
    assert completion.usage.model_dump() == {
        **reply["usage"],
        **completion.usage.model_dump(exclude=set(reply["usage"])),
    }
    assert completion.id == "chatcmpl-1"
    assert ("content.done" in events) == bool(expected["content"])
    assert events.count("tool_calls.function.arguments.done") == len(got_calls)


async def test_a_streaming_response_is_sent_chunked_as_the_chunks_come() -> None:
    send_chunk, receive_chunk = trio.open_memory_channel[bytes](0)

    async def handler(request: HTTPRequest) -> StreamingResponse:
        return StreamingResponse(200, receive_chunk.__aiter__(), headers=(("x-a", "b"),))

    async with serving(handler) as port:
        client = await RawClient.open(port)
        await client.request("GET", "/stream")
        head = await client.next_event()
        assert isinstance(head, h11.Response)
        assert head.status_code == 200
        head_fields = dict(head.headers)
        assert head_fields[b"content-type"] == b"text/event-stream"
        assert head_fields[b"transfer-encoding"] == b"chunked"
        assert head_fields[b"x-a"] == b"b"
        for chunk in (sse_event({"n": 1}), sse_event({"n": 2})):
            await send_chunk.send(chunk)  # the next is not made before this one arrived
            assert (await client.next_event()).data == chunk
        await send_chunk.aclose()
        assert isinstance(await client.next_event(), h11.EndOfMessage)
        client.h11.start_next_cycle()
        await client.request("GET", "/again")  # the connection is kept alive
        assert (await client.next_event()).status_code == 200
        await client.stream.aclose()


class Chunks:
    """An async iterator (not a generator) that counts what it yielded and knows its
    ``aclose``; after its first chunk it waits for ``resume``, then yields forever."""

    def __init__(self) -> None:
        self.yielded = 0
        self.resume = trio.Event()
        self.closed = trio.Event()

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        if self.yielded == 1:
            await self.resume.wait()
        await trio.lowlevel.checkpoint()
        self.yielded += 1
        return sse_event({"n": self.yielded})

    async def aclose(self) -> None:
        self.closed.set()


async def test_a_client_that_disconnects_mid_stream_stops_the_iteration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chunks = Chunks()

    async def handler(request: HTTPRequest) -> HTTPResponse | StreamingResponse:
        if request.path == "/stream":
            return StreamingResponse(200, chunks)
        return HTTPResponse(200, b"{}")

    async with serving(handler) as port:
        client = await RawClient.open(port)
        await client.request("GET", "/stream")
        assert isinstance(await client.next_event(), h11.Response)
        assert isinstance(await client.next_event(), h11.Data)
        await client.stream.aclose()
        chunks.resume.set()  # from now on every send fails, sooner or later
        with trio.fail_after(10):  # a safety net only: it happens at once
            await chunks.closed.wait()
        yielded = chunks.yielded
        await trio.testing.wait_all_tasks_blocked()
        assert chunks.yielded == yielded  # not advanced after it was closed
        async with httpx2.AsyncClient() as other:  # and the server serves on
            assert (await other.get(f"http://127.0.0.1:{port}/")).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_stream_that_ends_is_closed_too() -> None:
    class ThreeChunks(Chunks):
        async def __anext__(self) -> bytes:
            if self.yielded == 3:
                raise StopAsyncIteration
            self.resume.set()  # never waits
            return await super().__anext__()

    chunks = ThreeChunks()

    async def handler(request: HTTPRequest) -> StreamingResponse:
        return StreamingResponse(200, chunks)

    async with serving(handler) as port, httpx2.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
    assert response.text == "".join(sse_event({"n": n}).decode() for n in (1, 2, 3))
    assert chunks.closed.is_set()


async def test_a_stream_that_raises_is_cut_short_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield sse_event({"n": 1})
        raise RuntimeError("the backend broke")

    async def handler(request: HTTPRequest) -> HTTPResponse | StreamingResponse:
        if request.path == "/fine":
            return HTTPResponse(200, b"{}")
        return StreamingResponse(200, failing())

    async with serving(handler) as port, httpx2.AsyncClient() as client:
        with pytest.raises(httpx2.RemoteProtocolError):  # the body did not end properly
            await client.get(f"http://127.0.0.1:{port}/stream")
        assert (await client.get(f"http://127.0.0.1:{port}/fine")).status_code == 200
    [record] = [r for r in caplog.records if r.name == "trio_rollouts.gateway"]
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError


# --------------------------------------------------------------------------- shutdown


async def test_cancelling_the_server_closes_its_connections_and_cancels_handlers() -> None:
    started, cancelled = trio.Event(), trio.Event()

    async def handler(request: HTTPRequest) -> HTTPResponse:
        if request.path == "/hang":
            started.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                cancelled.set()
                raise
        return HTTPResponse(200, b"{}")

    server_scope = trio.CancelScope()

    async def run_server(*, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        with server_scope:
            await serve_http(handler, "127.0.0.1", 0, task_status=task_status)

    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(run_server)
        idle = await RawClient.open(port)
        await idle.request("GET", "/")
        head, _ = await idle.response()  # a keep-alive connection, now idle
        assert head.status_code == 200
        busy = await RawClient.open(port)
        await busy.request("GET", "/hang")
        await started.wait()
        server_scope.cancel()
    assert cancelled.is_set()
    assert await receive_until_eof(idle.stream) == b""
    assert await receive_until_eof(busy.stream) == b""
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
    await idle.stream.aclose()
    await busy.stream.aclose()


async def test_the_server_reports_the_bound_port() -> None:
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_http, echo, "127.0.0.1", 0)
        assert host == "127.0.0.1"
        assert port > 0
        nursery.cancel_scope.cancel()


async def test_a_negative_max_body_is_refused() -> None:
    with pytest.raises(ValueError, match="max_body"):
        await serve_http(echo, "127.0.0.1", 0, max_body=-1)


# --------------------------------------------------------------------------- SSE chunks


def decode(events: list[bytes]) -> list[Any]:
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    assert events[-1] == SSE_DONE
    return [json.loads(e[len(b"data: ") : -2]) for e in events[:-1]]


def test_sse_event_is_compact_json_utf8() -> None:
    assert sse_event({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chunks_of_a_reply_with_content_and_tool_calls() -> None:
    chunks = decode(chat_completion_chunks(REPLY, include_usage=True))
    common = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "test-model",
    }
    assert all({k: c[k] for k in common} == common for c in chunks)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Let me look that up."}, None),
        (
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_0_0",
                        "type": "function",
                        "function": {"name": "search", "arguments": ""},
                    }
                ]
            },
            None,
        ),
        ({"tool_calls": [{"index": 0, "function": {"arguments": '{"query": "trio"}'}}]}, None),
        (
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_0_1",
                        "type": "function",
                        "function": {"name": "clock", "arguments": ""},
                    }
                ]
            },
            None,
        ),
        ({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}, None),
        ({}, "tool_calls"),
    ]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == REPLY["usage"]


def test_chunks_without_usage_end_with_the_finish_reason() -> None:
    chunks = decode(chat_completion_chunks(TEXT_REPLY, include_usage=False))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello there."},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in chunks)


def test_a_reply_without_content_opens_with_null_content() -> None:
    chunks = decode(chat_completion_chunks(TOOL_ONLY_REPLY, include_usage=False))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert "content" not in chunks[1]["choices"][0]["delta"]
