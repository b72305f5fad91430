"""Policy epochs: the stream's epoch, the calls in flight, the weight-update gate,
``weight_update`` itself, and admission inside the staleness bound.

One module, because a weight update acts on all of them at once:

- :class:`Epochs` holds the stream's policy epoch and every call in flight (an
  :class:`InFlight` each: its slot, its :class:`~trio_rollouts._context.CallCuts`, when
  it started, and the cancel scope it runs in). While an update's block is open no call
  starts (:meth:`Epochs.wait_for_gate`; held calls start one at a time, in slot order,
  when it ends, so a seeded backend samples alike on every run). An update may drop calls
  in flight (a ``restart``, or the staleness bound) by cancelling their scopes; while a
  ``keep``/``abort`` update holds calls their deadlines stand still.
- :func:`open_weight_update` is ``stream.weight_update(mode)``: its checks, the gate, the
  drops, the pauses and the resumes, on every route.
- :class:`Admission` decides when a new slot's first call may start with
  ``max_staleness`` set (AReaL's rule, counted in groups).

``exceeds_bound`` is the one place the staleness bound is computed.
"""

from __future__ import annotations

import contextlib
import enum
import math
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import attrs
import trio

from trio_rollouts._checks import is_int
from trio_rollouts._context import CallCuts
from trio_rollouts.inference import InferenceInterface, OpenAIInference
from trio_rollouts.inference._pausable import (
    WEIGHT_UPDATE_MODES,
    Pausable,
    WeightUpdateError,
    WeightUpdateMode,
)
from trio_rollouts.pipeline._slots import Slot

__all__ = [
    "Admission",
    "DropReason",
    "Epochs",
    "InFlight",
    "UpdatedPipeline",
    "WeightUpdate",
    "checked_epoch",
    "checked_mode",
    "exceeds_bound",
    "open_weight_update",
    "warn_epoch_ahead",
]


def exceeds_bound(start_epoch: int, epoch: int, bound: int | None) -> bool:
    """Whether a group generated from ``start_epoch`` is older than ``max_staleness``
    (``bound``; ``None`` is no bound) at ``epoch``."""
    return bound is not None and epoch - start_epoch > bound


class DropReason(enum.Enum):
    """Why a weight update cancelled a call in flight (its slot is generated again)."""

    #: A ``restart`` update cancels every call in flight.
    RESTART = "restart"
    #: The new epoch would make the call's group older than ``max_staleness``.
    STALE = "stale"


@attrs.define(eq=False)
class InFlight:
    """One call in flight: its slot, its cuts (shared with the agent), when it started
    (Trio's clock, time held by an update included), the cancel scope it runs in, and why
    an update dropped it (``None``: it did not)."""

    slot: Slot
    cuts: CallCuts
    since: float
    scope: trio.CancelScope
    dropped: DropReason | None = None
    #: While a keep/abort update holds calls: the time left before the deadline.
    remaining: float = math.inf


