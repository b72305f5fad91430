"""A lean Trio-native HTTP/1.1 connection pool: the hot path of :class:`OpenAIInference`.

One :class:`ConnectionPool` serves every origin (all replicas) under one ``max_connections``
limit. A request takes an idle keep-alive connection of its origin (most recently used
first), or opens one; at the limit it closes an idle connection of another origin to make
room, or else waits first-in first-out for a slot, up to ``Timeout.pool``. The HTTP is
done by well-kept parsers, not here: h11 serializes each request head (once per header set),
and responses are parsed by llhttp (through ``httptools``, the parser of Node.js, aiohttp
and uvicorn) when it is installed, else by h11 (see `Response parsing`_). What this module
adds is the pool and what a pool must guarantee:

1. **No leaked slot, ever.** Whatever ends a request - its response, an error, a timeout, or
   ``Cancelled`` at any instant - its slot is released before the exception propagates, and a
   waiting request is woken. A connection whose request did not finish a clean HTTP cycle is
   closed *synchronously* (its socket closed, no ``await`` in cleanup), so it can never be
   reused with a half-read response in it.
2. **Fair waiting.** Slots are handed directly to waiters in the order they started waiting;
   a request arriving while others wait queues behind them.
3. **One retry for a stale keep-alive connection.** A server may close an idle connection just
   as we reuse it. If a *reused* connection fails before a single response byte arrived
   (reset or EOF on send or on the first read), the request is sent once more on a fresh
   connection, as httpx does. It is never retried when the connection was new or once any
   response byte was received. This module's callers send idempotent generation requests;
   do not use it for requests that must not be sent twice.
4. **Cheap per request.** One cancel scope per request whose deadline moves forward per phase
   (connect, write, each read), URLs parsed once, header bytes built once per distinct header
   set, no scan over the pool's connections.

Timeouts are the library's :class:`~trio_rollouts.inference.Timeout`, with httpx's meaning:
``connect`` covers the host name's lookup, TCP connect and TLS handshake, ``write`` each
``send_all``, ``read`` the time without a byte from the server, ``pool`` the wait for a
slot. Not done here (use
httpx2 for them): proxies, HTTP/2, streaming bodies, redirects, cookies, compression.

Response parsing
----------------
llhttp parses a response (and this module builds it) in about 2 us where h11 takes about 35
us, a third of a whole request's CPU, so it is used when ``httptools`` is importable. h11 is
the fallback, and also parses the responses to ``HEAD`` and ``CONNECT`` (llhttp cannot be
told that a response has no body). Both give the same results and raise the same errors:
status, reason, headers as sent, the de-chunked body; 1xx responses skipped; keep-alive only
for HTTP/1.1 without ``Connection: close`` on either side; a body delimited by the end of
the connection (no ``Content-Length``, not chunked) complete at EOF; EOF anywhere else
mid-response a :class:`ReadError`; any other violation a :class:`RemoteProtocolError`; a
connection with bytes after the response (which the server must not send) closed, not
reused. llhttp is stricter in rare corners h11 tolerates (bare LF line ends, obsolete header
folding, a repeated ``Content-Length``, ``Content-Length`` with ``Transfer-Encoding``; it
runs without its "dangerous leniencies"): those are :class:`RemoteProtocolError`. Each
llhttp connection has one parser for its life: after a complete response llhttp is at the
start of the next, and a connection whose response did not complete cleanly is closed.
"""

from __future__ import annotations

import codecs
import ipaddress
import json
import math
import ssl
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import attrs
import h11
import trio

from trio_rollouts.inference._config import Timeout, timeout_advice

try:
    import httptools  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - exercised where httptools is not installed
    _HAVE_LLHTTP = False
else:
    _HAVE_LLHTTP = True

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "ConnectionPool",
    "LeanHTTPError",
    "LeanHeaders",
    "LeanResponse",
    "LeanTimeout",
    "NameLookups",
    "NetworkError",
    "PoolStatistics",
    "PoolTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "WriteError",
    "WriteTimeout",
]


# --------------------------------------------------------------------------- errors


class LeanHTTPError(Exception):
    """Base of every error :class:`ConnectionPool` raises for a failed request."""


class NetworkError(LeanHTTPError):
    """The connection failed: refused, unreachable, reset, broken pipe, EOF mid-response."""


class ConnectError(NetworkError):
    """Opening the connection (TCP connect or TLS handshake) failed."""


class ReadError(NetworkError):
    """Receiving the response failed (reset, or the server closed the connection mid-way)."""


class WriteError(NetworkError):
    """Sending the request failed (reset or broken pipe)."""


class RemoteProtocolError(LeanHTTPError):
    """The server violated HTTP/1.1, or closed the connection without sending a response."""


class LeanTimeout(LeanHTTPError):
    """Base of the timeouts: one phase of a request took longer than its limit."""


class ConnectTimeout(LeanTimeout):
    """TCP connect plus TLS handshake took longer than ``Timeout.connect``."""


class ReadTimeout(LeanTimeout):
    """The server sent nothing for ``Timeout.read`` seconds while a response was due."""


class WriteTimeout(LeanTimeout):
    """Sending the request took longer than ``Timeout.write``."""


class PoolTimeout(LeanTimeout):
    """No connection slot became free within ``Timeout.pool``."""


# --------------------------------------------------------------------------- configuration


