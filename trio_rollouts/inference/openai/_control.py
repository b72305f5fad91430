"""Pausing OpenAI-compatible servers for weight updates: the client-side hold of one
run (:class:`PauseState`) and the fan-out of a server's control calls over the replicas
(:class:`ControlEndpoints`).

Which calls pause and resume a server is its dialect's (:mod:`._vllm`, :mod:`._sglang`,
``docs/pausing-servers.md``); :class:`ControlEndpoints` sends each step to every replica
concurrently through the run's :class:`~trio_rollouts.inference.http._transport.Transport`
(retrying as generation requests are) and reports the replicas that failed; the
interface keeps the state (the epoch, the hold, which replicas may be paused).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import attrs
import httpx2
import trio

from trio_rollouts.inference._errors import InferenceError, InferenceTimeoutError
from trio_rollouts.inference._pausable import WeightUpdateError, WeightUpdateMode
from trio_rollouts.inference._retry import RetryBackoff, call_with_retries
from trio_rollouts.inference.http._transport import Transport, encode_json
from trio_rollouts.inference.openai._parse import error_for_status

__all__ = [
    "RESUME_PATHS",
    "RESUME_TIMEOUT",
    "VERSION_SEGMENT",
    "ControlCall",
    "ControlEndpoints",
    "PauseState",
    "control_root",
]

#: A control call: a path below the server's root and a JSON body (``None``: no body).
ControlCall = tuple[str, dict[str, Any] | None]

#: The last path segment of an API root: "v1", "v2", "v1beta".
VERSION_SEGMENT = re.compile(r"v\d+[a-z0-9]*", re.IGNORECASE)

#: How long resuming may take, all replicas together, before it gives up (shielded).
RESUME_TIMEOUT: Final = 60.0

#: The control paths that end a server-side pause (vLLM's, SGLang's).
RESUME_PATHS: Final = frozenset({"/resume", "/continue_generation"})


@attrs.define(eq=False)
class PauseState:
    """The pause of one interface in one Trio run (it survives ``aclose()``).

    ``hold`` is set while paused: calls wait on it before they send anything, and
    calls whose request the server aborted wait on it before their continuation.
    ``server_pauses`` counts the server-side pauses begun in this run: a call that sees
    ``finish_reason == "abort"`` and a count that moved since it started was aborted by
    a pause, and is continued. (Which replicas may be paused server-side is kept on the
    interface, across runs: a server's pause outlives the run that made it.)"""

    hold: trio.Event | None = None
    mode: WeightUpdateMode | None = None
    server_pauses: int = 0
    held: int = 0

    async def wait_resumed(self) -> None:
        """Wait until no pause holds calls. Cancellable; holds nothing."""
        self.held += 1
        try:
            while self.hold is not None:
                await self.hold.wait()
        finally:
            self.held -= 1

    def release(self) -> None:
        hold, self.hold, self.mode = self.hold, None, None
        if hold is not None:
            hold.set()


def control_root(base_url: str) -> str:
    """The server's root: ``base_url`` without its API version segment (``/v1``), where
    vLLM and SGLang serve their control endpoints."""
    url = httpx2.URL(base_url)
    path = url.path.rstrip("/")
    head, _, last = path.rpartition("/")
    if VERSION_SEGMENT.fullmatch(last):
        path = head
    return str(url.copy_with(path=path or "/")).rstrip("/")


# --------------------------------------------------------------------------- fan-out


@attrs.frozen(kw_only=True, eq=False)
class ControlEndpoints:
    """The control endpoints of one interface's replicas (index = replica), and the
    fan-out of a pause or a resume to all of them.

    ``paused`` arguments are the interface's set of replicas that may be paused
    server-side (a pause was sent and no resume has succeeded since); these methods
    update it as replies arrive.
    """

    server: str  # the server's name in messages ("vllm", "sglang")
    roots: tuple[str, ...]  # each replica's root (base_url less "/v1")
    shown_roots: tuple[str, ...]  # the same without credentials, for messages
    api_key: str | None
    max_retries: int
    backoff: RetryBackoff
    #: Why a control path answered 404 or 405, and what to do (the dialect's words).
    missing_hint: Callable[[str], str]

    async def pause(
        self, transport: Transport, mode: WeightUpdateMode, call: ControlCall, paused: set[int]
    ) -> WeightUpdateError | None:
        """Pause every replica for ``mode`` (``keep`` or ``abort``), concurrently, without
        retrying; return once all have answered: ``None`` if all paused, else the
        :class:`WeightUpdateError` to raise (from the first failure, the others as notes),
        once the caller has resumed them. ``call``: the dialect's pause for ``mode``.
        Cancellation: replicas may be left paused."""
        path, body = call
        failures: dict[int, InferenceError] = {}

        async def pause_one(index: int) -> None:
            paused_before = index in paused
            paused.add(index)
            try:
                await self.post(transport, index, path, body, retries=0)
            except InferenceError as exc:
                failures[index] = exc
                if exc.status is not None and 400 <= exc.status < 500 and not paused_before:
                    paused.discard(index)  # refused: this pause did not pause it

        async with trio.open_nursery() as nursery:
            for index in range(len(self.roots)):
                nursery.start_soon(pause_one, index)
        if not failures:
            return None
        index = min(failures)
        cause = failures[index]
        msg = (
            f"pausing {self.server} for mode {mode!r} failed at {self.shown_roots[index]} "
            f"({len(failures)} of {len(self.roots)} replicas failed): {cause}"
        )
        error = WeightUpdateError(msg)
        error.__cause__ = cause
        for other, exc in sorted(failures.items())[1:]:
            error.add_note(f"{self.shown_roots[other]} failed too: {exc}")
        return error

    async def resume(
        self, transport: Transport, paused: set[int], calls_of: Callable[[bool], list[ControlCall]]
    ) -> InferenceError | None:
        """Make each replica's resume calls (``calls_of(paused)``, the dialect's, in order:
        with SGLang a weight version first); concurrently, retrying transient failures, all
        within :data:`RESUME_TIMEOUT`. Returns ``None``, or the error to raise: the first
        replica's failure, with a note that it may still be paused and the others as
        notes. A replica that failed stays in ``paused``.

        Cancellation: runs shielded, bounded by :data:`RESUME_TIMEOUT`.
        """
        failures: dict[int, InferenceError] = {}
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + RESUME_TIMEOUT
            async with trio.open_nursery() as nursery:
                for index in range(len(self.roots)):
                    calls = calls_of(index in paused)
                    if calls:
                        nursery.start_soon(
                            self._resume_one, transport, index, calls, paused, failures
                        )
        if scope.cancelled_caught:
            for index in paused - failures.keys():
                shown = self.shown_roots[index]
                failures[index] = InferenceTimeoutError(
                    f"resuming {shown} did not finish within {RESUME_TIMEOUT} s", url=shown
                )
        if not failures:
            return None
        index = min(failures)
        error = failures[index]
        error.add_note(f"{self.server} replica {self.shown_roots[index]} may still be paused")
        for other, exc in sorted(failures.items())[1:]:
            error.add_note(f"{self.shown_roots[other]} failed to resume too: {exc}")
        return error

    async def _resume_one(
        self,
        transport: Transport,
        index: int,
        calls: list[ControlCall],
        paused: set[int],
        failures: dict[int, InferenceError],
    ) -> None:
        first: InferenceError | None = None
        for path, body in calls:  # every call is made, even after one fails
            try:
                await self.post(transport, index, path, body, retries=self.max_retries)
            except InferenceError as exc:
                first = first or exc
            else:
                if path in RESUME_PATHS:
                    paused.discard(index)
        if first is not None:
            failures[index] = first

    async def post(
        self,
        transport: Transport,
        index: int,
        path: str,
        body: dict[str, Any] | None,
        *,
        retries: int,
    ) -> None:
        """POST one control request to replica ``index``'s root; a non-2xx answer is its
        :class:`InferenceError` (a 404 or 405 says how to get the endpoint). Transient
        failures are retried ``retries`` times, waiting as the backoff says."""
        url = self.roots[index] + path
        shown = self.shown_roots[index] + path
        content = b"" if body is None else encode_json(body)

        async def attempt() -> None:
            response = await transport.post(url, shown, lambda: content)
            status = response.status_code
            if 200 <= status < 300:
                return
            hint = self.missing_hint(path) if status in (404, 405) else ""
            raise error_for_status(response, shown, self.api_key, hint)

        await call_with_retries(attempt, max_retries=retries, backoff=self.backoff)
