"""Admission inside the staleness bound: which new group calls may start now.

With ``max_staleness=K`` a group started under epoch ``e`` is dropped (``stale``) once
the stream reaches epoch ``e + K + 1``. If the consumer takes ``num_groups`` groups per
weight update, a call that starts now is taken before that only if fewer than
``(K + 1) * num_groups - t`` groups are ahead of it (``t``: the groups taken since the
last update, at most ``num_groups``), the groups ahead being those of the slots already
admitted and not taken (in flight, waiting to retry, finished, or generated again).
This is AReaL's admission rule, counted in groups. A new slot's first call starts only
when the rule allows it; ``parallel_generation_tasks`` stays the upper limit. Calls
generated again in their slot (retries, filtered, skipped, dropped or stale groups) were
admitted already and do not wait.

Exceptions keep the stream live: a call always starts when nothing is ahead of it (a
consumer that takes more than ``num_groups`` groups per update would otherwise wait
forever), and with ``enforce_order`` the slots of the oldest batch not wholly taken
always start (the consumer takes nothing before them). The slots that wait start in slot
order, one at a time as room appears, so a seeded run starts its calls alike every
time.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from trio_rollouts.pipeline._ledger import Ledger

__all__ = ["Admission"]

Slot = tuple[int, int]


class Admission:
    """The admission rule of one pipeline (see the module docstring). Not a checkpoint
    except :meth:`wait`; one Trio run."""

    __slots__ = (
        "admitted",
        "again",
        "capacity",
        "delivered_at_update",
        "ledger",
        "oldest_batch",
        "per_update",
        "released",
        "waiting",
    )

    def __init__(
        self,
        ledger: Ledger,
        max_staleness: int,
        num_groups: int,
        oldest_batch: Callable[[], int] | None = None,
    ) -> None:
        self.ledger = ledger
        #: With ``enforce_order``: the oldest batch not wholly taken, whose slots always
        #: start (the consumer takes nothing else before it; the groups of later
        #: batches held for order would otherwise keep it waiting forever).
        self.oldest_batch = oldest_batch
        #: Groups that may be ahead of a new call, right after an update.
        self.capacity = (max_staleness + 1) * num_groups
        self.per_update = num_groups
        #: Slots admitted so far (a slot generated again is the same slot).
        self.admitted = 0
        #: ``ledger.delivered`` when the last update's body returned.
        self.delivered_at_update = 0
        #: Slots waiting for room, and the event that lets each go.
        self.waiting: dict[Slot, trio.Event] = {}
        #: Slots let go and not yet run: room is kept for them, and later slots wait.
        self.released: set[Slot] = set()
        #: Slots whose finished group went stale and that are claimed again: admitted
        #: already (with ``enforce_order`` the consumer may need them before anything).
        self.again: set[Slot] = set()

    def ahead(self) -> int:
        """The groups ahead of a call that starts now: the slots admitted whose group is
        not taken (in flight, waiting to retry, finished, or being generated again).
        Counted in slots, which change only when a slot is admitted or its group taken,
        so that the calls that start at one instant do not depend on the order Trio runs
        the tasks of that instant in."""
        return self.admitted - self.ledger.delivered

    def room(self, reserved: int = 0) -> bool:
        """Whether a call that starts now (after ``reserved`` more) would be taken before
        the bound drops it."""
        ahead = self.ahead() + reserved
        if ahead == 0:
            return True
        taken = min(self.ledger.delivered - self.delivered_at_update, self.per_update)
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

        Cancellation: cancellable; the slot stops waiting."""
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
        """Something may have made room: let the earliest waiting slot go (it lets the
        next one go when it has started, :meth:`started`)."""
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
        self.delivered_at_update = self.ledger.delivered
        self.wake()