class Epochs:
    """The policy epoch, the calls in flight and the update gate of one pipeline.

    Threads: the pipeline's Trio thread only.
    """

    def __init__(self, epoch: int, max_staleness: int | None) -> None:
        #: The stream's policy epoch: calls that start now start under it.
        self.epoch = epoch
        self.max_staleness = max_staleness
        #: Whether an update's block is open: no call starts.
        self.updating = False
        self.in_flight: set[InFlight] = set()
        # Calls held by an update, and the queue they start from when it ends.
        self._held: list[tuple[Slot, trio.Event]] = []
        self._queue: list[trio.Event] = []
        # Set when a call ends (an update waits for drains and drops).
        self._progress = trio.Event()
        # The epochs of keep/abort updates with a backend that does not stamp where the
        # epoch changed: a call that went on through one is counted in ``mixed``.
        self._unstamped: list[int] = []
        # When a keep/abort update stopped the deadlines' clocks (None: they run).
        self._frozen_at: float | None = None

    # ---------------------------------------------------------------- calls

    def too_old(self, start_epoch: int) -> bool:
        """Whether a group generated from ``start_epoch`` exceeds ``max_staleness`` now."""
        return exceeds_bound(start_epoch, self.epoch, self.max_staleness)

    async def wait_for_gate(self, slot: Slot) -> None:
        """Hold the call of ``slot``, about to start, until no update's block is open.
        Not a checkpoint when none is.

        Cancellation: a cancellation point while it waits; a cancelled call starts no
        call.
        """
        while self.updating:
            released = trio.Event()
            self._held.append((slot, released))
            await released.wait()
            # Let the next held call go once this one has run to its first checkpoint.
            self._release_next()

    def start(
        self, slot: Slot, timeout: float | None, book_cut: Callable[[object], None]
    ) -> InFlight:
        """A call of ``slot`` starts now, under the current epoch, in a cancel scope of
        its own (with ``timeout`` as its deadline)."""
        now = trio.current_time()
        scope = trio.CancelScope(deadline=math.inf if timeout is None else now + timeout)
        call = InFlight(slot, CallCuts(self.epoch, book_cut), now, scope)
        self.in_flight.add(call)
        return call

    def end(self, call: InFlight) -> DropReason | None:
        """``call`` ended (returned or raised): why an update dropped it, or ``None``."""
        self.in_flight.discard(call)
        self._progress.set()
        return call.dropped

    def mixed(self, start_epoch: int) -> bool:
        """Whether a call that started under ``start_epoch`` and returned now went on
        through a keep/abort update whose backend does not stamp where the epoch
        changed (its group is counted in ``mixed``)."""
        return any(start_epoch < epoch <= self.epoch for epoch in self._unstamped)

    def oldest_call_age(self) -> float:
        """Seconds since the oldest call in flight started; 0.0 when none is."""
        if not self.in_flight:
            return 0.0
        try:
            now = trio.current_time()
        except RuntimeError:  # outside the Trio run (it has ended): nothing runs
            return 0.0
        return max(0.0, now - min(call.since for call in self.in_flight))

    def calls_going_on(self) -> int:
        """How many calls are in flight and not dropped."""
        return sum(1 for call in self.in_flight if call.dropped is None)

    def drop(self, reason: DropReason, older_than: int | None) -> int:
        """Cancel the calls in flight that started before epoch ``older_than`` (all of
        them when ``None``), to be generated again; return how many."""
        dropped = 0
        for call in self.in_flight:
            if call.dropped is not None:
                continue
            if older_than is not None and call.cuts.start_epoch >= older_than:
                continue
            call.dropped = reason
            call.scope.cancel()
            dropped += 1
        return dropped

    def dropping(self) -> bool:
        """Whether a call an update dropped has not exited yet."""
        return any(call.dropped is not None for call in self.in_flight)

    async def wait_for_progress(self) -> None:
        """Wait until a call in flight ends.

        Cancellation: a cancellation point.
        """
        self._progress = trio.Event()
        await self._progress.wait()

    # ---------------------------------------------------------------- the gate

    def close(self) -> None:
        """An update begins: no call starts."""
        self.updating = True

    def advance(self, epoch: int, stamped: bool) -> None:
        """The update's body returned: calls start under ``epoch`` from now on.
        ``stamped`` is false for a keep/abort update with a backend that does not stamp
        where the epoch changed."""
        if not stamped:
            self._unstamped.append(epoch)
        self.epoch = epoch

    def open(self) -> None:
        """End an update (synchronous, so it cannot be interrupted): the deadlines'
        clocks go on, and the held calls start one by one, in slot order."""
        self.thaw()
        self.updating = False
        self._held.sort(key=lambda held: held[0])
        self._queue.extend(released for _, released in self._held)
        self._held.clear()
        self._release_next()

    def _release_next(self) -> None:
        if self._queue:
            self._queue.pop(0).set()

    def freeze(self) -> None:
        """Stop the deadlines' clocks of the calls in flight (a keep/abort update holds
        them)."""
        now = trio.current_time()
        self._frozen_at = now
        for call in self.in_flight:
            call.remaining = call.scope.deadline - now
            call.scope.deadline = math.inf

    def thaw(self) -> None:
        """Start the clocks again, less the time they stood still."""
        if self._frozen_at is None:
            return
        now = trio.current_time()
        self._frozen_at = None
        for call in self.in_flight:
            call.scope.deadline = now + call.remaining
            call.remaining = math.inf