@attrs.frozen(kw_only=True)
class PoolStatistics:
    """A snapshot of a :class:`ConnectionPool`.

    Attributes:
        connections: open connections (idle or in use).
        idle: open connections waiting in the pool for a request.
        active: requests holding a connection slot (sending, receiving or connecting).
        waiting: requests waiting for a slot.
    """

    connections: int
    idle: int
    active: int
    waiting: int


# --------------------------------------------------------------------------- responses


class LeanHeaders(Mapping[str, str]):
    """The response headers: a read-only mapping with case-insensitive names.

    A name sent more than once maps to its values joined by ``", "`` (as in httpx);
    :meth:`multi_items` gives every field as sent. Names are decoded as ASCII, values as
    Latin-1 (lossless). The mapping is built on first use, so unread headers cost nothing.
    """

    __slots__ = ("_fields", "_mapping")

    def __init__(self, fields: Sequence[tuple[bytes, bytes]]) -> None:
        # Names and values as the parser validated them: h11 lower-cases names and strips
        # values; llhttp keeps the names' case and a value's trailing blanks (removed here).
        self._fields = fields
        self._mapping: dict[str, str] | None = None

    def _built(self) -> dict[str, str]:
        mapping = self._mapping
        if mapping is None:
            mapping = {}
            for raw_name, raw_value in self._fields:
                name = raw_name.decode("ascii").lower()
                value = raw_value.decode("latin-1").rstrip(" \t")
                mapping[name] = f"{mapping[name]}, {value}" if name in mapping else value
            self._mapping = mapping
        return mapping

    def __getitem__(self, name: str) -> str:
        return self._built()[name.lower()]

    def get(self, name: str, default: Any = None) -> Any:
        return self._built().get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._built()

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def multi_items(self) -> list[tuple[str, str]]:
        """Every header field as sent, in order: ``(lower-cased name, value)``."""
        return [
            (n.decode("ascii").lower(), v.decode("latin-1").rstrip(" \t")) for n, v in self._fields
        ]

    def __repr__(self) -> str:
        return f"LeanHeaders({self.multi_items()!r})"


def _charset(content_type: str | None) -> str:
    if content_type:
        for param in content_type.split(";")[1:]:
            key, _, value = param.partition("=")
            if key.strip().lower() == "charset":
                name = value.strip().strip("\"'")
                try:
                    return codecs.lookup(name).name
                except LookupError:
                    break
    return "utf-8"


