"""The lean HTTP/1.1 connection pool (``inference/_lean_http.py``), specified against real
sockets on 127.0.0.1: a scriptable raw server (``_raw_http_server``) writes exactly the bytes
each test needs. Timeouts run on Trio's autojump clock, so no test waits for real time.

Every test runs twice, once per response parser (llhttp through httptools, and h11): the
two must behave the same, down to the error classes."""

from __future__ import annotations

import random
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing
import trustme
from _raw_http_server import (
    RawConnection,
    ReceivedRequest,
    ScriptedResolver,
    answer_forever,
    raw_server,
    response,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_rollouts.inference import Timeout
from trio_rollouts.inference.http._pool import ConnectionPool, PoolStatistics
from trio_rollouts.inference.http._wire import (
    HAVE_LLHTTP,
    ConnectError,
    ConnectTimeout,
    LeanHTTPError,
    NetworkError,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    WriteError,
    WriteTimeout,
)

TIMEOUTS = Timeout(connect=5.0, read=5.0, write=5.0, pool=5.0)


_POOLS: list[ConnectionPool] = []
_PARSER = ["h11"]  # the response parser of the pools make_pool makes (set per test)


@pytest.fixture(
    autouse=True,
    params=[
        pytest.param(
            "llhttp",
            marks=pytest.mark.skipif(not HAVE_LLHTTP, reason="needs httptools"),
        ),
        "h11",
    ],
)
def parser(request: pytest.FixtureRequest) -> str:
    """Run the test with pools parsing responses with llhttp, then with h11."""
    _PARSER[0] = request.param
    return str(request.param)


def make_pool(max_connections: int = 4, **kwargs: object) -> ConnectionPool:
    kwargs.setdefault("keepalive_expiry", 30.0)
    kwargs.setdefault("timeouts", TIMEOUTS)
    kwargs.setdefault("_parser", _PARSER[0])
    pool = ConnectionPool(max_connections=max_connections, **kwargs)  # type: ignore[arg-type]
    assert pool._llhttp == (kwargs["_parser"] == "llhttp")
    _POOLS.append(pool)
    return pool


@pytest.fixture(autouse=True)
async def close_pools() -> AsyncIterator[None]:
    """Close whatever a failed test left open (every test here is a Trio test)."""
    yield
    while _POOLS:
        await _POOLS.pop().aclose()


def echo(request: ReceivedRequest) -> bytes:
    return response(b"%s %s %s" % (request.method.encode(), request.target.encode(), request.body))


async def echo_handler(conn: RawConnection) -> None:
    await answer_forever(conn, echo)


def idle_stats(connections: int) -> PoolStatistics:
    return PoolStatistics(connections=connections, idle=connections, active=0, waiting=0)


# --------------------------------------------------------------------------- HTTP basics


async def test_sequential_requests_reuse_one_keepalive_connection() -> None:
    pool = make_pool()
    async with raw_server(echo_handler) as server:
        for i in range(5):
            reply = await pool.request("POST", server.url(f"/v1/x?i={i}"), content=b"body")
            assert reply.status_code == 200
            assert reply.content == f"POST /v1/x?i={i} body".encode()
        assert server.accepted == 1
        assert pool.statistics() == idle_stats(1)
        await pool.aclose()


async def test_idle_connections_beyond_max_keepalive_are_closed() -> None:
    pool = make_pool(4, max_keepalive_connections=1)
    async with raw_server(echo_handler) as server, trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(pool.request, "GET", server.url())
    assert server.accepted == 3
    assert pool.statistics() == idle_stats(1)


async def test_a_content_function_is_called_once_the_request_holds_a_slot() -> None:
    release = trio.Event()
    body = ["built while waiting"]

    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            if request.body == b"first":
                await release.wait()
            await conn.send(echo(request))

    pool = make_pool(1)
    replies: list[bytes] = []

    async def second() -> None:
        reply = await pool.request("POST", server.url(), content=lambda: body[0].encode())
        replies.append(reply.content)

    async with raw_server(handler) as server, trio.open_nursery() as nursery:
        nursery.start_soon(partial(pool.request, "POST", server.url(), content=b"first"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics().waiting == 1
        body[0] = "built when sent"
        release.set()
    assert replies == [b"POST / built when sent"]


async def test_request_sends_host_user_agent_content_length_and_given_headers() -> None:
    seen: list[ReceivedRequest] = []

    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            seen.append(request)
            await conn.send(response())

    pool = make_pool(user_agent="tester/1")
    async with raw_server(handler) as server:
        await pool.request(
            "POST", server.url("/p"), headers=[("Authorization", "Bearer k")], content=b"{}"
        )
        await pool.request("GET", server.url("/g"))
        await pool.aclose()
    post, get = seen
    assert post.headers["host"] == f"127.0.0.1:{server.port}"
    assert post.headers["user-agent"] == "tester/1"
    assert post.headers["authorization"] == "Bearer k"
    assert post.headers["content-length"] == "2"
    assert post.body == b"{}"
    assert "content-length" not in get.headers


async def test_connection_close_response_closes_the_connection() -> None:
    async def handler(conn: RawConnection) -> None:
        await answer_forever(conn, lambda r: response(headers=[(b"Connection", b"close")]))

    pool = make_pool()
    async with raw_server(handler) as server:
        for _ in range(3):
            assert (await pool.request("GET", server.url())).content == b"ok"
            assert pool.statistics() == idle_stats(0)
        assert server.accepted == 3


@pytest.mark.parametrize("framing", ["until-close", "content-length"])
async def test_http10_server_response_is_read_and_connection_not_reused(framing: str) -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        if framing == "content-length":
            await conn.send(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        else:
            await conn.send(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhello")
            conn.close()

    pool = make_pool()
    async with raw_server(handler) as server:
        for _ in range(2):
            reply = await pool.request("GET", server.url())
            assert (reply.status_code, reply.content) == (200, b"hello")
        assert server.accepted == 2
        assert pool.statistics() == idle_stats(0)


@pytest.mark.parametrize("chunks", [None, [1], [3, 1000], [4096]])
async def test_fixed_length_and_chunked_bodies(chunks: list[int] | None) -> None:
    body = bytes(range(256)) * 40

    async def handler(conn: RawConnection) -> None:
        await answer_forever(conn, lambda r: response(body, chunks=chunks))

    pool = make_pool()
    async with raw_server(handler) as server:
        for _ in range(2):
            assert (await pool.request("GET", server.url())).content == body
        assert server.accepted == 1


async def test_informational_responses_before_the_response_are_skipped() -> None:
    async def handler(conn: RawConnection) -> None:
        while await conn.receive_request() is not None:
            await conn.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            await conn.send(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
            await conn.send(response(b"final", status=201, reason=b"Created"))

    pool = make_pool()
    async with raw_server(handler) as server:
        for _ in range(2):
            reply = await pool.request("POST", server.url(), content=b"x")
            assert (reply.status_code, reply.reason_phrase, reply.content) == (
                201,
                "Created",
                b"final",
            )
        assert server.accepted == 1


async def test_large_body_arrives_across_many_reads() -> None:
    body = random.Random(7).randbytes(3_000_000)

    async def handler(conn: RawConnection) -> None:
        await answer_forever(conn, lambda r: response(body, chunks=[70_000, 13]))

    pool = make_pool()
    async with raw_server(handler) as server:
        assert (await pool.request("GET", server.url())).content == body
        assert (await pool.request("POST", server.url(), content=body[:100_000])).content == body


async def test_head_response_has_no_body_and_keeps_the_connection() -> None:
    async def handler(conn: RawConnection) -> None:
        while await conn.receive_request() is not None:
            await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")

    pool = make_pool()
    async with raw_server(handler) as server:
        for _ in range(2):
            assert (await pool.request("HEAD", server.url())).content == b""
        assert server.accepted == 1


async def test_ipv6_literal_host() -> None:
    seen: list[str] = []

    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            seen.append(request.headers["host"])
            await conn.send(response())

    pool = make_pool()
    async with raw_server(handler, host="::1") as server:
        assert (await pool.request("GET", server.url("/"))).content == b"ok"
    assert seen == [f"[::1]:{server.port}"]


async def test_response_headers_text_and_json() -> None:
    async def handler(conn: RawConnection) -> None:
        await answer_forever(
            conn,
            lambda r: response(
                {"/text": "café".encode("latin-1"), "/json": b'{"a": [1, 2]}'}.get(
                    r.target, b"not json"
                ),
                headers=[
                    (b"Content-Type", b"text/plain; charset=ISO-8859-1"),
                    (b"X-Twice", b"a"),
                    (b"x-twice", b"b"),
                ],
            ),
        )

    pool = make_pool()
    async with raw_server(handler) as server:
        text = await pool.request("GET", server.url("/text"))
        assert text.text == "café"
        assert text.headers["CONTENT-TYPE"] == "text/plain; charset=ISO-8859-1"
        assert text.headers.get("x-twice") == "a, b"
        assert "X-Twice" in text.headers
        assert text.headers.get("missing") is None
        assert ("x-twice", "a") in text.headers.multi_items()
        data = await pool.request("GET", server.url("/json"))
        assert data.json() == {"a": [1, 2]}
        bad = await pool.request("GET", server.url("/bad"))
        with pytest.raises(ValueError, match="Expecting value"):
            bad.json()


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/x", "/relative", "http:///nohost"])
async def test_unsupported_url_raises_value_error_naming_it(url: str) -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="URL") as info:
        await pool.request("GET", url)
    assert url in str(info.value)
    assert pool.statistics() == idle_stats(0)


async def test_invalid_header_raises_value_error_and_holds_no_slot() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match="invalid request"):
        await pool.request("GET", "http://127.0.0.1:9/", headers=[("Bad Name", "x")])
    assert pool.statistics() == idle_stats(0)


async def test_invalid_configuration_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"Timeout\.read must be >= 0 seconds"):
        Timeout(connect=1, read=-1, write=1, pool=1)
    with pytest.raises(ValueError, match="max_connections=0"):
        make_pool(0)


async def test_error_hierarchy() -> None:
    assert issubclass(ConnectError, NetworkError)
    assert issubclass(ReadError, NetworkError)
    assert issubclass(WriteError, NetworkError)
    assert issubclass(NetworkError, LeanHTTPError)
    assert issubclass(RemoteProtocolError, LeanHTTPError)
    for timeout in (ConnectTimeout, ReadTimeout, WriteTimeout, PoolTimeout):
        assert issubclass(timeout, LeanHTTPError)


# --------------------------------------------------------------------------- chunk boundaries

HEADER_VALUES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_ /;=", max_size=30).map(
    str.strip
)


@settings(max_examples=80, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=2500), min_size=1, max_size=3),
    chunked=st.booleans(),
    chunk_sizes=st.lists(st.integers(1, 900), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 3000), max_size=15),
    pauses=st.lists(st.integers(0, 3), max_size=5),
    status=st.sampled_from([200, 201, 204, 400, 429, 500, 503]),
    extra=st.lists(st.tuples(st.sampled_from(["x-a", "x-b", "retry-after"]), HEADER_VALUES)),
    blanks=st.sampled_from([b"", b" ", b"  ", b"\t "]),
    informational=st.booleans(),
)
async def test_responses_split_at_any_byte_boundary_parse_to_what_was_sent(
    bodies: list[bytes],
    chunked: bool,
    chunk_sizes: list[int],
    cuts: list[int],
    pauses: list[int],
    status: int,
    extra: list[tuple[str, str]],
    blanks: bytes,
    informational: bool,
) -> None:
    if status == 204:
        bodies = [b"" for _ in bodies]
    headers = [(name.encode(), value.encode()) for name, value in extra]

    def wire(body: bytes) -> bytes:
        early = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" if informational else b""
        return early + response(
            body,
            status=status,
            reason=b"Whatever",
            headers=[(name, b"%s%s%s" % (blanks, value, blanks)) for name, value in headers],
            chunks=chunk_sizes if chunked and status != 204 else None,
        )

    async def handler(conn: RawConnection) -> None:
        for body in bodies:
            if await conn.receive_request() is None:
                return
            await conn.send_in_pieces(wire(body), cuts, pauses)
        await conn.receive_request()

    pool = make_pool(1)
    async with raw_server(handler) as server:
        for body in bodies:
            reply = await pool.request("POST", server.url(), content=b"q")
            assert (reply.status_code, reply.reason_phrase, reply.content) == (
                status,
                "Whatever",
                body,
            )
            for name, _ in extra:
                sent = [v.decode() for n, v in headers if n.decode() == name]
                assert reply.headers[name.upper()] == ", ".join(sent)
        assert server.accepted == 1
        assert pool.statistics() == idle_stats(1)
        await pool.aclose()


