"""Name lookups and connecting to the first address that accepts: how the lean pool
opens a TCP connection to a host name.

:class:`NameLookups` shares one lookup per host among concurrent connects (both
transports use it); :func:`connect_first` tries a lookup's addresses as
``trio.open_tcp_stream`` does (RFC 6555 "happy eyeballs").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import attrs
import trio

__all__ = ["NameLookups", "connect_first"]


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


async def connect_first(addresses: list[str], host: str, port: int) -> trio.SocketStream:
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
