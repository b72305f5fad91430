"""The pause state of an :class:`~trio_rollouts.inference.EmbeddedInference` in one Trio run.

A :class:`RunState` counts the requests admitted and those inside a token step, parks the
requests a :class:`Pause` holds (at admission, in their first-token wait, between token
steps) and the ``pause()`` call waiting for the backend to be quiet, and holds the engine
model's cluster of that run. The backend keeps one per Trio run (Trio objects belong to
one run), in a ``RunVar``; its methods never checkpoint except :meth:`RunState.hold` and
:meth:`RunState.prefill`, which wait.
"""

from __future__ import annotations

from typing import Final

import attrs
import trio

from trio_rollouts.inference._pausable import WEIGHT_UPDATE_MODES, WeightUpdateMode
from trio_rollouts.inference.embedded._engine import Cluster

__all__ = ["ALL_MODES", "HOLDING_MODES", "Pause", "RunState"]


#: The modes the backend supports: all four.
ALL_MODES: Final[frozenset[WeightUpdateMode]] = frozenset(WEIGHT_UPDATE_MODES)
#: The modes that hold requests in flight (the others only hold new requests).
HOLDING_MODES: Final[frozenset[WeightUpdateMode]] = frozenset({"keep", "abort"})


@attrs.define(eq=False)
class Pause:
    """One pause, from ``pause(mode)`` until it ends."""

    mode: WeightUpdateMode
    #: Ended by a cancelled pause(), not by resume(): nothing it held was aborted.
    undone: bool = False


@attrs.define(eq=False)
class RunState:
    """The pause state of one interface in one Trio run."""

    pause: Pause | None = None
    #: Requests admitted and not finished (a drain or restart pause waits for none).
    admitted: int = 0
    #: Requests inside a token step (a keep or abort pause waits for none).
    decoding: int = 0
    #: Requests held by the pause, until resume().
    held: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    #: Requests in their first-token wait (a keep or abort pause cuts it).
    prefilling: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    #: The pause() waiting for ``busy`` to reach 0.
    quiet: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    #: The engine model's replicas in this run (``engine`` only; made at first use).
    cluster: Cluster | None = None

    def busy(self, mode: WeightUpdateMode) -> int:
        return self.decoding if mode in HOLDING_MODES else self.admitted

    def holds_in_flight(self) -> bool:
        return self.pause is not None and self.pause.mode in HOLDING_MODES

    def wake_pause(self) -> None:
        if self.pause is not None:
            self.quiet.unpark_all()

    def release(self, *, undone: bool) -> None:
        """End the pause (synchronously: no checkpoint)."""
        if self.pause is not None:
            self.pause.undone = undone
            self.pause = None
        self.held.unpark_all()
        self.quiet.unpark_all()

    async def hold(self, *, admission: bool) -> bool:
        """Wait while a pause holds this request (any pause at admission; keep or abort
        in flight). Returns whether an abort that was resumed stopped it."""
        aborted = False
        while (pause := self.pause) is not None and (admission or pause.mode in HOLDING_MODES):
            await self.held.park()
            aborted = aborted or (pause.mode == "abort" and not pause.undone)
        return aborted

    async def prefill(self, seconds: float) -> None:
        """The first-token wait: ``seconds`` of queueing and prefill. A keep or abort
        pause cuts it; after keep the rest is waited, after abort all of it again."""
        deadline = trio.current_time() + seconds
        while True:
            with trio.move_on_at(deadline):
                await self.prefilling.park()
            if not self.holds_in_flight():
                if trio.current_time() >= deadline:
                    return
                continue  # woken by a pause that was undone before this task ran
            remaining = max(0.0, deadline - trio.current_time())
            if await self.hold(admission=False):
                remaining = seconds
            deadline = trio.current_time() + remaining