class UpdatedPipeline(Protocol):
    """What a weight update needs of the pipeline it pauses."""

    @property
    def closed(self) -> bool: ...

    @property
    def epochs(self) -> Epochs: ...

    @property
    def interface(self) -> InferenceInterface: ...

    def calls_in_flight(self) -> int: ...

    def paused_for(self, seconds: float) -> None: ...

    def advance_epoch(self, epoch: int, *, stamped: bool) -> None: ...


@attrs.define(kw_only=True, eq=False)
class WeightUpdate:
    """A weight update in progress, as ``stream.weight_update(...)`` yields it.

    - ``epoch``: the policy epoch generation resumes under when the body returns.
    - ``mode``: ``"drain"``, ``"restart"``, ``"keep"`` or ``"abort"``.
    - ``held``: calls held by ``keep``, aborted by ``abort``, or cancelled by ``restart``
      or by the staleness bound when the update began (0 for a plain drain).
    - ``pause_seconds``: from entering the block until the body started.
    """

    epoch: int
    mode: WeightUpdateMode
    held: int = 0
    pause_seconds: float = 0.0


def checked_mode(mode: object) -> WeightUpdateMode:
    if not isinstance(mode, str) or mode not in WEIGHT_UPDATE_MODES:
        allowed = ", ".join(repr(m) for m in ("drain", "restart", "keep", "abort"))
        msg = f"weight_update mode must be one of {allowed}, got {mode!r}"
        raise ValueError(msg)
    return mode


def checked_epoch(epoch: object, current: int) -> int:
    if epoch is None:
        return current + 1
    if not is_int(epoch):
        msg = f"weight_update epoch must be an int or None, got {epoch!r}"
        raise TypeError(msg)
    if epoch <= current:  # type: ignore[operator]
        msg = (
            f"weight_update epoch must be greater than the stream's policy_epoch "
            f"({current}), got {epoch!r}"
        )
        raise ValueError(msg)
    return epoch  # type: ignore[return-value]


def checked_backends(
    backends: Sequence[InferenceInterface] | None,
    default: InferenceInterface,
    mode: WeightUpdateMode,
) -> list[Pausable]:
    """The Pausable backends to pause, each once; ``TypeError`` for a backend that cannot
    pause for ``mode``."""
    if backends is None:
        given: list[object] = [default]
    elif isinstance(backends, (str, bytes)) or not isinstance(backends, Sequence):
        msg = f"backends must be a list of inference interfaces or None, got {backends!r:.80}"
        raise TypeError(msg)
    else:
        given = list(backends)
    pausable: list[Pausable] = []
    for i, backend in enumerate(given):
        if not isinstance(backend, InferenceInterface):
            msg = f"backends[{i}] must be an InferenceInterface, got {type(backend).__name__}"
            raise TypeError(msg)
        if not isinstance(backend, Pausable):
            if mode in ("keep", "abort"):
                msg = (
                    f"weight_update(mode={mode!r}) needs backends that can pause (inference."
                    f"Pausable); {type(backend).__name__} is not: use mode='drain' or "
                    "'restart', or a Pausable backend (EmbeddedInference, or "
                    "OpenAIInference(server='vllm' | 'sglang'))"
                )
                raise TypeError(msg)
            continue
        if mode not in backend.supported_modes:
            supported = ", ".join(repr(m) for m in sorted(backend.supported_modes))
            hint = (
                " (OpenAIInference supports keep and abort with server='vllm' or 'sglang')"
                if mode in ("keep", "abort") and isinstance(backend, OpenAIInference)
                else ""
            )
            msg = (
                f"{type(backend).__name__} cannot pause for weight_update(mode={mode!r}); "
                f"it supports {supported}{hint}"
            )
            raise TypeError(msg)
        if all(backend is not seen for seen in pausable):
            pausable.append(backend)
    return pausable


async def _resume_all(backends: Sequence[Pausable], epoch: int) -> list[BaseException]:
    """Resume every backend under ``epoch``, shielded; return the failures."""
    failures: list[BaseException] = []
    with trio.CancelScope(shield=True):
        for backend in backends:
            try:
                await backend.resume(epoch)
            except Exception as exc:
                exc.add_note(f"while resuming {type(backend).__name__} under epoch {epoch}")
                failures.append(exc)
    return failures


