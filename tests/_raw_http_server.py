"""A scriptable raw-socket HTTP server on 127.0.0.1 for the connection-pool tests.

Each accepted connection is handed to the test's handler as a :class:`RawConnection`,
which reads requests with h11 (server side) and writes whatever bytes the test wants:
well-formed responses, responses split at chosen byte boundaries, truncated bodies, resets,
half-closes. Nothing here is a mock of the client: the pool under test speaks real HTTP over
loopback. Optionally the server wraps each connection in TLS (:func:`raw_server`'s
``ssl_context``).
"""

from __future__ import annotations

import itertools
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import h11
import trio


@attrs.define(kw_only=True)
class ReceivedRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@attrs.define(eq=False)
class RawConnection:
    """One accepted connection: read requests, write raw bytes, end it in various ways."""

    stream: trio.abc.Stream
    socket: trio.socket.SocketType
    number: int
    _h11: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.SERVER))

    async def receive_request(self) -> ReceivedRequest | None:
        """The next request, or ``None`` if the client closed the connection first."""
        method = target = ""
        headers: dict[str, str] = {}
        body = bytearray()
        while True:
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return None
                self._h11.receive_data(data)
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                method, target = event.method.decode(), event.target.decode()
                headers = {n.decode(): v.decode("latin-1") for n, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                # The responses are raw bytes, so h11's server state is reset per request,
                # keeping whatever the client sent after this request.
                trailing, closed = self._h11.trailing_data
                self._h11 = h11.Connection(h11.SERVER)
                if trailing:  # (receive_data(b"") would mean EOF)
                    self._h11.receive_data(trailing)
                if closed:
                    self._h11.receive_data(b"")
                return ReceivedRequest(
                    method=method, target=target, headers=headers, body=bytes(body)
                )

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_in_pieces(self, data: bytes, cuts: list[int], pauses: list[int]) -> None:
        """Send ``data`` split at the offsets ``cuts``, with ``pauses[i]`` checkpoints after
        piece ``i`` (so the client sees the pieces in separate reads)."""
        bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            if start == end:
                continue
            await self.stream.send_all(data[start:end])
            for _ in range(pauses[i % len(pauses)] if pauses else 0):
                await trio.lowlevel.checkpoint()

    async def shutdown_write(self) -> None:
        """Half-close: the client reads EOF, but the server could still read."""
        self.socket.shutdown(socket.SHUT_WR)
        await trio.lowlevel.checkpoint()

    def reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0, then close)."""
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.socket.close()

    def close(self) -> None:
        self.socket.close()


Handler = Callable[[RawConnection], Awaitable[None]]


@attrs.define(eq=False)
class RawServer:
    port: int
    host: str
    scheme: str
    accepted: int = 0
    closed: int = 0  # connections whose handler returned (the socket was then closed)

    def url(self, path: str = "/") -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{path}"

    @property
    def open(self) -> int:
        return self.accepted - self.closed


@asynccontextmanager
async def raw_server(
    handler: Handler, *, host: str = "127.0.0.1", ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[RawServer]:
    """Serve ``handler`` on ``host`` (loopback) with an ephemeral port, inside the test's
    Trio run; the connection is closed when the handler returns, or when it fails because
    the client went away (``BrokenResourceError``)."""
    listeners = await trio.open_tcp_listeners(0, host=host)
    sockname = listeners[0].socket.getsockname()
    server = RawServer(
        port=sockname[1], host=host, scheme="https" if ssl_context is not None else "http"
    )

    async def serve_one(tcp: trio.SocketStream) -> None:
        number = server.accepted
        server.accepted += 1
        stream: trio.abc.Stream = tcp
        try:
            if ssl_context is not None:
                stream = trio.SSLStream(tcp, ssl_context, server_side=True)
                try:
                    await stream.do_handshake()
                except trio.BrokenResourceError:
                    return
            await handler(RawConnection(stream, tcp.socket, number))
        except trio.BrokenResourceError:
            pass  # the client went away mid-response (a cancelled request): normal for a server
        finally:
            server.closed += 1
            tcp.socket.close()

    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, serve_one, nursery)
        yield server
        nursery.cancel_scope.cancel()


async def _accept_loop(
    listener: trio.SocketListener,
    serve_one: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    async with listener:
        while True:
            stream = await listener.accept()
            nursery.start_soon(serve_one, stream)


def response(
    body: bytes = b"ok",
    *,
    status: int = 200,
    reason: bytes = b"OK",
    headers: list[tuple[bytes, bytes]] | None = None,
    chunks: list[int] | None = None,
    version: bytes = b"1.1",
) -> bytes:
    """A response's bytes: fixed-length, or chunked with the given chunk sizes (cycled)."""
    head = [b"HTTP/%s %d %s" % (version, status, reason)]
    head += [b"%s: %s" % pair for pair in headers or []]
    if chunks is None:
        head.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(head) + b"\r\n\r\n" + body
    head.append(b"Transfer-Encoding: chunked")
    out = [b"\r\n".join(head) + b"\r\n\r\n"]
    i = 0
    k = 0
    while i < len(body):
        size = max(1, chunks[k % len(chunks)])
        piece = body[i : i + size]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        i += size
        k += 1
    out.append(b"0\r\n\r\n")
    return b"".join(out)


async def answer_forever(conn: RawConnection, make: Callable[[ReceivedRequest], bytes]) -> None:
    """Answer every request on ``conn`` with ``make(request)`` until the client closes."""
    while (request := await conn.receive_request()) is not None:
        await conn.send(make(request))


@attrs.define(eq=False)
class ScriptedResolver(trio.abc.HostnameResolver):
    """Trio's name lookups for one test run, offline (``trio.socket.
    set_custom_hostname_resolver``): each name in ``names`` resolves to its addresses, any
    other name fails as a name that does not exist (``EAI_NONAME``; RFC 2606 reserves
    ``.invalid`` for such names). ``calls`` counts lookups; while ``gate`` is set (an
    unset event) each lookup waits for it; the first ``hang_first`` lookups never answer,
    as a lookup queued behind busy resolver threads."""

    names: dict[str, list[str]] = attrs.field(factory=dict)
    gate: trio.Event | None = None
    hang_first: int = 0
    calls: int = 0

    def install(self) -> ScriptedResolver:
        trio.socket.set_custom_hostname_resolver(self)
        return self

    async def getaddrinfo(
        self,
        host: bytes | None,
        port: bytes | str | int | None,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[str, int]]]:
        self.calls += 1
        if self.calls <= self.hang_first:
            await trio.sleep_forever()
        if self.gate is not None:
            await self.gate.wait()
        else:
            await trio.lowlevel.checkpoint()
        name = (host or b"").decode("ascii")
        if name not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert isinstance(port, int)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))
            for address in self.names[name]
        ]

    async def getnameinfo(self, sockaddr: tuple[str, int], flags: int) -> tuple[str, str]:
        raise NotImplementedError
