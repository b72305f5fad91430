"""One connection of the lean pool and the request heads it sends: origins, URL
targets, connections, and the head of a request built and validated once per URL, method
and header set (:class:`RequestHeads`, the pool's caches of them).

h11 serializes the head; per request the pool only appends ``Content-Length`` and the
body. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

import attrs
import h11
import trio

from trio_rollouts.inference.http._wire import ResponseReader

__all__ = [
    "BODY_METHODS",
    "CACHE_LIMIT",
    "DEFAULT_PORTS",
    "H11_METHODS",
    "READ",
    "WRITE",
    "Connection",
    "Head",
    "Origin",
    "RequestHeads",
    "Target",
]

#: The phases of a request on a connection (what a timeout names).
WRITE: Final = "write"
READ: Final = "read"

DEFAULT_PORTS: Final = {"http": 80, "https": 443}
BODY_METHODS: Final = frozenset({b"POST", b"PUT", b"PATCH"})
#: Methods whose responses h11 parses even when llhttp is used (see Head.h11_response).
H11_METHODS: Final = frozenset({b"HEAD", b"CONNECT"})
#: URL targets and heads kept per pool (the cache is emptied when it is full).
CACHE_LIMIT: Final = 1024


@attrs.define(eq=False)
class Origin:
    """Scheme, host and port; one object per origin and pool, so it hashes by identity."""

    scheme: str
    host: str
    port: int
    host_header: bytes
    idle: list[Connection] = attrs.field(factory=list)  # LIFO: the last is the most recent

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host_header.decode('ascii')}"


@attrs.define(eq=False)
class Connection:
    origin: Origin
    stream: trio.abc.Stream
    socket: trio.socket.SocketType  # closed synchronously to drop the connection
    h11: h11.Connection | None  # the h11 parser, or None: llhttp (h11 only for HEAD)
    reader: ResponseReader | None  # the llhttp parser, or None: h11
    last_used: float = 0.0
    phase: str = WRITE
    closed: bool = False
    reusable: bool = False  # the last request completed a clean keep-alive HTTP cycle


@attrs.frozen(eq=False)
class Target:
    origin: Origin
    target: bytes  # path and query, as sent in the request line


@attrs.frozen(kw_only=True)
class Head:
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


class RequestHeads:
    """A pool's origins (one object per scheme, host and port), the targets of the URLs
    it was given, and the heads built for them: each parsed and validated once. Not a
    checkpoint; one Trio run."""

    __slots__ = ("heads", "origins", "targets", "user_agent")

    def __init__(self, user_agent: bytes) -> None:
        self.user_agent = user_agent
        self.origins: dict[tuple[str, str, int], Origin] = {}
        self.targets: dict[str, Target] = {}
        self.heads: dict[tuple[Target, str, tuple[tuple[str, str], ...]], Head] = {}

    def head(self, method: str, target: Target, headers: Sequence[tuple[str, str]]) -> Head:
        key = (target, method, headers if type(headers) is tuple else tuple(headers))
        head = self.heads.get(key)
        if head is None:
            head = self._build(*key)
        return head

    def _build(self, target: Target, method: str, headers: tuple[tuple[str, str], ...]) -> Head:
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
            fields.append((b"User-Agent", self.user_agent))
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
        head = Head(
            prefix=serialized[:-2],  # without the blank line that ends the head
            standin=standin,
            body_method=method_bytes in BODY_METHODS,
            close=close,
            h11_response=method_bytes in H11_METHODS,
        )
        if len(self.heads) >= CACHE_LIMIT:
            self.heads.clear()
        self.heads[target, method, headers] = head
        return head

    def target(self, url: str) -> Target:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            msg = f"invalid URL {url!r}: {exc}"
            raise ValueError(msg) from None
        scheme = parts.scheme.lower()
        host = parts.hostname
        if scheme not in DEFAULT_PORTS or not host:
            msg = f"unsupported URL {url!r}: use an absolute http:// or https:// URL with a host"
            raise ValueError(msg)
        if port is None:
            port = DEFAULT_PORTS[scheme]
        path = parts.path or "/"
        if parts.query:
            path = f"{path}?{parts.query}"
        try:
            target_bytes = path.encode("ascii")
            host_header = f"[{host}]" if ":" in host else host
            if port != DEFAULT_PORTS[scheme]:
                host_header = f"{host_header}:{port}"
            host_bytes = host_header.encode("ascii")
        except UnicodeEncodeError:
            msg = f"unsupported URL {url!r}: percent-encode its path and use an ASCII host"
            raise ValueError(msg) from None
        origin = self.origins.get((scheme, host, port))
        if origin is None:
            origin = self.origins[scheme, host, port] = Origin(scheme, host, port, host_bytes)
        target = Target(origin, target_bytes)
        if len(self.targets) >= CACHE_LIMIT:
            self.targets.clear()
        self.targets[url] = target
        return target