# --------------------------------------------------------------------------- parser corners
# Where llhttp and h11 could differ; each runs on both parsers, which must agree.


def one_response_handler(
    wire: bytes, *, then_close: bool = False, pieces: bool = False
) -> Callable[[RawConnection], Awaitable[None]]:
    """A handler answering each request with ``wire`` (byte by byte if ``pieces``)."""

    async def handler(conn: RawConnection) -> None:
        while await conn.receive_request() is not None:
            if pieces:
                await conn.send_in_pieces(wire, list(range(len(wire))), [1])
            else:
                await conn.send(wire)
            if then_close:
                conn.close()
                return

    return handler


async def test_response_sent_byte_by_byte_with_informational_chunked_and_trailers() -> None:
    wire = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 200 Fine Thanks\r\nX-Name:   padded  \r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Sum\r\n\r\n"
        b"3\r\nabc\r\n1;ext=1\r\nd\r\n0\r\nX-Sum: 99\r\n\r\n"
    )
    pool = make_pool()
    async with raw_server(one_response_handler(wire, pieces=True)) as server:
        for _ in range(2):
            reply = await pool.request("POST", server.url(), content=b"x")
            assert (reply.status_code, reply.reason_phrase, reply.content) == (
                200,
                "Fine Thanks",
                b"abcd",
            )
            assert reply.headers["x-name"] == "padded"
            assert "x-sum" not in reply.headers  # trailers are not headers (as with h11)
            assert "link" not in reply.headers  # nor are the 1xx responses' headers
        assert server.accepted == 1


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
    ],
)
async def test_body_delimited_by_eof_is_complete_at_eof(head: bytes, pieces: bool) -> None:
    body = bytes(range(256)) * 30
    pool = make_pool()
    async with raw_server(one_response_handler(head + body, then_close=True, pieces=pieces)) as s:
        for expected in (body, body):
            assert (await pool.request("GET", s.url())).content == expected
        assert s.accepted == 2
        assert pool.statistics() == idle_stats(0)