@contextlib.asynccontextmanager
async def open_weight_update(
    pipeline: UpdatedPipeline,
    mode: object,
    epoch: object,
    backends: Sequence[InferenceInterface] | None,
) -> AsyncIterator[WeightUpdate]:
    """What ``RolloutStream.weight_update`` returns (its docstring says what it does).

    1. Checks, before anything pauses: the mode, the epoch, the backends, one update at
       a time.
    2. The gate closes: no call starts until the update is over.
    3. Calls in flight: with a staleness bound, those the new epoch makes too old are
       cancelled (``stale``); ``restart`` cancels all of them (``restarted``); ``keep``
       and ``abort`` stop their deadlines' clocks. ``drain`` and ``restart`` wait until
       no call is in flight, ``keep``/``abort`` until the cancelled calls have exited.
    4. Each Pausable backend gets ``pause(mode)``; the body starts when all returned.
    5. At exit, every paused backend gets ``resume(epoch)``, shielded: the new epoch when
       the body returned, the old one otherwise. The gate opens on every route.
    """
    p = pipeline
    epochs = p.epochs
    if p.closed:
        msg = "weight_update() on a stream whose async with has exited"
        raise RuntimeError(msg)
    checked = checked_mode(mode)
    new_epoch = checked_epoch(epoch, epochs.epoch)
    pausable = checked_backends(backends, p.interface, checked)
    if epochs.updating:
        msg = "a weight update is already in progress on this stream (one at a time)"
        raise RuntimeError(msg)
    old_epoch = epochs.epoch
    update = WeightUpdate(epoch=new_epoch, mode=checked)
    entered = trio.current_time()
    epochs.close()
    paused: list[Pausable] = []
    try:
        bound = epochs.max_staleness
        if checked == "restart":
            update.held = epochs.drop(DropReason.RESTART, None)
        elif bound is not None:
            update.held = epochs.drop(DropReason.STALE, new_epoch - bound)
        if checked in ("keep", "abort"):
            update.held += epochs.calls_going_on()
            epochs.freeze()
            while epochs.dropping():
                await epochs.wait_for_progress()
        else:
            while p.calls_in_flight():
                await epochs.wait_for_progress()
        for backend in pausable:
            paused.append(backend)
            try:
                await backend.pause(checked)
            except Exception as exc:
                msg = (
                    f"pausing {type(backend).__name__} for weight_update(mode={checked!r}, "
                    f"epoch={new_epoch}) failed: {type(exc).__name__}: {exc}; every backend "
                    f"paused so far was resumed under epoch {old_epoch}"
                )
                raise WeightUpdateError(msg) from exc
        update.pause_seconds = trio.current_time() - entered
        p.paused_for(update.pause_seconds)
    except BaseException as exc:
        # A pause failed, or the update was cancelled before its body: resume what was
        # paused (the failing backend included) under the old epoch.
        for failure in await _resume_all(paused, old_epoch):
            exc.add_note(f"resuming failed too: {type(failure).__name__}: {failure}")
        epochs.open()
        raise
    try:
        yield update
    except BaseException as exc:
        # The body raised or was cancelled: generation goes on under the old epoch.
        for failure in await _resume_all(paused, old_epoch):
            exc.add_note(f"resuming failed too: {type(failure).__name__}: {failure}")
        epochs.open()
        raise
    stamped = checked not in ("keep", "abort") or all(b.stamps_policy_epoch for b in pausable)
    p.advance_epoch(new_epoch, stamped=stamped)
    failures = await _resume_all(paused, new_epoch)
    epochs.open()
    if failures:
        error = WeightUpdateError(
            f"the weight update to epoch {new_epoch} finished, but resuming "
            f"{len(failures)} backend(s) failed: {type(failures[0]).__name__}: {failures[0]}"
        )
        for failure in failures[1:]:
            error.add_note(f"resuming failed too: {type(failure).__name__}: {failure}")
        raise error from failures[0]


def warn_epoch_ahead(backend: Pausable, stream_epoch: int) -> None:
    """Warn that ``backend``'s policy epoch is ahead of the stream's (``stream_epoch``):
    its weights were changed outside ``stream.weight_update``."""
    msg = (
        f"the inference backend ({type(backend).__name__}) is at policy epoch "
        f"{backend.policy_epoch}, but the stream is at epoch {stream_epoch}: its weights "
        "were changed outside stream.weight_update() (set_generation_epoch, or a resume of "
        "its own), so the stream's policy_epoch, each group's start_epoch and max_staleness "
        "do not see the change (no group is counted stale). Push weights inside "
        "'with stream.weight_update() as update:' (the sync bridge's stream has it too), "
        "which moves the stream's epoch and the backend's together"
    )
    warnings.warn(msg, UserWarning, stacklevel=4)


