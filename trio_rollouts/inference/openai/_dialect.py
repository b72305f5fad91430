"""What differs between the servers :class:`~trio_rollouts.inference.OpenAIInference`
talks to: the :class:`Dialect` protocol, and :class:`OpenAIDialect`, the plain OpenAI API
(``server=None``).

A dialect is chosen once, from ``server``, when the interface is made: ``None`` speaks
:class:`OpenAIDialect`, ``"vllm"`` :class:`~._vllm.VLLMDialect` and ``"sglang"``
:class:`~._sglang.SGLangDialect`. The client asks it, never ``server``, for what a
server does beyond the OpenAI routes:

- **route** a request: whether the server's own route takes it (:meth:`Dialect.takes`),
  and send it there (:meth:`Dialect.route`, vLLM's native RL route);
- **pause** and **resume** generation for a weight update through the server's control
  endpoints (:meth:`Dialect.pause`, :meth:`Dialect.resume`);
- **stamp** epochs on a reply from the weight versions the server put on its tokens
  (:meth:`Dialect.stamp`), and say whether it does (:attr:`Dialect.stamps`), and the
  field the server takes a prefix-cache salt in (:attr:`Dialect.salt_field`);
- **continue** a call a pause aborted: the fields a text continuation needs
  (:attr:`Dialect.continuation_fields`).

What a dialect learns about the replicas lives in the interface's
:class:`~._learned.Learned` (the dialect holds references to its parts), so a pickled
interface keeps it as before; what belongs to one Trio run, the dialect keeps in a
``RunVar`` of its own.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import attrs
import trio

from trio_rollouts.inference._errors import InferenceError
from trio_rollouts.inference._interface import InferenceRequest, InferenceResponse
from trio_rollouts.inference._pausable import WeightUpdateError, WeightUpdateMode
from trio_rollouts.inference.http._transport import Response, Transport

__all__ = [
    "CLIENT_MODES",
    "SERVER_MODES",
    "Dialect",
    "DialectCall",
    "OpenAIDialect",
    "OpenAIRoutes",
    "RouteProbe",
]

#: What a weight update may ask of an interface without, and with, a server's control
#: endpoints.
CLIENT_MODES: Final[frozenset[WeightUpdateMode]] = frozenset({"drain", "restart"})
SERVER_MODES: Final[frozenset[WeightUpdateMode]] = frozenset({"drain", "restart", "keep", "abort"})


@attrs.define(eq=False)
class DialectCall:
    """One call as a dialect's own route sees it: the epoch it started under (what spans
    labelled by someone else are stamped with) and its prompts rendered to ids (keyed by
    the prompt's identity, so a retry does not render it again)."""

    start_epoch: int
    rendered: dict[int, list[int]] = attrs.field(factory=dict)  # id(prompt) -> ids


@attrs.frozen
class RouteProbe:
    """What probing a replica's own route found: whether it serves it, whether a reply
    carried a sampling mask, and whether the answer is final (worth caching)."""

    serves: bool = False
    sampling_mask: bool = False
    final: bool = True


class Dialect(Protocol):
    """What a server does beyond the OpenAI routes (see the module docstring). Methods
    run in the interface's Trio run; ``index`` is a replica's place in ``base_url``."""

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """The weight-update modes the interface supports with this server."""
        ...

    @property
    def pauses_servers(self) -> bool:
        """Whether ``keep`` and ``abort`` pause the servers (else nothing is sent)."""
        ...

    @property
    def salt_field(self) -> str | None:
        """The request field the server takes a prefix-cache salt in (``None``: none)."""
        ...

    @property
    def stamps(self) -> bool:
        """Whether every reply records the token at which its epoch changed."""
        ...

    @property
    def continuation_fields(self) -> dict[str, Any]:
        """Fields a chat request continuing an aborted answer from its text needs."""
        ...

    @property
    def own_route(self) -> bool:
        """Whether the server has a route of its own (:meth:`takes`, :meth:`route`): a
        call then carries a :class:`DialectCall`."""
        ...

    def takes(self, index: int, body: dict[str, Any]) -> bool:
        """Whether ``body`` goes to replica ``index``'s own route of the server."""
        ...

    async def prepare(self, transport: Transport, index: int) -> None:
        """What must precede the first request on replica ``index``'s own route (vLLM:
        labelling it with the epoch). Cancellable; done again by the next call if
        cancelled."""
        ...

    async def route(
        self,
        transport: Transport,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: DialectCall,
    ) -> list[InferenceResponse] | None:
        """``body`` on replica ``index``'s own route: a response per choice, or ``None``
        when the replica turns out not to serve it (``body`` then goes to the OpenAI
        route). Raises :class:`InferenceError` as the OpenAI routes do. Cancellable."""
        ...

    def stamp(self, index: int, reply: Response, parsed: list[InferenceResponse]) -> None:
        """Set each choice's ``policy_epoch`` from the weight versions the server put in
        ``reply`` (a reply of an OpenAI route), where it did."""
        ...

    async def pause(
        self, transport: Transport, mode: WeightUpdateMode, paused: set[int]
    ) -> WeightUpdateError | None:
        """Pause every replica for ``mode`` (``keep`` or ``abort``), marking the ones sent
        a pause in ``paused``; ``None``, or the error to raise once the caller has resumed
        them. Cancellation: replicas may be left paused."""
        ...

    async def resume(
        self,
        transport: Transport,
        epoch: int,
        *,
        held: bool,
        previous_epoch: int,
        paused: set[int],
    ) -> InferenceError | None:
        """Resume the replicas in ``paused`` (``held``: a pause of this run is being
        ended) under ``epoch``, labelling them with it as the server needs; ``None``, or
        the error to raise. Replicas that failed stay in ``paused``. Cancellation: runs
        shielded, bounded."""
        ...

    async def probe_route(self, transport: Transport, index: int) -> RouteProbe:
        """Whether replica ``index`` serves the server's own route, asked if not known
        yet. Cancellable."""
        ...


class OpenAIRoutes:
    """What a dialect without a route of its own does (the plain OpenAI API, SGLang):
    every request goes by the OpenAI routes, nothing to prepare, continue or probe."""

    @property
    def continuation_fields(self) -> dict[str, Any]:
        return {}

    def takes(self, index: int, body: dict[str, Any]) -> bool:
        return False

    async def prepare(self, transport: Transport, index: int) -> None:
        await trio.lowlevel.checkpoint()

    async def route(
        self,
        transport: Transport,
        index: int,
        request: InferenceRequest,
        body: dict[str, Any],
        call: DialectCall,
    ) -> list[InferenceResponse] | None:
        await trio.lowlevel.checkpoint()
        return None

    async def probe_route(self, transport: Transport, index: int) -> RouteProbe:
        await trio.lowlevel.checkpoint()
        return RouteProbe()


@attrs.frozen(eq=False)
class OpenAIDialect(OpenAIRoutes):
    """The plain OpenAI API (``server=None``): no route, control endpoint or stamp of its
    own; a pause holds calls client-side only (``drain``, ``restart``)."""

    supported_modes: frozenset[WeightUpdateMode] = CLIENT_MODES
    pauses_servers: bool = False
    own_route: bool = False
    salt_field: str | None = None
    stamps: bool = False

    def stamp(self, index: int, reply: Response, parsed: list[InferenceResponse]) -> None:
        return

    async def pause(
        self, transport: Transport, mode: WeightUpdateMode, paused: set[int]
    ) -> WeightUpdateError | None:
        await trio.lowlevel.checkpoint()
        return None

    async def resume(
        self,
        transport: Transport,
        epoch: int,
        *,
        held: bool,
        previous_epoch: int,
        paused: set[int],
    ) -> InferenceError | None:
        return None