async def test_empty_body_delimited_by_eof() -> None:
    wire = b"HTTP/1.0 200 OK\r\n\r\n"
    pool = make_pool()
    async with raw_server(one_response_handler(wire, then_close=True)) as server:
        reply = await pool.request("GET", server.url())
        assert (reply.status_code, reply.content) == (200, b"")
        assert pool.statistics() == idle_stats(0)


async def test_http10_keep_alive_response_is_not_reused() -> None:
    wire = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"
    pool = make_pool()
    async with raw_server(one_response_handler(wire)) as server:
        for _ in range(2):
            assert (await pool.request("GET", server.url())).content == b"ok"
        assert server.accepted == 2  # h11 never keeps an HTTP/1.0 connection; nor does llhttp
        assert pool.statistics() == idle_stats(0)


async def test_request_with_connection_close_does_not_keep_the_connection() -> None:
    pool = make_pool()
    async with raw_server(echo_handler) as server:
        for _ in range(2):
            reply = await pool.request("GET", server.url("/c"), headers=[("Connection", "close")])
            assert reply.content == b"GET /c "
        assert server.accepted == 2
        assert pool.statistics() == idle_stats(0)


@pytest.mark.parametrize(
    "after",
    [b"garbage", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra", b"HTTP/1.1 2"],
)
async def test_bytes_after_the_response_keep_the_response_but_close_the_connection(
    after: bytes,
) -> None:
    pool = make_pool()
    async with raw_server(one_response_handler(response(b"first") + after)) as server:
        for _ in range(2):
            reply = await pool.request("GET", server.url())
            assert (reply.status_code, reply.content) == (200, b"first")
            assert pool.statistics() == idle_stats(0)
        assert server.accepted == 2


async def test_eof_after_only_an_informational_response_is_a_read_error() -> None:
    wire = b"HTTP/1.1 100 Continue\r\n\r\n"
    pool = make_pool()
    async with raw_server(one_response_handler(wire, then_close=True)) as server:
        with pytest.raises(ReadError, match="mid-response after 25 bytes"):
            await pool.request("POST", server.url(), content=b"x")
        assert pool.statistics() == idle_stats(0)


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nzzz",  # h11 knows only chunked
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Name: x\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_invalid_responses_are_remote_protocol_errors(wire: bytes) -> None:
    pool = make_pool()
    async with raw_server(one_response_handler(wire)) as server:
        with pytest.raises(RemoteProtocolError, match=r"invalid HTTP/1\.1 response"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


@pytest.mark.parametrize(
    "wire",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",  # bare LF line ends
        b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 2\r\n\r\nok",  # obsolete folding
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    ],
)
async def test_llhttp_refuses_what_h11_tolerates_in_rare_corners(wire: bytes, parser: str) -> None:
    """The documented difference: llhttp runs strict (no "dangerous leniencies")."""
    pool = make_pool()
    async with raw_server(one_response_handler(wire)) as server:
        if parser == "llhttp":
            with pytest.raises(RemoteProtocolError, match=r"invalid HTTP/1\.1 response"):
                await pool.request("GET", server.url())
        else:
            assert (await pool.request("GET", server.url())).content == b"ok"


async def test_endless_response_head_is_a_remote_protocol_error() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        await conn.send(b"HTTP/1.1 200 OK\r\n")
        for i in range(1000):
            await conn.send(b"X-Filler-%d: %s\r\n" % (i, b"f" * 100))
        await conn.receive_request()

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(RemoteProtocolError, match=r"invalid HTTP/1\.1 response"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


async def test_head_and_other_requests_share_a_connection() -> None:
    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            if request.method == "HEAD":
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            else:
                await conn.send(echo(request))

    pool = make_pool()
    async with raw_server(handler) as server:
        for i in range(3):
            assert (await pool.request("HEAD", server.url())).content == b""
            reply = await pool.request("POST", server.url("/p"), content=b"%d" % i)
            assert reply.content == b"POST /p %d" % i
        assert server.accepted == 1


async def test_parser_choice() -> None:
    expected = HAVE_LLHTTP
    pool = ConnectionPool(max_connections=1, keepalive_expiry=1, timeouts=TIMEOUTS)
    assert pool._llhttp == expected
    with pytest.raises(ValueError, match="_parser='bogus'"):
        ConnectionPool(
            max_connections=1,
            keepalive_expiry=1,
            timeouts=TIMEOUTS,
            _parser="bogus",  # type: ignore[arg-type]
        )


# --------------------------------------------------------------------------- broken connections


async def test_server_closing_mid_body_raises_read_error_and_releases_the_slot() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(ReadError, match="closed the connection mid-response"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


async def test_server_closing_mid_chunked_body_raises_read_error() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(ReadError, match="mid-response"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


async def test_server_reset_raises_read_error_naming_the_reset() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npart")
        await trio.testing.wait_all_tasks_blocked()
        conn.reset()

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(ReadError, match="Connection reset by peer"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


async def test_invalid_response_raises_remote_protocol_error() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        await conn.send(b"SPDY/9 banana\r\n\r\n")

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(RemoteProtocolError, match=r"invalid HTTP/1.1 response"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


async def test_half_closed_idle_connection_is_replaced_without_error() -> None:
    async def handler(conn: RawConnection) -> None:
        request = await conn.receive_request()
        assert request is not None
        await conn.send(echo(request))
        await conn.shutdown_write()  # no Connection: close, just a FIN
        await conn.receive_request()

    pool = make_pool()
    async with raw_server(handler) as server:
        await pool.request("GET", server.url("/1"))
        await trio.testing.wait_all_tasks_blocked()
        assert (await pool.request("GET", server.url("/2"))).content == b"GET /2 "
        assert server.accepted == 2


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_stale_reused_connection_is_retried_once_on_a_fresh_one(how: str) -> None:
    async def handler(conn: RawConnection) -> None:
        if conn.number == 0:
            request = await conn.receive_request()
            assert request is not None
            await conn.send(echo(request))
            await conn.receive_request()  # the race: the server gives up as a request arrives
            conn.reset() if how == "reset" else conn.close()
        else:
            await echo_handler(conn)

    pool = make_pool()
    async with raw_server(handler) as server:
        await pool.request("GET", server.url("/1"))
        assert (await pool.request("POST", server.url("/2"), content=b"b")).content == b"POST /2 b"
        assert server.accepted == 2
        assert pool.statistics() == idle_stats(1)


async def test_no_retry_when_the_retry_connection_also_fails() -> None:
    async def handler(conn: RawConnection) -> None:
        if conn.number == 0:
            request = await conn.receive_request()
            assert request is not None
            await conn.send(echo(request))
        await conn.receive_request()

    pool = make_pool()
    async with raw_server(handler) as server:
        await pool.request("GET", server.url())
        with pytest.raises(RemoteProtocolError, match="without sending a response"):
            await pool.request("GET", server.url())
        assert server.accepted == 2
        assert pool.statistics() == idle_stats(0)


async def test_no_retry_when_the_connection_was_new() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(RemoteProtocolError, match="without sending a response"):
            await pool.request("GET", server.url())
        assert server.accepted == 1
        assert pool.statistics() == idle_stats(0)


async def test_no_retry_once_a_response_byte_arrived() -> None:
    async def handler(conn: RawConnection) -> None:
        request = await conn.receive_request()
        assert request is not None
        await conn.send(echo(request))
        await conn.receive_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Le")

    pool = make_pool()
    async with raw_server(handler) as server:
        await pool.request("GET", server.url())
        with pytest.raises(ReadError, match="mid-response"):
            await pool.request("GET", server.url())
        assert server.accepted == 1


async def test_connection_refused_raises_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = make_pool()
    with pytest.raises(ConnectError, match=f"could not connect to http://127.0.0.1:{port}"):
        await pool.request("GET", f"http://127.0.0.1:{port}/")
    assert pool.statistics() == idle_stats(0)


async def test_expired_idle_connection_is_not_reused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = make_pool(keepalive_expiry=10.0)
    async with raw_server(echo_handler) as server:
        await pool.request("GET", server.url())
        await trio.sleep(5)
        await pool.request("GET", server.url())
        assert server.accepted == 1
        await trio.sleep(11)
        await pool.request("GET", server.url())
        assert server.accepted == 2
        await trio.testing.wait_all_tasks_blocked()
        assert server.open == 1


# --------------------------------------------------------------------------- timeouts


async def never_answer(conn: RawConnection) -> None:
    await conn.receive_request()
    await trio.sleep_forever()


async def test_read_timeout_when_the_server_is_silent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = make_pool()
    async with raw_server(never_answer) as server:
        start = trio.current_time()
        with pytest.raises(ReadTimeout, match=r"read timeout of 5.0 s"):
            await pool.request("GET", server.url())
        assert trio.current_time() - start == pytest.approx(5.0)
        assert pool.statistics() == idle_stats(0)


async def test_read_timeout_is_per_receive_so_a_slow_trickle_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    data = response(b"slow but steady")

    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        for i in range(len(data)):
            await trio.sleep(4)  # under the 5 s read timeout each time
            await conn.send(data[i : i + 1])
        await conn.receive_request()

    pool = make_pool()
    async with raw_server(handler) as server:
        reply = await pool.request("GET", server.url())
        assert reply.content == b"slow but steady"


async def test_write_timeout_when_the_server_does_not_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def handler(conn: RawConnection) -> None:
        await trio.sleep_forever()

    pool = make_pool()
    async with raw_server(handler) as server:
        with pytest.raises(WriteTimeout, match="write timeout"):
            await pool.request("POST", server.url(), content=b"x" * 64_000_000)
        assert pool.statistics() == idle_stats(0)


async def test_connect_timeout(autojump_clock: trio.testing.MockClock) -> None:
    async def slow_open(host: str, port: int) -> trio.SocketStream:
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    pool = make_pool(_open_stream=slow_open)
    with pytest.raises(ConnectTimeout, match=r"connect timeout of 5.0 s"):
        await pool.request("GET", "http://127.0.0.1:1/")
    assert pool.statistics() == idle_stats(0)


async def test_connect_failure_from_the_opener_is_a_connect_error() -> None:
    async def failing_open(host: str, port: int) -> trio.SocketStream:
        raise OSError(113, "No route to host")

    pool = make_pool(_open_stream=failing_open)
    with pytest.raises(ConnectError, match="No route to host"):
        await pool.request("GET", "http://example.invalid/")
    assert pool.statistics() == idle_stats(0)


# --------------------------------------------------------------------------- name lookups


async def test_concurrent_connects_to_a_host_share_one_lookup() -> None:
    resolver = ScriptedResolver(names={"replica.test": ["127.0.0.1"]}, gate=trio.Event()).install()
    pool = make_pool(64)
    async with raw_server(echo_handler) as server, trio.open_nursery() as nursery:
        url = f"http://replica.test:{server.port}/"
        for _ in range(64):
            nursery.start_soon(pool.request, "GET", url)
        await trio.testing.wait_all_tasks_blocked()
        resolver.gate.set()  # type: ignore[union-attr]
    assert (resolver.calls, server.accepted) == (1, 64)


async def test_a_name_that_does_not_exist_fails_every_waiting_connect_at_once() -> None:
    resolver = ScriptedResolver(gate=trio.Event()).install()
    pool = make_pool(32)
    errors: list[ConnectError] = []

    async def one() -> None:
        with pytest.raises(ConnectError) as caught:
            await pool.request("GET", "http://no-such-host.invalid:8000/")
        errors.append(caught.value)

    async with trio.open_nursery() as nursery:
        for _ in range(32):
            nursery.start_soon(one)
        await trio.testing.wait_all_tasks_blocked()
        resolver.gate.set()  # type: ignore[union-attr]
    assert resolver.calls == 1
    assert len({id(error.__cause__) for error in errors}) == 32  # one exception per task
    assert all(isinstance(error.__cause__, socket.gaierror) for error in errors)
    assert pool.statistics() == idle_stats(0)


async def test_a_lookup_is_done_again_when_the_task_doing_it_is_cancelled() -> None:
    resolver = ScriptedResolver(names={"replica.test": ["127.0.0.1"]}, hang_first=1).install()
    pool = make_pool(2)
    replies: list[int] = []
    async with raw_server(echo_handler) as server, trio.open_nursery() as nursery:
        url = f"http://replica.test:{server.port}/"
        leader = trio.CancelScope()

        async def lead() -> None:
            with leader:
                await pool.request("GET", url)

        async def wait_for_the_lookup() -> None:
            replies.append((await pool.request("GET", url)).status_code)

        nursery.start_soon(lead)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait_for_the_lookup)
        await trio.testing.wait_all_tasks_blocked()
        assert resolver.calls == 1
        leader.cancel()
    assert (resolver.calls, replies) == (2, [200])
    assert pool.statistics() == idle_stats(1)


async def test_a_slow_lookup_is_a_connect_timeout_that_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ScriptedResolver(hang_first=1).install()
    pool = make_pool()
    with pytest.raises(ConnectTimeout, match=r"looking up the host name 'slow\.invalid' took"):
        await pool.request("GET", "http://slow.invalid:8000/")
    assert pool.statistics() == idle_stats(0)
    assert not pool._resolving


async def test_the_next_address_is_tried_when_one_refuses() -> None:
    # Nothing listens on 127.0.0.2 (loopback, refused at once); the server is on 127.0.0.1.
    resolver = ScriptedResolver(names={"replica.test": ["127.0.0.2", "127.0.0.1"]}).install()
    pool = make_pool()
    async with raw_server(echo_handler) as server:
        reply = await pool.request("GET", f"http://replica.test:{server.port}/")
    assert reply.status_code == 200
    assert resolver.calls == 1


async def test_every_address_refusing_is_one_connect_error_without_a_group_repr() -> None:
    ScriptedResolver(names={"replica.test": ["127.0.0.2", "127.0.0.3"]}).install()
    pool = make_pool()
    with pytest.raises(ConnectError) as caught:
        await pool.request("GET", "http://replica.test:9/")
    text = str(caught.value)
    assert "Connection refused" in text
    assert "ExceptionGroup" not in text
    assert "sub-exception" not in text


async def test_pool_timeout_when_every_connection_is_busy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool = make_pool(1, timeouts=Timeout(connect=5, read=None, write=5, pool=2))
    async with raw_server(never_answer) as server, trio.open_nursery() as nursery:
        nursery.start_soon(pool.request, "GET", server.url())
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(PoolTimeout, match="pool timeout of 2 s"):
            await pool.request("GET", server.url())
        assert pool.statistics() == PoolStatistics(connections=1, idle=0, active=1, waiting=0)
        nursery.cancel_scope.cancel()
    assert pool.statistics() == idle_stats(0)


# --------------------------------------------------------------------------- cancellation


async def test_cancel_mid_response_closes_the_connection_and_releases_the_slot() -> None:
    async def handler(conn: RawConnection) -> None:
        await conn.receive_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await conn.receive_request()  # returns when the client closes

    pool = make_pool()
    async with raw_server(handler) as server:
        with trio.move_on_after(0.5):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)
        await trio.testing.wait_all_tasks_blocked()
        assert server.open == 0


async def test_cancelled_waiter_leaves_no_trace(autojump_clock: trio.testing.MockClock) -> None:
    pool = make_pool(1)
    async with raw_server(never_answer) as server, trio.open_nursery() as nursery:
        nursery.start_soon(pool.request, "GET", server.url())
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1):
            await pool.request("GET", server.url())
        assert pool.statistics().waiting == 0
        nursery.cancel_scope.cancel()
    assert pool.statistics() == idle_stats(0)


async def test_cancel_storm_leaks_no_slot(autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(1234)

    async def handler(conn: RawConnection) -> None:
        while await conn.receive_request() is not None:
            await trio.sleep(rng.uniform(0, 0.05))
            data = response(b"x" * rng.randrange(0, 200_000), chunks=[rng.randrange(1, 5000)])
            cut = rng.randrange(len(data))
            await conn.send(data[:cut])
            await trio.sleep(rng.uniform(0, 0.01))
            await conn.send(data[cut:])

    pool = make_pool(4, timeouts=Timeout(connect=5, read=5, write=5, pool=None))
    outcomes: list[str] = []

    async def one(delay: float, cancel_after: float) -> None:
        await trio.sleep(delay)
        with trio.move_on_after(cancel_after):
            await pool.request("POST", server.url(), content=b"go")
            outcomes.append("done")
            return
        outcomes.append("cancelled")

    async with raw_server(handler) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(300):
                nursery.start_soon(one, rng.uniform(0, 1.0), rng.uniform(0, 0.1))
        stats = pool.statistics()
        assert (stats.active, stats.waiting) == (0, 0)
        assert stats.connections <= 4
        assert stats.idle == stats.connections
        assert {"done", "cancelled"} <= set(outcomes)
        with trio.fail_after(1):
            assert (await pool.request("GET", server.url())).status_code == 200
        await trio.testing.wait_all_tasks_blocked()
        assert server.open == pool.statistics().connections


async def test_waiters_get_slots_in_fifo_order() -> None:
    release = trio.Event()
    order: list[bytes] = []

    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            order.append(request.body)
            if request.body == b"0":
                await release.wait()
            await conn.send(response())

    pool = make_pool(1)
    async with raw_server(handler) as server, trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(
                lambda i=i: pool.request("POST", server.url(), content=str(i).encode())
            )
            await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics() == PoolStatistics(connections=1, idle=0, active=1, waiting=5)
        release.set()
    assert order == [b"0", b"1", b"2", b"3", b"4", b"5"]
    assert server.accepted == 1


async def test_new_request_does_not_overtake_waiters() -> None:
    release = trio.Event()
    order: list[bytes] = []

    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            order.append(request.body)
            if request.body == b"first":
                await release.wait()
            await conn.send(response())

    pool = make_pool(1)
    async with raw_server(handler) as server, trio.open_nursery() as nursery:
        nursery.start_soon(lambda: pool.request("POST", server.url(), content=b"first"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(lambda: pool.request("POST", server.url(), content=b"waiter"))
        await trio.testing.wait_all_tasks_blocked()
        release.set()
        # Arrives while the waiter still waits: it must queue behind it, not take the slot.
        await pool.request("POST", server.url(), content=b"late")
    assert order == [b"first", b"waiter", b"late"]


# --------------------------------------------------------------------------- replicas


async def test_replicas_share_the_limit_and_idle_connections_of_another_origin_make_room() -> None:
    pool = make_pool(2)
    async with raw_server(echo_handler) as a, raw_server(echo_handler) as b:
        await pool.request("GET", a.url("/a"))
        async with trio.open_nursery() as nursery:  # two at once: a's conn plus one new
            nursery.start_soon(pool.request, "GET", a.url("/a"))
            nursery.start_soon(pool.request, "GET", a.url("/a"))
        assert pool.statistics() == idle_stats(2)
        assert (await pool.request("GET", b.url("/b"))).content == b"GET /b "
        await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics() == idle_stats(2)
        assert (a.open, b.open) == (1, 1)
        # The remaining idle connection of a is the most recent one: LIFO per origin.
        await pool.request("GET", a.url("/a"))
        assert a.accepted == 2


async def test_waiter_for_another_origin_gets_a_fresh_connection() -> None:
    release = trio.Event()

    async def slow(conn: RawConnection) -> None:
        while await conn.receive_request() is not None:
            await release.wait()
            await conn.send(response(b"a"))

    pool = make_pool(1)
    async with raw_server(slow) as a, raw_server(echo_handler) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.request, "GET", a.url())
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(pool.request, "GET", b.url("/b"))
            await trio.testing.wait_all_tasks_blocked()
            assert pool.statistics().waiting == 1
            release.set()
        assert pool.statistics() == idle_stats(1)
        await trio.testing.wait_all_tasks_blocked()
        assert (a.open, b.open) == (0, 1)


# --------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


def client_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def test_https_request_with_the_ca_trusted(ca: trustme.CA) -> None:
    pool = make_pool(ssl_context=client_tls(ca))
    async with raw_server(echo_handler, ssl_context=server_tls(ca)) as server:
        assert server.url().startswith("https://")
        for _ in range(3):
            assert (await pool.request("POST", server.url("/s"), content=b"t")).content == (
                b"POST /s t"
            )
        assert server.accepted == 1
        await pool.aclose()


async def test_https_with_an_untrusted_certificate_is_a_connect_error(ca: trustme.CA) -> None:
    pool = make_pool(ssl_context=client_tls(trustme.CA()))
    async with raw_server(echo_handler, ssl_context=server_tls(ca)) as server:
        with pytest.raises(ConnectError, match=r"TLS handshake .* failed.*CERTIFICATE_VERIFY"):
            await pool.request("GET", server.url())
        assert pool.statistics() == idle_stats(0)


# --------------------------------------------------------------------------- aclose


async def test_aclose_closes_every_connection_and_the_pool_stays_usable() -> None:
    pool = make_pool()
    async with raw_server(echo_handler) as server:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(pool.request, "GET", server.url())
        assert pool.statistics() == idle_stats(3)
        await pool.aclose()
        await pool.aclose()
        assert pool.statistics() == idle_stats(0)
        await trio.testing.wait_all_tasks_blocked()
        assert server.open == 0
        assert (await pool.request("GET", server.url("/again"))).content == b"GET /again "
        assert pool.statistics() == idle_stats(1)


async def test_aclose_fails_requests_in_flight_and_releases_their_slots() -> None:
    pool = make_pool(1)
    async with raw_server(never_answer) as server:
        failures: list[BaseException] = []

        async def in_flight() -> None:
            try:
                await pool.request("GET", server.url())
            except ReadError as exc:
                failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_flight)
            await trio.testing.wait_all_tasks_blocked()
            await pool.aclose()
        assert len(failures) == 1
        assert pool.statistics() == idle_stats(0)


async def test_a_waiter_handed_a_connection_just_before_aclose_opens_a_new_one() -> None:
    """aclose() right after a slot was handed to a waiter that has not run yet: the
    waiter must not be given the connection aclose() just closed."""
    release = trio.Event()

    async def handler(conn: RawConnection) -> None:
        while (request := await conn.receive_request()) is not None:
            if request.body == b"A":
                await release.wait()
            await conn.send(response())

    pool = make_pool(max_connections=1)
    results: dict[str, object] = {}

    async def first(url: str) -> None:
        results["A"] = (await pool.request("POST", url, content=b"A")).status_code
        await pool.aclose()  # no checkpoint between the release of A's slot and this

    async def second(url: str) -> None:
        results["B"] = (await pool.request("POST", url, content=b"B")).status_code

    async with raw_server(handler) as server, trio.open_nursery() as nursery:
        nursery.start_soon(first, server.url())
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(second, server.url())
        await trio.testing.wait_all_tasks_blocked()
        assert pool.statistics().waiting == 1
        release.set()
    assert results == {"A": 200, "B": 200}
