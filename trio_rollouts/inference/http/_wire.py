"""What the lean pool reads off the wire: its errors, and a response (status, headers,
body) parsed by llhttp or h11.

:class:`~._pool.ConnectionPool` raises only the :class:`LeanHTTPError` family defined here
and returns :class:`LeanResponse` objects; :class:`ResponseReader` is what llhttp calls
while it parses the responses of one connection (h11's reading is in the pool itself,
being a loop over its events).

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
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

# HAVE_LLHTTP: whether responses can be parsed by llhttp (``httptools`` is installed).
try:
    import httptools  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - exercised where httptools is not installed
    HAVE_LLHTTP = False
else:
    HAVE_LLHTTP = True

__all__ = [
    "HAVE_LLHTTP",
    "ConnectError",
    "ConnectTimeout",
    "LeanHTTPError",
    "LeanHeaders",
    "LeanResponse",
    "LeanTimeout",
    "NetworkError",
    "PoolTimeout",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "ResponseReader",
    "WriteError",
    "WriteTimeout",
    "describe",
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


class ResponseReader:
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


def describe(exc: BaseException) -> str:
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
