"""Ordering (``enforce_order``): whole batches in ``batch_id`` order, groups by
``index_in_batch`` (invariant 8 in ``docs/reference-design.md``).

Groups are reordered where they are taken, so ordering costs no task: the stream puts
each group it pulls from the buffer into :class:`BatchOrder`, and hands out only what
the order has released.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from trio_rollouts.models._rollouts import RolloutGroup

__all__ = ["BatchOrder"]


class BatchOrder:
    """Groups held until their batch is complete and next in line.

    Threads: the pipeline's Trio thread only.
    """

    __slots__ = ("next_batch_id", "num_groups", "ready", "released_of_next", "waiting")

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        #: Groups whose turn has come, in order.
        self.ready: collections.deque[RolloutGroup] = collections.deque()
        #: batch_id -> groups of batches not yet complete or not yet next.
        self.waiting: dict[int, list[RolloutGroup]] = {}
        self.next_batch_id = 0
        # Groups of batch next_batch_id already released to ``ready`` when a weight
        # update took one of its groups back as stale (see evict).
        self.released_of_next = 0

    def __len__(self) -> int:
        """How many groups it holds (ready or waiting)."""
        return len(self.ready) + sum(len(batch) for batch in self.waiting.values())

    def hold(self, group: RolloutGroup) -> None:
        """Keep ``group`` until its batch is complete and next in line."""
        self.waiting.setdefault(group.batch_id, []).append(group)
        size = self.num_groups
        while len(self.waiting.get(self.next_batch_id, ())) + self.released_of_next == size:
            complete = self.waiting.pop(self.next_batch_id, [])
            complete.sort(key=lambda g: g.index_in_batch)
            self.ready.extend(complete)
            self.next_batch_id += 1
            self.released_of_next = 0

    def put_back(self, groups: Sequence[RolloutGroup]) -> None:
        """Groups handed out and taken back (in order): first in line again."""
        self.ready.extendleft(reversed(groups))

    def evict(
        self, too_old: Callable[[int], bool], regenerate: Callable[[RolloutGroup], None]
    ) -> None:
        """After the policy epoch moved: send the held groups that are now too old to
        ``regenerate`` (their slots are generated again). Released groups after the
        first stale one go back to waiting, so that order stays gap-free."""
        for batch in self.waiting.values():
            for group in [g for g in batch if too_old(g.start_epoch)]:
                batch.remove(group)
                regenerate(group)
        first = next((i for i, g in enumerate(self.ready) if too_old(g.start_epoch)), None)
        if first is None:
            return
        ready = list(self.ready)
        keep, back = ready[:first], ready[first:]
        self.ready = collections.deque(keep)
        batch_id = back[0].batch_id
        # The batch's groups before the stale one (taken, or still ready) stay
        # released: all of the batch but what goes back. (A batch already partly sent
        # back by an earlier eviction was not released whole: count from what it had
        # released.)
        released = self.released_of_next if batch_id == self.next_batch_id else self.num_groups
        self.released_of_next = released - sum(1 for g in back if g.batch_id == batch_id)
        self.next_batch_id = batch_id
        for group in back:
            if too_old(group.start_epoch):
                regenerate(group)
            else:
                self.waiting.setdefault(group.batch_id, []).append(group)

    def rewind(self, groups: Sequence[RolloutGroup]) -> None:
        """Groups handed out and taken back to be generated again (stale): go back to the
        first batch among them, so that what the order had released after them waits
        until their slots are filled again and the order stays gap-free. Every group
        released after the first of ``groups`` must be among them, or have been put back
        (:meth:`put_back`) first."""
        if not groups:
            return
        first = min(group.batch_id for group in groups)
        # What the order had released of the first batch: all of it once it moved past.
        released = self.released_of_next if first == self.next_batch_id else self.num_groups
        held_back = list(self.ready)
        self.ready.clear()
        for group in held_back:
            self.waiting.setdefault(group.batch_id, []).append(group)
        back = [*held_back, *groups]
        self.released_of_next = released - sum(1 for g in back if g.batch_id == first)
        self.next_batch_id = first

    def clear(self) -> int:
        """Drop every group held; return how many there were."""
        count = len(self)
        self.ready.clear()
        self.waiting.clear()
        return count
