"""The gateway's HTTP/1.1 server: one Trio task per connection, the protocol done by h11.

:func:`serve_http` listens with :func:`trio.serve_tcp` and gives each connection its own
task, which reads a request completely (h11 parses it and undoes ``Content-Length`` or
``chunked`` framing), awaits the handler, writes the response, and loops for the next
request on the same connection (keep-alive, as the openai SDK's connection pool expects).
The server knows nothing of OpenAI or sessions: routing and JSON are the handler's. A plain
:class:`HTTPResponse` is sent with ``Content-Length``; a :class:`StreamingResponse` (server-sent
events) is sent ``chunked``, each chunk as soon as its iterator yields it. h11 is the HTTP/1.1
state machine Hypercorn and httpcore use; ``benchmarks/gateway_http.py`` measures this server
beside Hypercorn's Trio worker.

Guarantees:

1. **A handler is never cancelled by its client.** A request is read whole before its handler
   starts, and the connection is not read again until the response is written, so a client
   that disconnects mid-request cannot interrupt the handler: work the handler commits (a
   model call) is committed whether or not anyone is still listening. Writing its response
   then fails quietly and the connection closes.
2. **A stream stops when its client goes.** If writing a chunk fails, the chunk iterator is
   not advanced again: it is closed (``aclose()``, when it has one) and so is the
   connection. The iterator is closed however the response ends.
3. **Nothing a handler does ends the server.** An exception escaping the handler becomes a 500
   in the OpenAI error shape (``{"error": {"message": "internal error: <type>", "type":
   "server_error", "code": 500}}``) and is logged (logger ``trio_rollouts.gateway``); the
   connection stays usable. An exception from a stream's iterator, once its head is sent, is
   logged and ends the connection without the body's last chunk, so the client sees a
   truncated response, not a complete one.
4. **Bad requests are refused, then the connection is closed.** A request h11 cannot parse
   gets 400 (or 431 for an oversized head, h11's hint); a body larger than ``max_body``
   gets 413, before any of it is read when ``Content-Length`` declares it (so a client
   sending ``Expect: 100-continue`` is never told to continue). The refusal is sent with
   ``Connection: close``, and the connection stops sending and discards what the client
   still sends for up to two seconds before closing, so the refusal is not lost to a TCP
   reset.
5. **Cancelling** :func:`serve_http` closes the listener and every connection promptly;
   handlers in flight are cancelled with it.

Not done here: TLS, HTTP/2, idle or slow-client timeouts (the gateway serves loopback
clients), trailers, and ``Upgrade``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from functools import partial

import attrs
import h11
import trio

__all__ = ["HTTPRequest", "HTTPResponse", "Handler", "StreamingResponse", "serve_http"]

logger = logging.getLogger("trio_rollouts.gateway")

_RECEIVE_SIZE = 65_536
# How long a refused connection discards what its client still sends before closing.
_LINGER_SECONDS = 2.0


@attrs.frozen
class HTTPRequest:
    """A complete request, as the handler receives it.

    Attributes:
        method: the method as sent (``"GET"``, ``"POST"``, ...).
        path: the request target up to ``?``, not percent-decoded.
        query: the raw query string after ``?`` (``""`` if none).
        headers: lower-case names to values; a name sent more than once has its values
            joined with ``", "`` in the order sent (RFC 9110, section 5.3), so that no
            value is silently dropped (a repeated ``X-Session-ID`` names no session).
        body: the whole body, de-chunked.
    """

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    body: bytes


@attrs.frozen
class HTTPResponse:
    """A response sent whole, with ``Content-Length``.

    ``headers`` are extra headers; ``Content-Type`` and ``Content-Length`` are set from
    ``content_type`` and ``body``. The body is not sent to ``HEAD`` requests, nor with 204
    or 304.
    """

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class StreamingResponse:
    """A response sent as its chunks come (server-sent events), with chunked framing.

    Each item of ``chunks`` is sent as it is, so it must be a complete frame
    (``b"data: {...}\\n\\n"``). The server closes ``chunks`` (``aclose()``, if it has one)
    when the response ends, whether it ended by exhausting it or not.
    """

    status: int
    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[HTTPRequest], Awaitable[HTTPResponse | StreamingResponse]]


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    max_body: int = 32 * 2**20,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP/1.1 on ``host:port`` with ``handler`` until cancelled.

    Use it with ``await nursery.start(serve_http, handler, "127.0.0.1", 0)``, which returns
    ``(host, port)`` once the server is listening, ``port`` being the bound one (useful with
    ``port=0``). ``host`` should be an address: a name that resolves to several addresses is
    served on all of them, and with ``port=0`` each gets its own port, the first reported.

    Each request is passed to ``handler`` once its body is complete; see the module's
    docstring for what happens when the client goes away (the handler is not cancelled) or
    the handler raises (a 500). A body over ``max_body`` bytes is refused with 413.

    Cancellation: cancelling this call closes the listener and every connection, cancelling
    the handlers in flight; it returns (raises ``Cancelled``) once they have ended.
    """
    if max_body < 0:
        msg = f"max_body must be a number of bytes >= 0, not {max_body!r}"
        raise ValueError(msg)
    serve_connection = partial(_serve_connection, handler, max_body)
    async with trio.open_nursery() as nursery:
        listeners: list[trio.SocketListener] = await nursery.start(
            partial(trio.serve_tcp, serve_connection, port, host=host)
        )
        bound_port: int = listeners[0].socket.getsockname()[1]
        task_status.started((host, bound_port))


