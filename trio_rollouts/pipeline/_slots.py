"""Slots and backpressure: which slots may be generated, and who wakes to generate them.

A *slot* is a ``(batch_id, index_in_batch)`` pair; a *batch* is ``num_groups`` slots that
share a ``batch_id``, numbered 0, 1, 2, ... in submission order. A batch is
*outstanding* from its submission until the consumer has taken its last group, and a
streaming pipeline submits a new batch exactly when one stops being outstanding
(invariant 2 of ``_pipeline.py``): a stalled consumer stalls generation.

Waking a worker is the dominant per-group cost, so :class:`Slots` also keeps the books
of who is coming to claim a free slot (workers unparked, or woken by a take from the
full buffer they waited on: see ``_handoff.py``), and wakes no one for a slot somebody
will claim anyway.
"""

from __future__ import annotations

import collections
import itertools

import trio

__all__ = ["Slots"]


class Slots:
    """Free slots, outstanding batches, and the workers parked waiting for slots.

    Threads: the pipeline's Trio thread only.
    """

    __slots__ = (
        "coming_to_claim",
        "free",
        "idle_workers",
        "next_batch_id",
        "num_groups",
        "outstanding",
        "streaming",
        "taken_in_batch",
        "untaken_batches",
    )

    def __init__(self, num_groups: int, streaming: bool) -> None:
        self.num_groups = num_groups
        self.streaming = streaming
        #: Slots submitted and not claimed by a worker, in the order they go out.
        self.free: collections.deque[tuple[int, int]] = collections.deque()
        self.idle_workers = trio.lowlevel.ParkingLot()
        self.next_batch_id = 0
        self.outstanding = 0
        # Groups taken so far of each outstanding batch with some taken (num_groups > 1).
        self.taken_in_batch: dict[int, int] = {}
        # Batches whose completing take was undone (untake): their next completion
        # submits no batch, since the first did.
        self.untaken_batches: set[int] = set()
        # Wake-up accounting (see wake_workers): workers that are runnable and will look
        # for a free slot before they next block.
        self.coming_to_claim = 0

    # ---------------------------------------------------------------- submission

    def submit_batch(self) -> None:
        """Submit the next batch: its slots become free."""
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        self.outstanding += 1
        free = self.free
        if self.num_groups == 1:
            free.append((batch_id, 0))
        else:
            free.extend(zip(itertools.repeat(batch_id), range(self.num_groups)))
        # wake_workers(), inline: a streaming pipeline submits a batch per batch taken.
        needed = len(free) - self.coming_to_claim
        if needed > 0:
            self.coming_to_claim += len(self.idle_workers.unpark(count=needed))

    def put_first(self, batch_id: int, index: int) -> None:
        """Generate the slot again, before any other free slot (a stale group's)."""
        self.free.appendleft((batch_id, index))
        self.wake_workers()

    def wake_workers(self) -> None:
        """Unpark as many idle workers as there are free slots nobody is coming for.

        Every worker calls this after claiming, so a shortfall heals itself.
        """
        needed = len(self.free) - self.coming_to_claim
        if needed > 0:
            self.coming_to_claim += len(self.idle_workers.unpark(count=needed))

    def claim(self, woken: bool) -> tuple[int, int] | None:
        """The next free slot for the calling worker, or ``None`` when there is none (it
        then parks in :attr:`idle_workers`). ``woken``: whether the worker was woken to
        claim since it last claimed (unparked, or woken from the full buffer: see
        :meth:`sender_woken`), so that it is no longer counted as coming.

        (The workers park and wait for room inline, with these methods keeping the books
        around the awaits: a coroutine layer of ours on those paths would cost on every
        suspension and resumption, once per group.)"""
        if woken:
            self.coming_to_claim -= 1
        free = self.free
        if not free:
            return None
        slot = free.popleft()
        # wake_workers(), inline: this runs once per group.
        needed = len(free) - self.coming_to_claim
        if needed > 0:
            self.coming_to_claim += len(self.idle_workers.unpark(count=needed))
        return slot

    # ---------------------------------------------------------------- the buffer

    def sender_woken(self) -> None:
        """A take from the full buffer woke a worker waiting with a group (see
        ``Handoff.take``): it will claim next."""
        self.coming_to_claim += 1

    # ---------------------------------------------------------------- takes

    def taken(self, batch_id: int) -> None:
        """The consumer took a group of batch ``batch_id``; its last submits the next
        batch (streaming)."""
        if self.num_groups > 1:
            taken = self.taken_in_batch.get(batch_id, 0) + 1
            if taken < self.num_groups:
                self.taken_in_batch[batch_id] = taken
                return
            del self.taken_in_batch[batch_id]
        self.outstanding -= 1
        if self.streaming:
            if self.untaken_batches and batch_id in self.untaken_batches:
                # Its first completion, which untake() undid, submitted the next batch.
                self.untaken_batches.discard(batch_id)
                return
            self.submit_batch()

    def untake(self, batch_id: int) -> None:
        """Undo :meth:`taken`. A batch whose completion is undone is outstanding again;
        its next completion submits no batch, since the first did."""
        if self.num_groups > 1 and batch_id in self.taken_in_batch:
            left = self.taken_in_batch[batch_id] - 1
            if left:
                self.taken_in_batch[batch_id] = left
            else:
                del self.taken_in_batch[batch_id]
            return
        if self.num_groups > 1:
            self.taken_in_batch[batch_id] = self.num_groups - 1
        self.outstanding += 1
        if self.streaming:
            self.untaken_batches.add(batch_id)
