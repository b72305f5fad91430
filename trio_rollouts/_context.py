"""The context of one ``group_rollout`` call: one frozen :class:`CallContext` in one
``ContextVar``.

The pipeline makes each call of an agent's ``group_rollout`` inside a context that says
which call it is: its slot in the stream, its attempt, the policy epoch it started under,
the key its replicas are placed by, the prompt draws it makes, its :class:`CallCuts` (the
cut signal at the staleness bound, and the cuts it booked) and its trace span. The
library's agents narrow it for each member of the group (the episode, the member's
progress, the epoch a restarted member started under), and the inference backends read
it: which epoch to salt the prefix cache with, which replica a request goes to, what to
count for a member that may be cut. Tasks the call starts inherit it, as every
``ContextVar``.

Nobody writes a field: a layer that knows more narrows the context for the code it calls
(:func:`calling`), and the old context is back when that code returns. Outside a pipeline
the context is :data:`NO_CALL` (every field unset).

This is the package's ground floor beside ``_checks.py``: it imports nothing from the
package, so every layer may read it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import attrs
import trio

__all__ = [
    "NO_CALL",
    "CallContext",
    "CallCuts",
    "CallProgress",
    "Draw",
    "Sample",
    "call_context",
    "calling",
    "current_call",
]


class Draw(NamedTuple):
    """One prompt draw: how to settle it, the epoch it was drawn for, and the problem's
    id. ``settle(epoch, problem_id, done)`` is the source's own: ``done`` true when the
    problem is done, false when it is to be drawn again."""

    settle: Callable[[int, str, bool], None]
    epoch: int
    problem_id: str
    #: How many times this (epoch, problem) was given back before this draw, in the
    #: source's life in this process (request seeds tell the draws apart by it).
    again: int = 0


class CallProgress:
    """What one member's calls have generated, for a member that is cut: the library's
    agents give each member one, and ``InferenceInterface.agenerate`` adds each finished
    call's generated tokens. A cancelled call adds what its backend reports (the embedded
    backend knows to the token); a backend that cannot tell makes the count unknown
    (``known`` false)."""

    __slots__ = ("generated_tokens", "known")

    def __init__(self) -> None:
        self.generated_tokens = 0
        self.known = True

    def total(self) -> int | None:
        """The tokens generated, or ``None`` when some call's are unknown."""
        return self.generated_tokens if self.known else None


class Sample:
    """The trace span of one call (OpenTelemetry's, when tracing is on), and whether it
    has had its first event."""

    __slots__ = ("first", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.first = False

    def first_event(self, name: str) -> None:
        """``first_token`` or ``first_response``, once per call."""
        if not self.first:
            self.first = True
            self.span.add_event(name)


class CallCuts:
    """The cuts of one ``group_rollout`` call, as the pipeline and the library's agents
    share them: the epoch the call counts as started under, the cut signal the pipeline
    gives at the staleness bound, and the cuts the agent made (booked at once through
    ``book_cut``).

    Threads: the pipeline's Trio thread only.
    """

    __slots__ = ("book_cut", "cut_epoch", "cuts", "start_epoch", "watchers")

    def __init__(self, start_epoch: int, book_cut: Callable[[object], None]) -> None:
        #: The epoch the call counts as started under: its group's ``start_epoch``.
        #: An agent that cut every member and started them again moves it on
        #: (:meth:`started_again`).
        self.start_epoch = start_epoch
        self.book_cut = book_cut
        #: The cuts of the call (``trio_rollouts.Cut`` records), for its group.
        self.cuts: list[object] = []
        #: Agents waiting for the cut signal (usually one).
        self.watchers: list[trio.Event] = []
        #: The epoch of the last cut signal: members start again under it.
        self.cut_epoch = start_epoch

    def book(self, cut: object) -> None:
        """A member was cut (``cut``: its ``trio_rollouts.Cut``): count it now and keep it
        for the group."""
        self.book_cut(cut)
        self.cuts.append(cut)

    def started_again(self, epoch: int) -> None:
        """Every member the call keeps started under ``epoch`` or later: the bound
        measures the call, and its group, from there."""
        self.start_epoch = epoch

    def watch(self) -> trio.Event:
        """An event set at the next cut signal for this call."""
        event = trio.Event()
        self.watchers.append(event)
        return event

    def unwatch(self, event: trio.Event) -> None:
        if event in self.watchers:
            self.watchers.remove(event)

    def cut_at(self, epoch: int) -> None:
        """The pipeline's signal: the stream is now at ``epoch``, where the call is as old
        as the bound allows; members still running are cut."""
        self.cut_epoch = epoch
        watchers, self.watchers = self.watchers, []
        for event in watchers:
            event.set()


@attrs.frozen(kw_only=True)
class CallContext:
    """Which call the running code belongs to (see the module docstring). Every field is
    ``None`` when nobody set it."""

    #: The call's slot in its stream: ``(batch_id, index_in_batch)``.
    slot: tuple[int, int] | None = None
    #: The attempt at the slot's group: 1, then 2, 3, ... for retries.
    attempt: int = 1
    #: The policy epoch the call (or this member, started again after a cut) started
    #: under: its group's ``start_epoch``.
    start_epoch: int | None = None
    #: The key the call's requests are placed by on the replicas: ``(run seed,
    #: batch_id, index_in_batch)``; siblings share it.
    group: tuple[int, int, int] | None = None
    #: The member (episode) of the group this code runs for.
    episode: int | None = None
    #: The prompt draws the call made so far (``PromptSource.draw`` appends to it).
    draws: list[Draw] | None = None
    #: The call's cuts, as the pipeline and the library's agents share them.
    cuts: CallCuts | None = None
    #: What this member has generated (for a cut).
    progress: CallProgress | None = None
    #: The call's trace span, when tracing is on.
    span: Sample | None = None


#: No call: the context outside a pipeline.
NO_CALL = CallContext()

#: The context of the running call.
call_context: contextvars.ContextVar[CallContext] = contextvars.ContextVar(
    "trio_rollouts_call", default=NO_CALL
)


def current_call() -> CallContext:
    """The context of the call the running code belongs to (:data:`NO_CALL` outside a
    pipeline)."""
    return call_context.get()


@contextlib.contextmanager
def calling(**fields: Any) -> Iterator[CallContext]:
    """Run the ``with`` body in the current context narrowed by ``fields`` (the names of
    :class:`CallContext`'s fields); the old context is back after it."""
    context = attrs.evolve(call_context.get(), **fields)
    token = call_context.set(context)
    try:
        yield context
    finally:
        call_context.reset(token)
