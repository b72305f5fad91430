"""The handoff: finished groups on their way from the workers to the stream.

What a Trio memory channel of ``buffer_size`` did here, cut to what the pipeline uses and
laid out for its hot path: a buffer of at most ``capacity`` groups (invariant 3 of
``_pipeline.py``), the workers waiting with a group beyond that, in arrival order, and
the consumer waiting for a group while the buffer is empty. A take from a full buffer
moves the first waiting worker's group into it and wakes that worker.

Compared with the channel, a worker that has to wait costs no coroutine layer, no
``WouldBlock`` raised and caught, and no second checkpoint: the worker waits inline in
its own loop (``Pipeline.work``), with :meth:`Handoff.put` keeping the books around its
``wait_task_rescheduled``. In s1 of ``benchmarks/pipeline.py`` nearly every
group goes through that wait once.

Waiters are kept in deques and removed lazily: a cancelled waiter's entry is marked dead
(its task set to ``None``) and skipped when it comes up, so cancelling one costs O(1).

Threads: the pipeline's Trio thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import trio
from trio.lowlevel import Abort, RaiseCancelT, current_task, reschedule, wait_task_rescheduled

from trio_rollouts.models._records import RolloutGroup

__all__ = ["Handoff"]

#: A waiting task and its group: the group a worker waits to put, or the group handed to
#: a waiting consumer (``None`` until then). The task is ``None`` once it was cancelled.
_Entry = list[trio.lowlevel.Task | RolloutGroup | None]


class Handoff:
    """The finished groups not yet taken: buffered, or held by a waiting worker."""

    __slots__ = (
        "buffer",
        "capacity",
        "closed",
        "receivers",
        "sender_woken",
        "senders",
        "senders_waiting",
        "sending_closed",
    )

    def __init__(self, capacity: int, sender_woken: Callable[[], None]) -> None:
        self.capacity = capacity
        #: Told each time a take wakes a waiting worker (``Slots.sender_woken``).
        self.sender_woken = sender_woken
        #: At most ``capacity`` groups, in the order they are taken.
        self.buffer: collections.deque[RolloutGroup] = collections.deque()
        #: Workers waiting with a group while the buffer is full, first come first.
        self.senders: collections.deque[_Entry] = collections.deque()
        #: How many of them are still waiting (not cancelled).
        self.senders_waiting = 0
        #: Consumers waiting for a group while the buffer is empty.
        self.receivers: collections.deque[_Entry] = collections.deque()
        #: No group will be put any more (a non-streaming batch was sent whole).
        self.sending_closed = False
        #: The stream's ``async with`` has exited.
        self.closed = False

    def __len__(self) -> int:
        """How many groups are buffered."""
        return len(self.buffer)

    # ---------------------------------------------------------------- the workers' side

    def put(self, group: RolloutGroup) -> Callable[[RaiseCancelT], Abort] | None:
        """Hand ``group`` over: to a waiting consumer, or into the buffer while it has
        room and no worker waits (``None``). Otherwise the calling worker is queued to put
        it when a take makes room, and must at once ``await
        trio.lowlevel.wait_task_rescheduled()`` with the abort callback returned.

        That wait returns once ``group`` is in the buffer. Cancelled, it raises and
        ``group`` was not handed over (the caller books it). Not a checkpoint itself.
        """
        receivers = self.receivers
        while receivers:
            entry = receivers.popleft()
            task = entry[0]
            if task is not None:
                entry[1] = group
                reschedule(task)  # type: ignore[arg-type]
                return None
        if not self.senders_waiting and len(self.buffer) < self.capacity:
            self.buffer.append(group)
            return None
        entry = [current_task(), group]
        self.senders.append(entry)
        self.senders_waiting += 1

        def abort(raise_cancel: RaiseCancelT) -> Abort:
            entry[0] = entry[1] = None
            self.senders_waiting -= 1
            return Abort.SUCCEEDED

        return abort

    def release_senders(self) -> int:
        """At shutdown: wake every waiting worker without taking its group (the caller
        books those groups); return how many there were."""
        released = self.senders_waiting
        senders = self.senders
        while senders:
            task = senders.popleft()[0]
            if task is not None:
                reschedule(task)  # type: ignore[arg-type]
        self.senders_waiting = 0
        return released

    def close_sending(self) -> None:
        """No group will be put any more: waiting consumers, and takes from an empty
        buffer from now on, get ``trio.EndOfChannel``."""
        self.sending_closed = True
        self.wake_receivers()

    # ---------------------------------------------------------------- the consumer's side

    def take(self) -> RolloutGroup | None:
        """The next group, or ``None`` when none is ready. A take from a full buffer
        moves the first waiting worker's group into it and wakes that worker (telling
        ``sender_woken``). Not a checkpoint.

        Raises ``trio.EndOfChannel`` when the buffer is empty and sending has closed,
        ``trio.ClosedResourceError`` after :meth:`close`."""
        if self.closed:
            raise trio.ClosedResourceError
        buffer = self.buffer
        if self.senders_waiting:
            senders = self.senders
            while True:
                task, group = senders.popleft()
                if task is not None:
                    self.senders_waiting -= 1
                    buffer.append(group)  # type: ignore[arg-type]
                    reschedule(task)  # type: ignore[arg-type]
                    self.sender_woken()
                    break
        if buffer:
            return buffer.popleft()
        if self.sending_closed:
            raise trio.EndOfChannel
        return None

    async def wait(self) -> RolloutGroup:
        """Wait until a worker hands over a group (call when :meth:`take` returned
        ``None``).

        Raises as :meth:`take` does when sending closes or the handoff closes meanwhile.
        Cancellation: no group is lost; one handed over before the cancellation is
        returned.
        """
        entry: _Entry = [current_task(), None]
        self.receivers.append(entry)

        def abort(raise_cancel: RaiseCancelT) -> Abort:
            entry[0] = None
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)
        group = entry[1]
        if group is None:
            raise trio.ClosedResourceError if self.closed else trio.EndOfChannel
        return group  # type: ignore[return-value]

    def __enter__(self) -> Handoff:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """The stream's ``async with`` exited (every worker is gone): takes raise
        ``trio.ClosedResourceError`` from now on, and so do consumers still waiting."""
        self.closed = True
        self.buffer.clear()
        self.wake_receivers()

    def wake_receivers(self) -> None:
        """Wake every waiting consumer with nothing handed over (they raise)."""
        receivers = self.receivers
        while receivers:
            task = receivers.popleft()[0]
            if task is not None:
                reschedule(task)  # type: ignore[arg-type]