@attrs.frozen
class LeanResponse:
    """A complete HTTP response: status, headers and the whole body.

    Attributes:
        status_code: the status code, such as 200.
        reason_phrase: the status line's reason, such as ``"OK"`` (may be empty).
        headers: the response headers (case-insensitive names).
        content: the body, de-chunked, as bytes.
    """

    status_code: int
    reason_phrase: str
    headers: LeanHeaders
    content: bytes

    @property
    def text(self) -> str:
        """The body decoded with the ``Content-Type`` charset (default UTF-8), errors replaced."""
        return self.content.decode(_charset(self.headers.get("content-type")), errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON; :class:`ValueError` (``JSONDecodeError``) if it is not."""
        return json.loads(self.content)


# --------------------------------------------------------------------------- the pool

_CONNECT: Final = "connect"
_WRITE: Final = "write"
_READ: Final = "read"

_END_OF_MESSAGE: Final = h11.EndOfMessage()
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_BODY_METHODS: Final = frozenset({b"POST", b"PUT", b"PATCH"})
_CACHE_LIMIT: Final = 1024
#: A deadline already within this many seconds of where it should go is left as it is:
#: moving one costs Trio a re-registration, and for a request sent and read at once the
#: write deadline and the read deadline land microseconds apart.
_DEADLINE_SLACK: Final = 1e-3
#: Seconds an idle connection may wait before its reuse costs a readability probe.
_PROBE_AFTER: Final = 1.0
#: Methods whose responses h11 parses even when llhttp is used (see _Head.h11_response).
_H11_METHODS: Final = frozenset({b"HEAD", b"CONNECT"})
#: The response parser of a pool not told otherwise: llhttp when httptools is installed.
_PARSER: Final[Literal["llhttp", "h11"]] = "llhttp" if _HAVE_LLHTTP else "h11"
#: The longest incomplete response head: h11's default ``max_incomplete_event_size``,
#: applied to llhttp too (which has no limit of its own).
_MAX_HEAD: Final = 16 * 1024


@attrs.define(eq=False)
class _Origin:
    """Scheme, host and port; one object per origin and pool, so it hashes by identity."""

    scheme: str
    host: str
    port: int
    host_header: bytes
    idle: list[_Connection] = attrs.field(factory=list)  # LIFO: the last is the most recent

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host_header.decode('ascii')}"


class _ResponseReader:
    """What llhttp calls while it parses the responses of one connection.

    The connection's one ``parser`` lives as long as the connection: after a complete
    response llhttp is at the start of the next one, and a connection whose response did
    not complete cleanly is closed. ``response`` is set when the final response is complete
    (a 1xx response is parsed as a message of its own and skipped); ``keep`` is whether
    the server keeps the connection; ``extra`` that bytes followed the response in the same
    read (the connection is then not reused; the response stands, as with h11).
    """

    __slots__ = (
        "chunks",
        "extra",
        "fields",
        "keep",
        "nfields",
        "parser",
        "reason",
        "response",
        "status",
        "until_eof",
    )

    def __init__(self) -> None:
        self.response: LeanResponse | None = None
        self.extra = False
        self.status = 0  # 0 until the head of the message is complete
        self.reason = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.nfields = 0  # the head's fields (a chunked body's trailers are dropped)
        self.chunks: list[bytes] = []
        self.keep = False
        self.until_eof = False  # the body ends when the server closes the connection
        # The parser keeps these bound methods: no per-response setup.
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        if self.response is not None:
            self.extra = True
        self.status = 0
        self.reason = b""
        self.fields = []
        self.until_eof = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason  # in pieces if the reason is split across reads

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self.status = parser.get_status_code()
        self.nfields = len(self.fields)
        self.keep = parser.should_keep_alive()
        if not self.keep:  # HTTP/1.0, Connection: close, or a body until EOF
            self._check_framing()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.status < 200 or self.response is not None:
            return  # a 1xx response (the final one follows), or a message after the response
        # h11 never keeps an HTTP/1.0 connection, even with Connection: keep-alive.
        if self.keep and self.parser.get_http_version() < "1.1":
            self.keep = False
        self.response = self.build()

    def build(self) -> LeanResponse:
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        fields = self.fields
        if len(fields) != self.nfields:
            fields = fields[: self.nfields]
        return LeanResponse(self.status, self.reason.decode("latin-1"), LeanHeaders(fields), body)

    def _check_framing(self) -> None:
        """Whether the body runs until EOF (no Content-Length, not chunked; llhttp has no
        call for EOF), and refuse a Transfer-Encoding other than chunked, as h11 does."""
        length = False
        codings: list[bytes] = []
        for name, value in self.fields[: self.nfields]:
            lowered = name.lower()
            if lowered == b"content-length":
                length = True
            elif lowered == b"transfer-encoding":
                codings += [c.strip() for c in value.lower().split(b",") if c.strip()]
        if codings and codings != [b"chunked"]:
            msg = "Only Transfer-Encoding: chunked is supported"
            raise RemoteProtocolError(msg)  # llhttp raises HttpParserCallbackError from it
        status = self.status
        self.until_eof = not length and not codings and status >= 200 and status not in (204, 304)


@attrs.define(eq=False)
class _Connection:
    origin: _Origin
    stream: trio.abc.Stream
    socket: trio.socket.SocketType  # closed synchronously to drop the connection
    h11: h11.Connection | None  # the h11 parser, or None: llhttp (h11 only for HEAD)
    reader: _ResponseReader | None  # the llhttp parser, or None: h11
    last_used: float = 0.0
    phase: str = _WRITE
    closed: bool = False
    reusable: bool = False  # the last request completed a clean keep-alive HTTP cycle


@attrs.frozen(eq=False)
class _Target:
    origin: _Origin
    target: bytes  # path and query, as sent in the request line


@attrs.frozen(kw_only=True)
class _Head:
    """A request's head for one URL, method and header set, built and validated once.

    h11 serializes the real head once; per request only ``Content-Length`` and the body
    are appended. When h11 parses the response, its state machine is driven with
    ``standin``, a request of the same method and keep-alive intent and an empty body: all
    h11 needs to read the response (HEAD has no body; ``Connection: close`` ends the
    connection), at a fraction of the cost of building and serializing the full request
    event each time.
    """

    prefix: bytes  # request line and headers, up to the Content-Length field
    standin: h11.Request
    body_method: bool  # POST/PUT/PATCH: send Content-Length even for an empty body
    close: bool  # the request says Connection: close
    h11_response: bool  # HEAD or CONNECT: h11 parses the response even on an llhttp pool


class _Fresh:
    """The slot is held but has no connection yet: open one."""


_FRESH: Final = _Fresh()


class _StaleConnection(Exception):
    """A reused connection failed before any response byte: send once more on a new one."""


OpenStream = Callable[[str, int], Awaitable[trio.SocketStream]]


class ConnectionPool:
    """An HTTP/1.1 client connection pool for Trio, shared by every origin.

    Args:
        max_connections: the most connections open at once, over all origins; also the
            most requests in flight (each request holds one connection).
        keepalive_expiry: seconds an idle connection may be kept; an older one is closed
            instead of reused.
        timeouts: the limits for connect, write, read and waiting for a slot.
        max_keepalive_connections: idle connections kept for reuse (by default
            ``max_connections``); a connection released beyond it is closed.
        ssl_context: the TLS configuration for ``https`` URLs; by default
            :func:`ssl.create_default_context` (system CAs, hostname checking).
        user_agent: the ``User-Agent`` header sent unless the request sets its own.
        _parser: the response parser, for tests: ``"llhttp"`` (needs ``httptools``) or
            ``"h11"``; by default llhttp if ``httptools`` is installed, else h11.
    """

    def __init__(
        self,
        *,
        max_connections: int,
        keepalive_expiry: float,
        timeouts: Timeout,
        max_keepalive_connections: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "trio-rollouts",
        _open_stream: OpenStream | None = None,
        _parser: Literal["llhttp", "h11"] | None = None,
    ) -> None:
        if max_connections < 1:
            msg = f"max_connections={max_connections!r} is invalid: it must be at least 1"
            raise ValueError(msg)
        if not keepalive_expiry >= 0:
            msg = (
                f"keepalive_expiry={keepalive_expiry!r} is invalid: use the seconds an idle "
                "connection may be kept (>= 0)"
            )
            raise ValueError(msg)
        self._max = max_connections
        self._max_idle = (
            max_connections if max_keepalive_connections is None else max_keepalive_connections
        )
        self._keepalive_expiry = keepalive_expiry
        self._timeouts = timeouts
        self._ssl_context = ssl_context
        self._user_agent = user_agent.encode("ascii")
        # Tests inject an opener to simulate slow or failing connects (only loopback is real).
        self._open_stream: OpenStream = _open_stream or self._open_tcp
        self._lookups = NameLookups()
        # Tasks inside a name lookup: a connect timeout there says so (see _open_tcp).
        self._resolving: set[trio.lowlevel.Task] = set()
        if _parser is None:
            _parser = _PARSER
        if _parser not in ("llhttp", "h11") or (_parser == "llhttp" and not _HAVE_LLHTTP):
            msg = f"_parser={_parser!r} is invalid: use 'h11', or 'llhttp' with httptools installed"
            raise ValueError(msg)
        self._llhttp = _parser == "llhttp"
        self._origins: dict[tuple[str, str, int], _Origin] = {}
        self._targets: dict[str, _Target] = {}
        self._heads: dict[tuple[_Target, str, tuple[tuple[str, str], ...]], _Head] = {}
        self._connections: set[_Connection] = set()
        self._idle_count = 0
        self._active = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._waiting_origin: dict[trio.lowlevel.Task, _Origin] = {}
        self._grants: dict[trio.lowlevel.Task, _Connection | _Fresh] = {}

    # ----------------------------------------------------------------- public API

    def statistics(self) -> PoolStatistics:
        """Open, idle and in-use connections, and the requests waiting for a slot."""
        return PoolStatistics(
            connections=len(self._connections),
            idle=self._idle_count,
            active=self._active,
            waiting=len(self._lot),
        )

    async def aclose(self) -> None:
        """Close every connection, idle or in use; the pool stays usable.

        Requests in flight on a closed connection fail with :class:`ReadError` or
        :class:`WriteError`; waiting requests are then given slots and open new
        connections, as is any later request. Idempotent. The connections are closed
        synchronously before the checkpoint, so they are closed even if this is cancelled.
        """
        for origin in self._origins.values():
            self._idle_count -= len(origin.idle)
            origin.idle.clear()
        for conn in list(self._connections):
            self._discard(conn)
        # A waiter handed an idle connection that has not run yet gets a new one instead.
        for task, got in self._grants.items():
            if isinstance(got, _Connection):
                self._grants[task] = _FRESH
        self._dispatch()
        await trio.lowlevel.checkpoint()

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: Sequence[tuple[str, str]] = (),
        content: bytes | Callable[[], bytes] = b"",
    ) -> LeanResponse:
        """Send one request and return the whole response.

        Args:
            method: the HTTP method, such as ``"POST"``.
            url: an absolute ``http://`` or ``https://`` URL (IPv6 hosts in brackets).
            headers: extra request headers; ``Host``, ``User-Agent`` (unless given) and
                ``Content-Length`` are added.
            content: the request body, or a function that returns it: called once the
                request holds a connection slot, right before it is sent, so that a body
                built from shared state sees that state as it is then (not as it was
                when the request started waiting for a slot). Its exceptions propagate,
                and the slot is released.

        Raises:
            ValueError: the URL or a header is invalid (nothing was sent).
            ConnectError, ReadError, WriteError: the connection failed.
            RemoteProtocolError: the server broke HTTP/1.1 or closed without answering.
            ConnectTimeout, ReadTimeout, WriteTimeout, PoolTimeout: a phase took too long.

        Always a checkpoint (it does I/O). Cancellation at any point is safe: the request is
        abandoned, its connection closed unless it had completed a clean HTTP cycle, and its
        slot released (a waiter woken) before ``Cancelled`` propagates. A request on a
        reused connection that fails before any response byte arrives is sent once more on
        a new connection (see the module docstring); no other request is retried.
        """
        target = self._targets.get(url)
        if target is None:
            target = self._parse(url)
        origin = target.origin
        head = self._head(method, target, headers)

        got: _Connection | _Fresh | None = None
        if not self._lot:  # never overtake a waiting request
            got = self._take(origin, trio.current_time())
        if got is None:
            got = await self._wait_for_slot(origin)
        # From here on this task holds a slot: every way out releases it.
        conn = None if isinstance(got, _Fresh) else got
        timeouts = self._timeouts
        try:
            if not isinstance(content, bytes):
                content = content()
            with trio.CancelScope() as scope:
                while True:
                    reused = conn is not None
                    if conn is None:
                        if timeouts.connect is not None:
                            scope.deadline = trio.current_time() + timeouts.connect
                        else:  # a retry comes here with the read deadline set
                            scope.deadline = math.inf
                        conn = await self._connect(origin)
                    try:
                        response = await self._exchange(conn, head, content, scope, reused)
                        break
                    except _StaleConnection:
                        self._discard(conn)
                        conn = None
            if scope.cancelled_caught or conn is None:  # (conn is set unless it timed out)
                raise self._timeout_error(conn, origin)
            if conn.reusable:
                conn.last_used = trio.current_time()
            else:
                self._discard(conn)
                conn = None
        except BaseException:
            if conn is not None:
                self._discard(conn)
            if self._resolving:
                self._resolving.discard(trio.lowlevel.current_task())
            self._release(None)
            raise
        self._release(conn)
        return response

    # ----------------------------------------------------------------- one request

    async def _exchange(
        self,
        conn: _Connection,
        head: _Head,
        content: bytes,
        scope: trio.CancelScope,
        reused: bool,
    ) -> LeanResponse:
        """Send the request on ``conn`` and read its response; the caller cleans up.

        Sets ``conn.reusable`` when the response is complete and the connection may be
        kept; any exception leaves the connection to be closed.
        """
        stream = conn.stream
        timeouts = self._timeouts
        conn.phase = _WRITE
        reader = None if head.h11_response else conn.reader
        if reader is None:  # h11 reads the response
            # On an llhttp connection h11 reads just this one response (to HEAD).
            h = conn.h11 if conn.h11 is not None else h11.Connection(h11.CLIENT)
            # h11 tracks the request through a stand-in of the same method (see _Head); the
            # bytes sent are the real head, serialized by h11 once per distinct header set.
            h.send(head.standin)
            h.send(_END_OF_MESSAGE)
        if content or head.body_method:
            data = b"%sContent-Length: %d\r\n\r\n%s" % (head.prefix, len(content), content)
        else:
            data = head.prefix + b"\r\n"
        # The deadline carries over from the previous phase (connect): always reset it.
        if timeouts.write is not None:
            _move_deadline(scope, timeouts.write)
        elif scope.deadline != math.inf:
            scope.deadline = math.inf
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if reused and isinstance(exc, trio.BrokenResourceError):
                raise _StaleConnection from exc
            msg = f"sending the request to {conn.origin} failed: {_describe(exc)}"
            raise WriteError(msg) from exc

        conn.phase = _READ
        read_timeout = timeouts.read
        if read_timeout is None and scope.deadline != math.inf:
            scope.deadline = math.inf
        if reader is None:
            return await self._receive_h11(conn, h, scope, reused)

        # llhttp: feed each read to the connection's parser until the final response is
        # complete; _ResponseReader collects it.
        feed = reader.parser.feed_data
        received = 0
        while True:
            chunk = await self._receive(conn, scope, read_timeout, reused, received)
            if not chunk:
                if not received:
                    if reused:
                        raise _StaleConnection
                    msg = f"{conn.origin} closed the connection without sending a response"
                    raise RemoteProtocolError(msg)
                if reader.until_eof:  # EOF ends this body (llhttp waits for a finish call)
                    conn.reusable = False
                    return reader.build()
                msg = f"{conn.origin} closed the connection mid-response after {received} bytes"
                raise ReadError(msg)
            received += len(chunk)
            try:
                feed(chunk)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                response = reader.response
                if response is None:
                    raise self._llhttp_error(conn, exc) from exc
                # Bytes after the response that are not a response: keep the response
                # and close the connection, as h11 does.
                reader.response = None
                conn.reusable = False
                return response
            response = reader.response
            if response is not None:
                reader.response = None
                conn.reusable = reader.keep and not reader.extra and not head.close
                return response
            if not reader.status and received > _MAX_HEAD:
                msg = (
                    f"{conn.origin} sent an invalid HTTP/1.1 response: no complete head in "
                    f"the first {received} bytes (the limit is {_MAX_HEAD})"
                )
                raise RemoteProtocolError(msg)

    async def _receive_h11(
        self, conn: _Connection, h: h11.Connection, scope: trio.CancelScope, reused: bool
    ) -> LeanResponse:
        """Read the response with h11 (the request was sent: ``h`` is in SEND_RESPONSE)."""
        read_timeout = self._timeouts.read
        received = 0
        status = 0
        reason = b""
        fields: Sequence[tuple[bytes, bytes]] = ()
        chunks: list[bytes | bytearray] = []
        while True:
            try:
                got = h.next_event()
            except h11.RemoteProtocolError as exc:
                raise self._protocol_error(conn, h, exc, received) from exc
            if got is h11.NEED_DATA:
                chunk = await self._receive(conn, scope, read_timeout, reused, received)
                if not chunk and not received:
                    if reused:
                        raise _StaleConnection
                    msg = f"{conn.origin} closed the connection without sending a response"
                    raise RemoteProtocolError(msg)
                received += len(chunk)
                h.receive_data(bytes(chunk))  # (no copy: it is bytes already)
                continue
            if isinstance(got, h11.Data):
                chunks.append(got.data)
            elif isinstance(got, h11.Response):
                status = got.status_code
                reason = got.reason
                fields = got.headers
            elif isinstance(got, h11.EndOfMessage):
                break
            elif isinstance(got, h11.ConnectionClosed):
                msg = f"{conn.origin} closed the connection mid-response after {received} bytes"
                raise ReadError(msg)
            # InformationalResponse (1xx): skipped; h11 then reads the final response.
        body = bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
        keep = h.our_state is h11.DONE and h.their_state is h11.DONE
        # Not after bytes beyond the response, nor after EOF (which ends an HTTP/1.1 body
        # without Content-Length while h11 still deems the connection keep-alive).
        leftover, closed = h.trailing_data
        if keep and not leftover and not closed:
            h.start_next_cycle()
            conn.reusable = True
        else:
            conn.reusable = False
        return LeanResponse(status, reason.decode("latin-1"), LeanHeaders(fields), body)

    async def _receive(
        self,
        conn: _Connection,
        scope: trio.CancelScope,
        read_timeout: float | None,
        reused: bool,
        received: int,
    ) -> bytes | bytearray:
        """One read of a response, under the read deadline. A broken connection is a
        :class:`ReadError`, or ``_StaleConnection`` when a reused one broke before any
        response byte."""
        if read_timeout is not None:
            _move_deadline(scope, read_timeout)
        try:
            return await conn.stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if reused and not received and isinstance(exc, trio.BrokenResourceError):
                raise _StaleConnection from exc
            msg = (
                f"receiving the response from {conn.origin} failed after {received} "
                f"bytes: {_describe(exc)}"
            )
            raise ReadError(msg) from exc

    def _protocol_error(
        self, conn: _Connection, h: h11.Connection, exc: h11.RemoteProtocolError, received: int
    ) -> LeanHTTPError:
        if h.trailing_data[1]:  # we fed h11 the EOF: the server hung up mid-response
            msg = f"{conn.origin} closed the connection mid-response after {received} bytes ({exc})"
            return ReadError(msg)
        msg = f"{conn.origin} sent an invalid HTTP/1.1 response: {exc}"
        return RemoteProtocolError(msg)

    def _llhttp_error(self, conn: _Connection, exc: Exception) -> RemoteProtocolError:
        if isinstance(exc, httptools.HttpParserUpgrade):
            detail = "it switched protocols (101) though no upgrade was asked for"
        elif isinstance(exc.__context__, RemoteProtocolError):  # raised by a callback
            detail = str(exc.__context__)
        else:
            detail = str(exc) or type(exc).__name__
        msg = f"{conn.origin} sent an invalid HTTP/1.1 response: {detail}"
        return RemoteProtocolError(msg)

    def _timeout_error(self, conn: _Connection | None, origin: _Origin) -> LeanTimeout:
        timeouts = self._timeouts
        if conn is None:
            advice = timeout_advice("connect", timeouts.connect)
            task = trio.lowlevel.current_task()
            if task in self._resolving:
                self._resolving.discard(task)
                msg = f"looking up the host name {origin.host!r} took longer than {advice}"
                return ConnectTimeout(msg)
            return ConnectTimeout(f"connecting to {origin} took longer than {advice}")
        if conn.phase == _WRITE:
            advice = timeout_advice("write", timeouts.write)
            return WriteTimeout(f"sending the request to {origin} took longer than {advice}")
        advice = timeout_advice("read", timeouts.read)
        return ReadTimeout(f"{origin} sent nothing for {advice}")

    def _head(self, method: str, target: _Target, headers: Sequence[tuple[str, str]]) -> _Head:
        key = (target, method, headers if type(headers) is tuple else tuple(headers))
        head = self._heads.get(key)
        if head is None:
            head = self._build_head(*key)
        return head

    def _build_head(
        self, target: _Target, method: str, headers: tuple[tuple[str, str], ...]
    ) -> _Head:
        try:
            method_bytes = method.encode("ascii")
            given = [(name.encode("ascii"), value.encode("latin-1")) for name, value in headers]
        except UnicodeEncodeError as exc:
            msg = f"cannot encode {method} {headers!r} for HTTP/1.1: {exc}"
            raise ValueError(msg) from None
        names = {name.lower() for name, _ in given}
        if b"transfer-encoding" in names:
            msg = (
                f"headers={headers!r}: do not set Transfer-Encoding; the pool sends the body "
                "with Content-Length"
            )
            raise ValueError(msg)
        fields = [] if b"host" in names else [(b"Host", target.origin.host_header)]
        if b"user-agent" not in names:
            fields.append((b"User-Agent", self._user_agent))
        fields += [pair for pair in given if pair[0].lower() != b"content-length"]
        close = any(
            name.lower() == b"connection"
            and b"close" in value.lower().replace(b" ", b"").split(b",")
            for name, value in given
        )
        try:
            request = h11.Request(method=method_bytes, target=target.target, headers=fields)
            standin = h11.Request(
                method=method_bytes,
                target=b"/",
                headers=[(b"Host", b"-"), *([(b"Connection", b"close")] if close else [])],
            )
            serialized = h11.Connection(h11.CLIENT).send(request)
        except h11.LocalProtocolError as exc:
            msg = f"invalid request {method} {target.origin} with headers={headers!r}: {exc}"
            raise ValueError(msg) from None
        head = _Head(
            prefix=serialized[:-2],  # without the blank line that ends the head
            standin=standin,
            body_method=method_bytes in _BODY_METHODS,
            close=close,
            h11_response=method_bytes in _H11_METHODS,
        )
        if len(self._heads) >= _CACHE_LIMIT:
            self._heads.clear()
        self._heads[target, method, headers] = head
        return head

    def _parse(self, url: str) -> _Target:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            msg = f"invalid URL {url!r}: {exc}"
            raise ValueError(msg) from None
        scheme = parts.scheme.lower()
        host = parts.hostname
        if scheme not in _DEFAULT_PORTS or not host:
            msg = f"unsupported URL {url!r}: use an absolute http:// or https:// URL with a host"
            raise ValueError(msg)
        if port is None:
            port = _DEFAULT_PORTS[scheme]
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        try:
            target_bytes = path.encode("ascii")
            host_header = f"[{host}]" if ":" in host else host
            if port != _DEFAULT_PORTS[scheme]:
                host_header = f"{host_header}:{port}"
            host_bytes = host_header.encode("ascii")
        except UnicodeEncodeError:
            msg = f"unsupported URL {url!r}: percent-encode its path and use an ASCII host"
            raise ValueError(msg) from None
        origin = self._origins.get((scheme, host, port))
        if origin is None:
            origin = self._origins[scheme, host, port] = _Origin(scheme, host, port, host_bytes)
        target = _Target(origin, target_bytes)
        if len(self._targets) >= _CACHE_LIMIT:
            self._targets.clear()
        self._targets[url] = target
        return target

    # ----------------------------------------------------------------- connections

    async def _connect(self, origin: _Origin) -> _Connection:
        try:
            # trio.SocketStream sets TCP_NODELAY itself.
            tcp = await self._open_stream(origin.host, origin.port)
        except OSError as exc:
            msg = f"could not connect to {origin}: {_describe(exc)}"
            raise ConnectError(msg) from exc
        stream: trio.abc.Stream = tcp
        sock = tcp.socket
        if origin.tls:
            tls = trio.SSLStream(
                tcp, self._tls_context(), server_hostname=origin.host, https_compatible=True
            )
            try:
                await tls.do_handshake()
            except BaseException as exc:
                sock.close()
                if isinstance(exc, trio.BrokenResourceError):
                    msg = f"the TLS handshake with {origin} failed: {_describe(exc)}"
                    raise ConnectError(msg) from exc
                raise
            stream = tls
        if self._llhttp:
            conn = _Connection(origin, stream, sock, None, _ResponseReader())
        else:
            conn = _Connection(origin, stream, sock, h11.Connection(h11.CLIENT), None)
        self._connections.add(conn)
        return conn

    async def _open_tcp(self, host: str, port: int) -> trio.SocketStream:
        """``trio.open_tcp_stream``, with one name lookup per host at a time.

        Concurrent connects to a host share one lookup (:class:`NameLookups`), so a name
        that does not resolve fails them all at once rather than reading as connect
        timeouts; then the addresses are tried as ``open_tcp_stream`` does: in order, the
        next one started when one fails or has not connected after 250 ms.
        """
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:  # an address: nothing to look up, no thread
            return await trio.open_tcp_stream(host, port)
        task = trio.lowlevel.current_task()
        self._resolving.add(task)
        # If this is cancelled, the mark stays: request() reads and clears it.
        addresses = await self._lookups.addresses(host, port)
        self._resolving.discard(task)
        return await _connect_first(addresses, host, port)

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            context = ssl.create_default_context()
            context.set_alpn_protocols(["http/1.1"])
            self._ssl_context = context
        return self._ssl_context

    def _discard(self, conn: _Connection) -> None:
        """Close ``conn`` now, synchronously (safe in any cleanup path, even cancelled)."""
        if not conn.closed:
            conn.closed = True
            conn.socket.close()
            self._connections.discard(conn)

    def _usable(self, conn: _Connection, now: float) -> bool:
        idle = now - conn.last_used
        if idle > self._keepalive_expiry:
            return False
        # An idle HTTP/1.1 connection that is readable has EOF or garbage waiting. The
        # probe is a system call, so a connection idle for less than _PROBE_AFTER is
        # taken without it: servers close idle connections after seconds, not
        # milliseconds, and one that did is caught by the stale-connection retry.
        return idle < _PROBE_AFTER or not conn.socket.is_readable()

    # ----------------------------------------------------------------- slots

    def _take(self, origin: _Origin, now: float) -> _Connection | _Fresh | None:
        """Claim a slot for ``origin`` if one is free: an idle connection, or room for a new
        one (closing another origin's idle connection if needed). ``None``: wait."""
        idle = origin.idle
        while idle:
            conn = idle.pop()
            self._idle_count -= 1
            if self._usable(conn, now):
                self._active += 1
                return conn
            self._discard(conn)
        if self._active + self._idle_count >= self._max:
            if not self._idle_count:
                return None
            self._evict_idle()
        self._active += 1
        return _FRESH

    def _evict_idle(self) -> None:
        """Close the least recently used idle connection (of another origin)."""
        oldest: list[_Connection] | None = None
        for origin in self._origins.values():
            idle = origin.idle
            if idle and (oldest is None or idle[0].last_used < oldest[0].last_used):
                oldest = idle
        if oldest is not None:
            self._idle_count -= 1
            self._discard(oldest.pop(0))

    async def _wait_for_slot(self, origin: _Origin) -> _Connection | _Fresh:
        task = trio.lowlevel.current_task()
        self._waiting_origin[task] = origin
        try:
            with trio.move_on_after(
                math.inf if self._timeouts.pool is None else self._timeouts.pool
            ):
                await self._lot.park()
        finally:
            self._waiting_origin.pop(task, None)
        # A slot handed over by _dispatch (which also unparked us) is in _grants; if park
        # ended by the timeout instead, there is none and nothing to give back.
        got = self._grants.pop(task, None)
        if got is None:
            advice = timeout_advice("pool", self._timeouts.pool)
            msg = (
                f"no connection slot for {origin} (max_connections={self._max}) became free "
                f"within {advice}"
            )
            raise PoolTimeout(msg)
        return got

    def _release(self, conn: _Connection | None) -> None:
        """Give back a slot, with its connection to keep idle (or ``None``: it was closed)."""
        self._active -= 1
        if conn is not None:
            if self._idle_count < self._max_idle:
                conn.origin.idle.append(conn)
                self._idle_count += 1
            else:
                self._discard(conn)
        if self._lot:
            self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to waiters, first come first served, while any are free.

        A slot is free when a connection is idle (of any origin: _take closes another
        origin's idle connection to make room) or fewer than max_connections are in use,
        so _take cannot return None here.
        """
        now = trio.current_time()
        while self._lot and (self._idle_count or self._active < self._max):
            (task,) = self._lot.unpark()
            got = self._take(self._waiting_origin.pop(task), now)
            if got is not None:
                self._grants[task] = got


class NameLookups:
    """Host name lookups, one at a time per host and port: concurrent callers share the
    lookup under way (and its failure). Nothing is kept after a lookup ends, so a name
    that changes its addresses is seen at the next connect.

    Trio looks a name up in a worker thread, and at most 40 such threads run at once (its
    default limiter): hundreds of concurrent connects to one host, each looking it up,
    would queue for a thread past their connect timeout.
    """

    def __init__(self) -> None:
        self._under_way: dict[tuple[str, int], _Lookup] = {}

    async def addresses(self, host: str, port: int) -> list[str]:
        """The addresses of ``host`` (RFC 6555 order), or ``socket.gaierror`` (an
        ``OSError``) raised in every task that waited for the failed lookup.

        Cancellation: cancellable; if the task doing the lookup is cancelled, a task that
        waited for it does it again.
        """
        key = (host, port)
        while (lookup := self._under_way.get(key)) is not None:
            await lookup.done.wait()
            if lookup.addresses is not None:
                return lookup.addresses
            if lookup.error is not None:
                # A new exception per task: one raised in several tasks gets tangled.
                raise type(lookup.error)(*lookup.error.args)
        lookup = self._under_way[key] = _Lookup()
        try:
            found = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
            lookup.addresses = _ordered_addresses(found)
            return lookup.addresses
        except OSError as exc:
            lookup.error = exc
            raise
        finally:
            del self._under_way[key]
            lookup.done.set()


@attrs.define(eq=False)
class _Lookup:
    """A name lookup under way, shared by the connects that wait for it."""

    done: trio.Event = attrs.field(factory=trio.Event)
    addresses: list[str] | None = None
    error: OSError | None = None


#: Seconds before the next address is tried while a connect attempt is pending (RFC 6555,
#: trio.open_tcp_stream's default).
_HAPPY_EYEBALLS_DELAY: Final = 0.25


def _ordered_addresses(found: Sequence[tuple[Any, ...]]) -> list[str]:
    """The distinct addresses of a lookup, in its order, except that the first address of
    the other family is moved second (RFC 6555 section 5.4, as trio does)."""
    addresses: list[str] = []
    families: list[int] = []
    for family, _, _, _, sockaddr in found:
        if sockaddr[0] not in addresses:
            addresses.append(str(sockaddr[0]))
            families.append(family)
    other = next((i for i, family in enumerate(families) if family != families[0]), None)
    if other is not None and other > 1:
        addresses.insert(1, addresses.pop(other))
    return addresses


async def _connect_first(addresses: list[str], host: str, port: int) -> trio.SocketStream:
    """A connection to the first of ``addresses`` that accepts, trying the next when one
    fails or is still pending after ``_HAPPY_EYEBALLS_DELAY``. Raises ``OSError`` (from an
    ``ExceptionGroup`` of each failure) when none accepts, as ``trio.open_tcp_stream`` does."""
    if len(addresses) == 1:
        return await trio.open_tcp_stream(addresses[0], port)
    winner: trio.SocketStream | None = None
    errors: list[OSError] = []

    async def attempt(address: str, failed: trio.Event) -> None:
        nonlocal winner
        try:
            stream = await trio.open_tcp_stream(address, port)
        except OSError as exc:
            errors.append(exc)
            failed.set()
            return
        if winner is None:
            winner = stream
            nursery.cancel_scope.cancel()
        else:  # another attempt connected at the same instant
            stream.socket.close()

    async with trio.open_nursery() as nursery:
        for address in addresses:
            failed = trio.Event()
            nursery.start_soon(attempt, address, failed)
            with trio.move_on_after(_HAPPY_EYEBALLS_DELAY):
                await failed.wait()
    if winner is None:
        msg = f"all attempts to connect to {host}:{port} failed"
        raise OSError(msg) from ExceptionGroup(msg, errors)
    return winner


def _move_deadline(scope: trio.CancelScope, seconds: float) -> None:
    """Set ``scope``'s deadline ``seconds`` from now, unless it is there already (within
    _DEADLINE_SLACK)."""
    deadline = trio.current_time() + seconds
    if abs(deadline - scope.deadline) > _DEADLINE_SLACK:
        scope.deadline = deadline


def _describe(exc: BaseException) -> str:
    """The exception and its cause, e.g. ``BrokenResourceError: ConnectionResetError(104...)``;
    an exception group as its leaves (``all attempts to connect to ... failed: [Errno 111]
    Connection refused``), never its repr."""
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if isinstance(cause, BaseExceptionGroup):
        leaves = dict.fromkeys(str(leaf) or type(leaf).__name__ for leaf in _leaves(cause))
        text = f"{text}: {'; '.join(leaves)}"
    elif cause is not None and str(cause) not in text:
        text = f"{text} ({type(cause).__name__}: {cause})"
    return text


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    """The group's leaves; a leaf raised from a group (trio's connect error per address)
    stands for that group's leaves."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        elif isinstance(exc.__cause__, BaseExceptionGroup):
            yield from _leaves(exc.__cause__)
        else:
            yield exc