class Admission:
    """Which new slots' first calls may start now, inside the staleness bound.

    With ``max_staleness=K`` a group started under epoch ``e`` is dropped (``stale``) once
    the stream reaches epoch ``e + K + 1``. If the consumer takes ``num_groups`` groups
    per weight update, a call that starts now is taken before that only if fewer than
    ``(K + 1) * num_groups - t`` groups are ahead of it (``t``: the groups taken since the
    last update, at most ``num_groups``), the groups ahead being those of the slots
    already admitted and not taken. Calls generated again in their slot were admitted
    already and do not wait. A call always starts when nothing is ahead of it, and with
    ``enforce_order`` the slots of the oldest batch not wholly taken always start. The
    slots that wait start in slot order, one at a time as room appears.

    Not a checkpoint except :meth:`wait`; one Trio run.
    """

    def __init__(
        self,
        delivered: Callable[[], int],
        max_staleness: int,
        num_groups: int,
        oldest_batch: Callable[[], int] | None = None,
    ) -> None:
        #: How many groups the consumer has taken so far.
        self.delivered = delivered
        #: With ``enforce_order``: the oldest batch not wholly taken.
        self.oldest_batch = oldest_batch
        #: Groups that may be ahead of a new call, right after an update.
        self.capacity = (max_staleness + 1) * num_groups
        self.per_update = num_groups
        #: Slots admitted so far (a slot generated again is the same slot).
        self.admitted = 0
        #: ``delivered()`` when the last update's body returned.
        self.delivered_at_update = 0
        #: Slots waiting for room, and the event that lets each go.
        self.waiting: dict[Slot, trio.Event] = {}
        #: Slots let go and not yet run: room is kept for them, and later slots wait.
        self.released: set[Slot] = set()
        #: Slots whose group went stale and that are claimed again: admitted already.
        self.again: set[Slot] = set()

    def ahead(self) -> int:
        """The groups ahead of a call that starts now: the slots admitted whose group is
        not taken."""
        return self.admitted - self.delivered()

    def room(self, reserved: int = 0) -> bool:
        """Whether a call that starts now (after ``reserved`` more) would be taken before
        the bound drops it."""
        ahead = self.ahead() + reserved
        if ahead == 0:
            return True
        taken = min(self.delivered() - self.delivered_at_update, self.per_update)
        return ahead < self.capacity - taken

    def may_start(self, slot: Slot) -> bool:
        """Whether ``slot``'s first call may start now: there is room, and no earlier
        slot waits for it (a slot generated again always may)."""
        released = self.released
        released.discard(slot)
        if slot in self.again:
            self.again.discard(slot)
            return True
        if self.oldest_batch is not None and slot[0] <= self.oldest_batch():
            self.admitted += 1
            return True
        if not self.room(len(released)):
            return False
        earlier = min(self.waiting, default=slot)
        if released:
            earlier = min(earlier, min(released))
        if earlier < slot:
            return False
        self.admitted += 1
        return True

    async def wait(self, slot: Slot) -> None:
        """Wait until :meth:`wake` lets ``slot`` go (then check :meth:`may_start` again).

        Cancellation: cancellable; the slot stops waiting.
        """
        event = trio.Event()
        self.waiting[slot] = event
        # A slot let go that waits again gives its room back: the next may use it.
        self.wake()
        try:
            await event.wait()
        finally:
            if self.waiting.get(slot) is event:
                del self.waiting[slot]

    def wake(self) -> None:
        """Something may have made room: let the earliest waiting slot go."""
        waiting = self.waiting
        if waiting:
            slot = min(waiting)
            released = self.released
            if released and min(released) < slot:
                return  # an earlier slot let go runs first, and wakes the next
            if self.room(len(released)) or (
                self.oldest_batch is not None and slot[0] <= self.oldest_batch()
            ):
                self.released.add(slot)
                waiting.pop(slot).set()

    def updated(self) -> None:
        """A weight update's body returned: the consumer's count starts again."""
        self.delivered_at_update = self.delivered()
        self.wake()
