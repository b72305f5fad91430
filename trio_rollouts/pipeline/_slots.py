"""Slots and backpressure: which slots may be generated, and which batches are
outstanding.

A *slot* is a ``(batch_id, index_in_batch)`` pair; a *batch* is ``num_groups`` slots that
share a ``batch_id``, numbered 0, 1, 2, ... in submission order. A batch is
*outstanding* from its submission until the consumer has taken its last group, and a
streaming pipeline submits a new batch exactly when one stops being outstanding
(invariant 2 in ``docs/reference-design.md``): a stalled consumer stalls generation.

Workers wait for a free slot in :meth:`Slots.claim`. The free slots are a queue with a
``trio.Semaphore`` counting them: one token per free slot, so a worker that acquires a
token always finds a slot, and waiting workers are served first come, first served.
"""

from __future__ import annotations

import collections

import trio

__all__ = ["Slot", "Slots"]

#: ``(batch_id, index_in_batch)``.
Slot = tuple[int, int]


class Slots:
    """Free slots, outstanding batches, and the workers waiting for a slot.

    Threads: the pipeline's Trio thread only.
    """

    def __init__(self, num_groups: int, streaming: bool) -> None:
        self.num_groups = num_groups
        self.streaming = streaming
        #: Submitted slots no worker has claimed, in the order they go out.
        self._free: collections.deque[Slot] = collections.deque()
        #: One token per free slot.
        self._tokens = trio.Semaphore(0)
        #: The next batch to submit.
        self.next_batch_id = 0
        #: Batches submitted and not wholly taken.
        self.outstanding = 0
        # Groups taken so far of each outstanding batch with some taken.
        self._taken_in_batch: dict[int, int] = {}
        # Batches whose completing take was undone (untake): their next completion
        # submits no batch, since the first did.
        self._untaken_batches: set[int] = set()

    def submit_batch(self) -> None:
        """Submit the next batch: its slots become free."""
        batch_id = self.next_batch_id
        self.next_batch_id += 1
        self.outstanding += 1
        for index in range(self.num_groups):
            self._free.append((batch_id, index))
            self._tokens.release()

    def put_first(self, slot: Slot) -> None:
        """Generate ``slot`` again, before any other free slot (a stale group's)."""
        self._free.appendleft(slot)
        self._tokens.release()

    async def claim(self) -> Slot:
        """Wait for a free slot and claim it.

        Cancellation: a checkpoint; a cancelled wait claims nothing (a worker of a
        pipeline that is shutting down starts no call).
        """
        await self._tokens.acquire()
        return self._free.popleft()

    def oldest_batch(self) -> int:
        """The oldest batch not wholly taken (with ``enforce_order``, batches are taken
        whole and in order)."""
        return self.next_batch_id - self.outstanding

    def taken(self, batch_id: int) -> None:
        """The consumer took a group of batch ``batch_id``; its last submits the next
        batch (streaming)."""
        taken = self._taken_in_batch.get(batch_id, 0) + 1
        if taken < self.num_groups:
            self._taken_in_batch[batch_id] = taken
            return
        self._taken_in_batch.pop(batch_id, None)
        self.outstanding -= 1
        if self.streaming:
            if batch_id in self._untaken_batches:
                # Its first completion, which untake() undid, submitted the next batch.
                self._untaken_batches.discard(batch_id)
                return
            self.submit_batch()

    def untake(self, batch_id: int) -> None:
        """Undo :meth:`taken`. A batch whose completion is undone is outstanding again;
        its next completion submits no batch, since the first did."""
        if batch_id in self._taken_in_batch:
            left = self._taken_in_batch[batch_id] - 1
            if left:
                self._taken_in_batch[batch_id] = left
            else:
                del self._taken_in_batch[batch_id]
            return
        if self.num_groups > 1:
            self._taken_in_batch[batch_id] = self.num_groups - 1
        self.outstanding += 1
        if self.streaming:
            self._untaken_batches.add(batch_id)
