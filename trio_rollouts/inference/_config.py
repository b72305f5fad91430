"""The HTTP backend's public configuration types: :class:`Timeout` and :class:`Limits`.

They belong to this library, not to a transport: :class:`OpenAIInference` converts them
for whichever transport a run uses (the lean pool or httpx2), so the same values mean the
same on both. Both compare equal to the httpx2 object with the same values
(``httpx2.Timeout``, ``httpx2.Limits``), so code written when these attributes were
httpx2's keeps working. Error messages about a limit name the field a user sets
(``Timeout.read``), never a transport's class.

This module imports nothing from the transports: they import it.
"""

from __future__ import annotations

from typing import Final, Literal

import attrs
import httpx2

from trio_rollouts._checks import int_at_least, seconds

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_TIMEOUT",
    "KEEPALIVE_EXPIRY",
    "Limits",
    "Timeout",
    "TimeoutPhase",
    "timeout_advice",
]

#: Connections to all replicas together. Keep it below ``ulimit -n``.
DEFAULT_MAX_CONNECTIONS: Final = 256

#: Idle keep-alive connections are closed after this many seconds.
KEEPALIVE_EXPIRY: Final = 5.0

#: The phases of a request that a :class:`Timeout` bounds.
TimeoutPhase = Literal["connect", "read", "write", "pool"]


@attrs.frozen(kw_only=True, eq=False)
class Timeout:
    """Time limits, in seconds, for each phase of one HTTP attempt; ``None`` means no limit.

    The defaults (:data:`DEFAULT_TIMEOUT`) suit inference: 5 s to connect, 600 s to read or
    write (a long generation is normal), and no pool limit, because the pipeline, not the
    connection pool, bounds how many requests run at once.

    Attributes:
        connect: TCP connect plus TLS handshake of a new connection.
        read: the longest time without a byte from the server while a response is due.
        write: sending the request.
        pool: waiting for a free connection when ``max_connections`` are in use.

    Each limit applies to one attempt; retries start afresh. To bound a whole call,
    retries included, put a Trio cancel scope around it. A ``Timeout`` equals the
    ``httpx2.Timeout`` with the same four values.
    """

    connect: float | None = attrs.field(default=5.0, validator=seconds(prefix="Timeout."))
    read: float | None = attrs.field(default=600.0, validator=seconds(prefix="Timeout."))
    write: float | None = attrs.field(default=600.0, validator=seconds(prefix="Timeout."))
    pool: float | None = attrs.field(default=None, validator=seconds(prefix="Timeout."))

    @classmethod
    def every_phase(cls, limit: float | None) -> Timeout:
        """The same ``limit`` (seconds, or ``None``: none) for all four phases."""
        return cls(connect=limit, read=limit, write=limit, pool=limit)

    def _values(self) -> tuple[float | None, ...]:
        return (self.connect, self.read, self.write, self.pool)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timeout):
            return self._values() == other._values()
        if isinstance(other, httpx2.Timeout):
            return self._values() == (other.connect, other.read, other.write, other.pool)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())


@attrs.frozen(kw_only=True, eq=False)
class Limits:
    """How many connections the HTTP backend opens and keeps.

    Attributes:
        max_connections: connections to all replicas together (:data:`DEFAULT_MAX_CONNECTIONS`),
            so also the most requests on the wire at once; requests beyond it wait for a
            free connection, first come first served. Each is a file descriptor: keep it
            below ``ulimit -n``.
        max_keepalive_connections: idle connections kept open for reuse; by default as
            many as ``max_connections``.
        keepalive_expiry: seconds an idle connection is kept before it is closed
            (5 s); ``None``: kept until the server closes it.

    A ``Limits`` equals the ``httpx2.Limits`` with the same three values.
    """

    max_connections: int = attrs.field(default=DEFAULT_MAX_CONNECTIONS, validator=int_at_least(1))
    max_keepalive_connections: int = attrs.field(
        default=attrs.Factory(lambda self: self.max_connections, takes_self=True),
        validator=int_at_least(0),
    )
    keepalive_expiry: float | None = attrs.field(
        default=KEEPALIVE_EXPIRY, validator=seconds(prefix="Limits.")
    )

    def _values(self) -> tuple[object, ...]:
        return (self.max_connections, self.max_keepalive_connections, self.keepalive_expiry)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Limits):
            return self._values() == other._values()
        if isinstance(other, httpx2.Limits):
            return self._values() == (
                other.max_connections,
                other.max_keepalive_connections,
                other.keepalive_expiry,
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())


#: Per attempt: 5 s to connect, 600 s to read or write, and no pool timeout.
DEFAULT_TIMEOUT: Final = Timeout()

_ADVICE: Final[dict[TimeoutPhase, str]] = {
    "connect": "if the server is slow to accept",
    "read": "if the server takes longer to answer",
    "write": "if sending the request takes longer",
    "pool": "or Limits.max_connections, or send fewer requests at once",
}


def timeout_advice(phase: TimeoutPhase, limit: float | None) -> str:
    """``"the read timeout of 600.0 s; raise Timeout.read if ..."``: which limit ran out,
    named as the user sets it."""
    return f"the {phase} timeout of {limit} s; raise Timeout.{phase} {_ADVICE[phase]}"
