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

The parts: :mod:`._wire` (errors and responses, llhttp reading), :mod:`._connection`
(origins, connections, request heads), :mod:`._lookup` (name lookups and connecting).
"""

from __future__ import annotations

import ipaddress
import math
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Literal

import attrs
import h11
import trio

from trio_rollouts.inference._config import Timeout, timeout_advice
from trio_rollouts.inference.http._connection import (
    READ,
    WRITE,
    Connection,
    Head,
    Origin,
    RequestHeads,
)
from trio_rollouts.inference.http._lookup import NameLookups, connect_first
from trio_rollouts.inference.http._wire import (
    HAVE_LLHTTP,
    ConnectError,
    ConnectTimeout,
    LeanHeaders,
    LeanHTTPError,
    LeanResponse,
    LeanTimeout,
    PoolTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    ResponseReader,
    WriteError,
    WriteTimeout,
    describe,
)

if HAVE_LLHTTP:
    import httptools  # type: ignore[import-not-found, unused-ignore]

__all__ = ["ConnectionPool", "OpenStream", "PoolStatistics"]


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


# --------------------------------------------------------------------------- the pool

_END_OF_MESSAGE: Final = h11.EndOfMessage()
#: A deadline already within this many seconds of where it should go is left as it is:
#: moving one costs Trio a re-registration, and for a request sent and read at once the
#: write deadline and the read deadline land microseconds apart.
_DEADLINE_SLACK: Final = 1e-3
#: Seconds an idle connection may wait before its reuse costs a readability probe.
_PROBE_AFTER: Final = 1.0
#: The response parser of a pool not told otherwise: llhttp when httptools is installed.
_PARSER: Final[Literal["llhttp", "h11"]] = "llhttp" if HAVE_LLHTTP else "h11"
#: The longest incomplete response head: h11's default ``max_incomplete_event_size``,
#: applied to llhttp too (which has no limit of its own).
_MAX_HEAD: Final = 16 * 1024


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
        # Tests inject an opener to simulate slow or failing connects (only loopback is real).
        self._open_stream: OpenStream = _open_stream or self._open_tcp
        self._lookups = NameLookups()
        # Tasks inside a name lookup: a connect timeout there says so (see _open_tcp).
        self._resolving: set[trio.lowlevel.Task] = set()
        if _parser is None:
            _parser = _PARSER
        if _parser not in ("llhttp", "h11") or (_parser == "llhttp" and not HAVE_LLHTTP):
            msg = f"_parser={_parser!r} is invalid: use 'h11', or 'llhttp' with httptools installed"
            raise ValueError(msg)
        self._llhttp = _parser == "llhttp"
        self._heads = RequestHeads(user_agent.encode("ascii"))
        self._connections: set[Connection] = set()
        self._idle_count = 0
        self._active = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._waiting_origin: dict[trio.lowlevel.Task, Origin] = {}
        self._grants: dict[trio.lowlevel.Task, Connection | _Fresh] = {}

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
        for origin in self._heads.origins.values():
            self._idle_count -= len(origin.idle)
            origin.idle.clear()
        for conn in list(self._connections):
            self._discard(conn)
        # A waiter handed an idle connection that has not run yet gets a new one instead.
        for task, got in self._grants.items():
            if isinstance(got, Connection):
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
        heads = self._heads
        target = heads.targets.get(url)
        if target is None:
            target = heads.target(url)
        origin = target.origin
        head = heads.head(method, target, headers)

        got: Connection | _Fresh | None = None
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
        conn: Connection,
        head: Head,
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
        conn.phase = WRITE
        reader = None if head.h11_response else conn.reader
        if reader is None:  # h11 reads the response
            # On an llhttp connection h11 reads just this one response (to HEAD).
            h = conn.h11 if conn.h11 is not None else h11.Connection(h11.CLIENT)
            # h11 tracks the request through a stand-in of the same method (see Head); the
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
            msg = f"sending the request to {conn.origin} failed: {describe(exc)}"
            raise WriteError(msg) from exc

        conn.phase = READ
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
        self, conn: Connection, h: h11.Connection, scope: trio.CancelScope, reused: bool
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
        conn: Connection,
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
                f"bytes: {describe(exc)}"
            )
            raise ReadError(msg) from exc

    def _protocol_error(
        self, conn: Connection, h: h11.Connection, exc: h11.RemoteProtocolError, received: int
    ) -> LeanHTTPError:
        if h.trailing_data[1]:  # we fed h11 the EOF: the server hung up mid-response
            msg = f"{conn.origin} closed the connection mid-response after {received} bytes ({exc})"
            return ReadError(msg)
        msg = f"{conn.origin} sent an invalid HTTP/1.1 response: {exc}"
        return RemoteProtocolError(msg)

    def _llhttp_error(self, conn: Connection, exc: Exception) -> RemoteProtocolError:
        if isinstance(exc, httptools.HttpParserUpgrade):
            detail = "it switched protocols (101) though no upgrade was asked for"
        elif isinstance(exc.__context__, RemoteProtocolError):  # raised by a callback
            detail = str(exc.__context__)
        else:
            detail = str(exc) or type(exc).__name__
        msg = f"{conn.origin} sent an invalid HTTP/1.1 response: {detail}"
        return RemoteProtocolError(msg)

    def _timeout_error(self, conn: Connection | None, origin: Origin) -> LeanTimeout:
        timeouts = self._timeouts
        if conn is None:
            advice = timeout_advice("connect", timeouts.connect)
            task = trio.lowlevel.current_task()
            if task in self._resolving:
                self._resolving.discard(task)
                msg = f"looking up the host name {origin.host!r} took longer than {advice}"
                return ConnectTimeout(msg)
            return ConnectTimeout(f"connecting to {origin} took longer than {advice}")
        if conn.phase == WRITE:
            advice = timeout_advice("write", timeouts.write)
            return WriteTimeout(f"sending the request to {origin} took longer than {advice}")
        advice = timeout_advice("read", timeouts.read)
        return ReadTimeout(f"{origin} sent nothing for {advice}")

    # ----------------------------------------------------------------- connections

    async def _connect(self, origin: Origin) -> Connection:
        try:
            # trio.SocketStream sets TCP_NODELAY itself.
            tcp = await self._open_stream(origin.host, origin.port)
        except OSError as exc:
            msg = f"could not connect to {origin}: {describe(exc)}"
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
                    msg = f"the TLS handshake with {origin} failed: {describe(exc)}"
                    raise ConnectError(msg) from exc
                raise
            stream = tls
        if self._llhttp:
            conn = Connection(origin, stream, sock, None, ResponseReader())
        else:
            conn = Connection(origin, stream, sock, h11.Connection(h11.CLIENT), None)
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
        return await connect_first(addresses, host, port)

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            context = ssl.create_default_context()
            context.set_alpn_protocols(["http/1.1"])
            self._ssl_context = context
        return self._ssl_context

    def _discard(self, conn: Connection) -> None:
        """Close ``conn`` now, synchronously (safe in any cleanup path, even cancelled)."""
        if not conn.closed:
            conn.closed = True
            conn.socket.close()
            self._connections.discard(conn)

    def _usable(self, conn: Connection, now: float) -> bool:
        idle = now - conn.last_used
        if idle > self._keepalive_expiry:
            return False
        # An idle HTTP/1.1 connection that is readable has EOF or garbage waiting. The
        # probe is a system call, so a connection idle for less than _PROBE_AFTER is
        # taken without it: servers close idle connections after seconds, not
        # milliseconds, and one that did is caught by the stale-connection retry.
        return idle < _PROBE_AFTER or not conn.socket.is_readable()

    # ----------------------------------------------------------------- slots

    def _take(self, origin: Origin, now: float) -> Connection | _Fresh | None:
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
        oldest: list[Connection] | None = None
        for origin in self._heads.origins.values():
            idle = origin.idle
            if idle and (oldest is None or idle[0].last_used < oldest[0].last_used):
                oldest = idle
        if oldest is not None:
            self._idle_count -= 1
            self._discard(oldest.pop(0))

    async def _wait_for_slot(self, origin: Origin) -> Connection | _Fresh:
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

    def _release(self, conn: Connection | None) -> None:
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


def _move_deadline(scope: trio.CancelScope, seconds: float) -> None:
    """Set ``scope``'s deadline ``seconds`` from now, unless it is there already (within
    _DEADLINE_SLACK)."""
    deadline = trio.current_time() + seconds
    if abs(deadline - scope.deadline) > _DEADLINE_SLACK:
        scope.deadline = deadline
