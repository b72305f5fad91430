"""The transport: how an HTTP backend POSTs a JSON body and gets a whole response.

One protocol, :class:`Transport` (returning a :class:`Response`), and two implementations:
:class:`LeanTransport` on the lean Trio-native HTTP/1.1 pool (:mod:`._pool`, the default),
and :class:`HTTPXTransport` on httpx2 (used where a proxy is configured; it honours
proxies). The client never asks which one it has. Nothing here knows what is posted (the
OpenAI client's bodies and replies are ``inference.openai``'s). Both

- take the library's :class:`Timeout` and :class:`Limits` and convert them;
- build the body when the request is about to be written, once it holds a connection
  slot (``content`` is a function), so a body built from shared state (what negotiation
  learned) sees that state as it is then, not as it was when the request started waiting;
- raise only :class:`InferenceError` subclasses for a request that got no response,
  mapped in one place, :func:`transport_error`: a timeout is an
  :class:`InferenceTimeoutError` naming the ``Timeout`` field that ran out, a failed or
  broken connection an :class:`InferenceConnectionError`, a host name that does not
  exist an :class:`InferenceError` (not transient);
- release a cancelled request's connection slot before ``trio.Cancelled`` propagates.

A transport belongs to one Trio run (the client makes one per run and closes it at the
run's end, or the caller's ``async with`` does).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import json
import math
import socket
import ssl
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, Protocol

import httpx2
import trio

from trio_rollouts.inference._config import Limits, Timeout, TimeoutPhase, timeout_advice
from trio_rollouts.inference._errors import (
    InferenceConnectionError,
    InferenceError,
    InferenceTimeoutError,
    redact,
)
from trio_rollouts.inference.http._lookup import NameLookups
from trio_rollouts.inference.http._pool import ConnectionPool
from trio_rollouts.inference.http._wire import (
    ConnectError,
    LeanHTTPError,
    LeanTimeout,
    NetworkError,
    RemoteProtocolError,
)

__all__ = [
    "HTTPXTransport",
    "Headers",
    "LeanTransport",
    "Response",
    "Transport",
    "TransportKind",
    "encode_json",
    "open_transport",
    "proxied",
    "transport_error",
]

#: The transports there are (``OpenAIInference(transport="auto")`` picks one).
TransportKind = Literal["lean", "httpx2"]

_JSON: Final = "application/json"

#: One compact encoder (``json.dumps`` with options makes one per call).
_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode_json(body: dict[str, Any]) -> bytes:
    """A request body as compact UTF-8 JSON."""
    return _ENCODER.encode(body).encode()


class Headers(Protocol):
    def get(self, key: str, /) -> str | None: ...


class Response(Protocol):
    """What is read of a response: an ``httpx2.Response`` or the lean pool's
    :class:`~._wire.LeanResponse`, as the transports return them."""

    @property
    def status_code(self) -> int: ...
    @property
    def reason_phrase(self) -> str: ...
    @property
    def headers(self) -> Headers: ...
    @property
    def text(self) -> str: ...
    def json(self) -> Any: ...


class Transport(Protocol):
    """POST a JSON body, get the whole response; errors are :class:`InferenceError`."""

    async def post(self, url: str, shown: str, content: Callable[[], bytes]) -> Response:
        """POST to ``url`` (``shown``: the URL for messages, without credentials) the body
        ``content()`` returns, called once the request holds a connection slot.

        Raises :class:`InferenceTimeoutError`, :class:`InferenceConnectionError` or
        :class:`InferenceError` when no response arrived; a response of any status is
        returned. Cancellation: cancellable at any point; the slot is released first.
        """
        ...

    async def get(self, url: str, shown: str) -> Response:
        """GET ``url``; errors and cancellation as :meth:`post`. For the rare reads of
        an error path (the models a server serves), not the hot path."""
        ...

    async def aclose(self) -> None:
        """Close every connection. Requests in flight fail with
        :class:`InferenceConnectionError`."""
        ...


def open_transport(
    kind: TransportKind, *, timeout: Timeout, limits: Limits, api_key: str | None
) -> Transport:
    """A new transport of ``kind`` for the current Trio run."""
    if kind == "lean":
        return LeanTransport(timeout=timeout, limits=limits, api_key=api_key)
    return HTTPXTransport(timeout=timeout, limits=limits, api_key=api_key)


class LeanTransport:
    """The lean HTTP/1.1 pool (:class:`~._pool.ConnectionPool`): the hot path."""

    def __init__(self, *, timeout: Timeout, limits: Limits, api_key: str | None) -> None:
        expiry = limits.keepalive_expiry
        self.pool = ConnectionPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=float("inf") if expiry is None else expiry,
            timeouts=timeout,
            ssl_context=default_ssl_context(),
        )
        self._timeout = timeout
        self._api_key = api_key
        # The request headers, built once (the pool serializes each distinct set once).
        self._headers: tuple[tuple[str, str], ...] = (
            ("accept", _JSON),
            ("content-type", _JSON),
            *(() if api_key is None else (("authorization", f"Bearer {api_key}"),)),
        )

    async def post(self, url: str, shown: str, content: Callable[[], bytes]) -> Response:
        try:
            return await self.pool.request("POST", url, headers=self._headers, content=content)
        except LeanHTTPError as exc:
            raise transport_error(exc, shown, self._timeout, self._api_key) from exc

    async def get(self, url: str, shown: str) -> Response:
        try:
            return await self.pool.request(
                "GET", url, headers=self._headers[:1] + self._headers[2:]
            )
        except LeanHTTPError as exc:
            error = transport_error(exc, shown, self._timeout, self._api_key, method="GET")
            raise error from exc

    async def aclose(self) -> None:
        await self.pool.aclose()


class HTTPXTransport:
    """httpx2's ``AsyncClient``, for proxies. A slot is taken from a first-in first-out
    semaphore of ``max_connections`` (bounded by ``Timeout.pool``) before the body is built
    and handed to httpx2, whose pool has as many connections, so it never queues there."""

    def __init__(self, *, timeout: Timeout, limits: Limits, api_key: str | None) -> None:
        headers = {"Accept": _JSON, "Content-Type": _JSON}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(
                connect=timeout.connect, read=timeout.read, write=timeout.write, pool=timeout.pool
            ),
            limits=httpx2.Limits(
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry,
            ),
            headers=headers,
            verify=default_ssl_context(),
        )
        self._slots = trio.Semaphore(limits.max_connections)
        self._lookups = NameLookups()
        self._timeout = timeout
        self._api_key = api_key

    async def post(self, url: str, shown: str, content: Callable[[], bytes]) -> Response:
        try:
            await self._take_slot()
            try:
                return await self.client.post(url, content=content())
            finally:
                self._slots.release()
        except httpx2.HTTPError as exc:
            proxy = _proxy_for(url)
            error = transport_error(exc, shown, self._timeout, self._api_key, proxy=proxy)
            if isinstance(exc, (httpx2.ConnectTimeout, httpx2.ConnectError)) and isinstance(
                error, (InferenceTimeoutError, InferenceConnectionError)
            ):
                # httpx2 looks the host up per connection: under load the lookups queue
                # for Trio's threads and a name that does not exist reads as a connect
                # timeout. One shared lookup tells.
                lookup_error = await self._look_up(proxy or url)
                if lookup_error is not None:
                    error = transport_error(
                        lookup_error, shown, self._timeout, self._api_key, proxy=proxy
                    )
            raise error from exc

    async def get(self, url: str, shown: str) -> Response:
        try:
            await self._take_slot()
            try:
                return await self.client.get(url)
            finally:
                self._slots.release()
        except httpx2.HTTPError as exc:
            proxy = _proxy_for(url)
            error = transport_error(
                exc, shown, self._timeout, self._api_key, method="GET", proxy=proxy
            )
            raise error from exc

    async def _look_up(self, url: str) -> OSError | None:
        """The error of looking up ``url``'s host (``None``: found, an address, or no
        answer within ``Timeout.connect``)."""
        parsed = httpx2.URL(url)
        try:
            ipaddress.ip_address(parsed.host)
        except ValueError:
            pass
        else:
            return None
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        limit = self._timeout.connect
        with trio.move_on_after(math.inf if limit is None else limit):
            try:
                await self._lookups.addresses(parsed.host, port)
            except OSError as exc:
                return exc
        return None

    async def _take_slot(self) -> None:
        limit = self._timeout.pool
        if limit is None:
            await self._slots.acquire()
            return
        with trio.move_on_after(limit):
            await self._slots.acquire()
            return
        raise httpx2.PoolTimeout("no connection slot became free")

    async def aclose(self) -> None:
        await self.client.aclose()


# --------------------------------------------------------------------------- the error map

_HTTPX_PHASES: Final[tuple[tuple[type[Exception], TimeoutPhase], ...]] = (
    (httpx2.ConnectTimeout, "connect"),
    (httpx2.WriteTimeout, "write"),
    (httpx2.PoolTimeout, "pool"),
    (httpx2.ReadTimeout, "read"),
)


#: Name lookup failures that looking again will not cure: the name does not exist, has no
#: address, or the resolver failed for good. ``EAI_AGAIN`` (try again) is not one.
_UNRESOLVABLE: Final = frozenset(
    getattr(socket, name)
    for name in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL", "EAI_ADDRFAMILY")
    if hasattr(socket, name)
)


def transport_error(
    exc: Exception,
    shown: str,
    timeout: Timeout,
    api_key: str | None,
    *,
    method: str = "POST",
    proxy: str | None = None,
) -> InferenceError:
    """The :class:`InferenceError` for a request to ``shown`` that got no response, from
    either transport's exception: the one map of transport errors. ``proxy``: the proxy
    the request went through, if any (the host that was dialled).

    ======================================================  ==============================
    lean pool / httpx2                                      raised
    ======================================================  ==============================
    ``LeanTimeout`` / ``httpx2.TimeoutException``           :class:`InferenceTimeoutError`
    a host name that does not exist (either)                :class:`InferenceError`
    ``NetworkError``, ``RemoteProtocolError`` (either)      :class:`InferenceConnectionError`
    anything else                                           :class:`InferenceError`
    ======================================================  ==============================

    A failed connect is said plainly, whichever transport: ``cannot resolve host 'x'``
    (not transient unless the resolver said to try again), ``connection refused: is a
    server listening on host:port?`` (transient: a server that is starting refuses).
    """
    if isinstance(exc, LeanTimeout):
        return InferenceTimeoutError(
            f"{method} {shown} timed out: {redact(str(exc), api_key)}", url=shown
        )
    if isinstance(exc, httpx2.TimeoutException):
        phase: TimeoutPhase = next(
            (phase for cls, phase in _HTTPX_PHASES if isinstance(exc, cls)), "read"
        )
        limit = getattr(timeout, phase)
        msg = f"{method} {shown} timed out ({_describe(exc)}): {phase} took longer than "
        msg += timeout_advice(phase, limit)
        return InferenceTimeoutError(msg, url=shown)
    if isinstance(exc, (ConnectError, httpx2.ConnectError, OSError)):
        refused = _connect_failure(exc, method, shown, proxy)
        if refused is not None:
            return refused
    described = redact(_describe(exc), api_key)
    if isinstance(
        exc, (NetworkError, RemoteProtocolError, httpx2.NetworkError, httpx2.RemoteProtocolError)
    ):
        return InferenceConnectionError(f"{method} {shown} failed: {described}", url=shown)
    return InferenceError(f"{method} {shown} failed: {described}", url=shown)


def _connect_failure(
    exc: Exception, method: str, shown: str, proxy: str | None
) -> InferenceError | None:
    """The error for a connect that failed because the host name did not resolve or every
    address refused; ``None`` for any other failure."""
    causes = _os_errors(exc)
    dialled = httpx2.URL(proxy if proxy is not None else shown)
    what = " (the proxy for this URL)" if proxy is not None else ""
    lookup = next((cause for cause in causes if isinstance(cause, socket.gaierror)), None)
    if lookup is not None:
        said = lookup.strerror or str(lookup)
        msg = f"{method} {shown} failed: cannot resolve host {dialled.host!r}{what} ({said})"
        if lookup.errno in _UNRESOLVABLE:
            msg += ": check the host name"
            return InferenceError(msg, url=shown)
        return InferenceConnectionError(msg, url=shown)
    leaves = [cause for cause in causes if cause.errno is not None]
    if leaves and all(leaf.errno == errno.ECONNREFUSED for leaf in leaves):
        host = f"[{dialled.host}]" if ":" in dialled.host else dialled.host
        port = dialled.port or (443 if dialled.scheme == "https" else 80)
        msg = f"{method} {shown} failed: connection refused: is a server listening on "
        msg += f"{host}:{port}{what}?"
        return InferenceConnectionError(msg, url=shown)
    return None


def _os_errors(exc: BaseException) -> list[OSError]:
    """The ``OSError`` s that ``exc`` was raised from (its causes, and the leaves of an
    exception group among them)."""
    found: list[OSError] = []
    pending: list[BaseException] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        elif isinstance(current, OSError):
            found.append(current)
        cause = current.__cause__ or current.__context__
        if cause is not None:
            pending.append(cause)
    return found


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- helpers


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """The certificates of the environment (``SSL_CERT_FILE``, ``SSL_CERT_DIR``), as httpx
    reads them, for both transports."""
    # Loading the CA bundle takes tens of milliseconds; a transport is made per Trio run
    # (per sync generate() call), and SSLContext objects can be shared.
    return httpx2.create_ssl_context()


def _proxy_for(url: str) -> str | None:
    """The proxy the environment routes ``url`` through, as httpx2 reads it, or ``None``."""
    proxies = urllib.request.getproxies()
    if not proxies:
        return None
    parsed = httpx2.URL(url)
    if urllib.request.proxy_bypass(parsed.host):
        return None
    return proxies.get(parsed.scheme) or proxies.get("all")


def proxied(urls: Sequence[str]) -> bool:
    """Whether the environment routes any of ``urls`` through a proxy (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``, less ``NO_PROXY``), as httpx2 would honour."""
    proxies = urllib.request.getproxies()
    if not proxies:
        return False
    for url in urls:
        parsed = httpx2.URL(url)
        if (parsed.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(
            parsed.host
        ):
            return True
    return False