async def _serve_connection(handler: Handler, max_body: int, stream: trio.SocketStream) -> None:
    # serve_tcp's nursery would let an exception out of here end the server: none may leave.
    try:
        await _Connection(stream, handler, max_body).serve()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the client went away; there is no one left to tell
    except Exception:
        logger.exception("the gateway's HTTP server failed on a connection; closing it")
    finally:
        stream.socket.close()


class _Refusal(Exception):
    """A request the server answers itself, then closes the connection (400, 413, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Connection:
    """One client connection: requests in, responses out, one cycle at a time."""

    def __init__(self, stream: trio.SocketStream, handler: Handler, max_body: int) -> None:
        self._stream = stream
        self._handler = handler
        self._max_body = max_body
        self._h11 = h11.Connection(h11.SERVER)

    async def serve(self) -> None:
        """Serve requests until the client closes, breaks or must be closed on."""
        while True:
            try:
                request = await self._receive_request()
            except _Refusal as refusal:
                await self._refuse(refusal)
                return
            if request is None:
                return
            response = await self._respond(request)
            if isinstance(response, StreamingResponse):
                await self._send_stream(request, response)
            else:
                await self._send(request, response)
            if self._h11.our_state is not h11.DONE or self._h11.their_state is not h11.DONE:
                return  # Connection: close, HTTP/1.0, or a stream cut short
            self._h11.start_next_cycle()

    async def _next_event(self) -> object:
        """h11's next event, reading from the socket as needed; a violation is a 400."""
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Refusal(exc.error_status_hint, f"malformed HTTP request: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            if self._h11.they_are_waiting_for_100_continue:
                continue_ = h11.InformationalResponse(status_code=100, headers=[])
                await self._stream.send_all(self._encode(continue_))
            # EOF arrives as b"": h11 turns it into ConnectionClosed, or a violation mid-request.
            self._h11.receive_data(await self._stream.receive_some(_RECEIVE_SIZE))

    async def _receive_request(self) -> HTTPRequest | None:
        """The next complete request, or ``None`` when the client closed the connection."""
        request = await self._next_event()
        if not isinstance(request, h11.Request):
            return None  # ConnectionClosed, between requests
        headers: dict[str, str] = {}
        for raw_name, raw_value in request.headers:  # h11 lower-cases the names
            name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        declared = headers.get("content-length")
        if declared is not None and int(declared) > self._max_body:  # h11 checked it is digits
            raise self._too_large(f" ({declared} bytes)")
        parts: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self._max_body:
                    raise self._too_large("")
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:  # pragma: no cover - h11 raises on EOF mid-body instead
                return None
        path, _, query = request.target.partition(b"?")
        return HTTPRequest(
            method=request.method.decode("ascii"),
            path=path.decode("latin-1"),
            query=query.decode("latin-1"),
            headers=headers,
            body=b"".join(parts),
        )

    def _too_large(self, size: str) -> _Refusal:
        message = f"request body too large{size}: the limit is {self._max_body} bytes"
        return _Refusal(413, message)

    async def _respond(self, request: HTTPRequest) -> HTTPResponse | StreamingResponse:
        """The handler's response, or a 500 if it raised or returned something unusable."""
        try:
            response = await self._handler(request)
        except Exception as exc:
            logger.exception(
                "the gateway's handler raised on %s %s; answering 500", request.method, request.path
            )
            return _error_response(500, f"internal error: {type(exc).__name__}", "server_error")
        if not isinstance(response, HTTPResponse | StreamingResponse) or not (
            200 <= response.status <= 599
        ):
            logger.error(
                "the gateway's handler returned %r on %s %s, not an HTTPResponse or "
                "StreamingResponse with a status in 200-599; answering 500",
                response,
                request.method,
                request.path,
            )
            return _error_response(500, "internal error: bad response", "server_error")
        return response

    async def _send(self, request: HTTPRequest, response: HTTPResponse) -> None:
        has_body = response.status not in (204, 304)
        length = len(response.body) if has_body else None
        data = self._encode(_head(response.status, response.content_type, length, response.headers))
        if has_body and request.method != "HEAD" and response.body:
            data += self._encode(h11.Data(data=response.body))
        await self._stream.send_all(data + self._encode(h11.EndOfMessage()))

    async def _send_stream(self, request: HTTPRequest, response: StreamingResponse) -> None:
        chunks = response.chunks
        try:
            head = _head(response.status, response.content_type, None, response.headers)
            await self._stream.send_all(self._encode(head))
            if request.method != "HEAD" and response.status not in (204, 304):
                while True:
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    except Exception:
                        logger.exception(
                            "the gateway's stream for %s %s raised after its head was sent; "
                            "cutting the response short",
                            request.method,
                            request.path,
                        )
                        return
                    if chunk:  # an empty chunk would end a chunked body
                        await self._stream.send_all(self._encode(h11.Data(data=chunk)))
            await self._stream.send_all(self._encode(h11.EndOfMessage()))
        finally:
            aclose: Callable[[], Awaitable[object]] | None = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _refuse(self, refusal: _Refusal) -> None:
        """Answer ``refusal`` with ``Connection: close``, then wind the connection down."""
        if self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # pragma: no cover
            return
        response = _error_response(refusal.status, refusal.message, "invalid_request_error")
        close = (("connection", "close"),)
        head = _head(response.status, response.content_type, len(response.body), close)
        data = self._encode(head) + self._encode(h11.Data(data=response.body))
        await self._stream.send_all(data + self._encode(h11.EndOfMessage()))
        # Closing a socket with unread bytes makes the kernel send a reset, which can destroy
        # the refusal before the client has read it: stop sending, discard, then close.
        with trio.move_on_after(_LINGER_SECONDS):
            await self._stream.send_eof()
            while await self._stream.receive_some(_RECEIVE_SIZE):
                pass

    def _encode(self, event: h11.Event) -> bytes:
        return self._h11.send(event) or b""  # None only for ConnectionClosed, never sent here


def _head(
    status: int, content_type: str, length: int | None, extra: tuple[tuple[str, str], ...]
) -> h11.Response:
    """A response head; without ``length`` h11 frames the body chunked (for HTTP/1.1)."""
    headers = [(b"content-type", content_type.encode("ascii"))]
    if length is not None:
        headers.append((b"content-length", b"%d" % length))
    headers.extend((name.encode("ascii"), value.encode("ascii")) for name, value in extra)
    return h11.Response(status_code=status, headers=headers)


def _error_response(status: int, message: str, error_type: str) -> HTTPResponse:
    """A response in the OpenAI error shape."""
    error = {"error": {"message": message, "type": error_type, "code": status}}
    return HTTPResponse(status, json.dumps(error).encode())
