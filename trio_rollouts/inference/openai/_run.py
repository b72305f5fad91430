"""What one :class:`~trio_rollouts.inference.OpenAIInference` holds in one Trio run
(:class:`RunState`): the run's transport, the requests in flight and the counts of the
run, the placement of calls on replicas, the pause, and who closes the transport.

Two owners, one state. **The caller**: ``async with interface:`` opens the state on entry
and closes its transport on exit, in the caller's task (nothing runs in the background to
keep it). **Implicitly** (no ``async with``): the first request of a run opens it, and a
Trio system task keeps it until the run ends (Trio cancels system tasks once the main
task has returned) or :meth:`~OpenAIInference.aclose` closes it; so a pipeline never
manages it, a sync ``generate`` (its own ``trio.run``) leaves nothing behind, and no
connection outlives the loop it is bound to.
"""

from __future__ import annotations

import logging
from typing import Final

import attrs
import trio

from trio_rollouts.inference._models import ServedModels
from trio_rollouts.inference._placement import Placement
from trio_rollouts.inference.http._transport import Transport
from trio_rollouts.inference.openai._control import PauseState
from trio_rollouts.inference.openai._probe import ProbeRun
from trio_rollouts.inference.openai._statistics import Counts

__all__ = ["CLOSE_GRACE", "RunState"]

logger = logging.getLogger(__name__)

#: How long closing the transport at the end of a run may take before it is abandoned.
CLOSE_GRACE: Final = 5.0


@attrs.define(eq=False)
class RunState:
    """What one Trio run holds for one interface; its counts are added to ``totals`` when
    the run ends (or the transport is closed). One Trio run; not thread-safe."""

    transport: Transport
    in_flight: list[int]  # requests placed and not answered, per replica: the load
    attempts: list[int]
    choices: list[int]
    placement: Placement
    pause: PauseState
    totals: Counts
    counts: Counts
    models: ServedModels = attrs.field(factory=ServedModels)
    probes: ProbeRun = attrs.field(factory=ProbeRun)
    #: The system task's scope, when the state is implicit (else ``None``).
    keeper_scope: trio.CancelScope | None = None
    #: The ``async with`` blocks that hold the state open (0: implicit).
    owners: int = 0
    closed: trio.Event = attrs.field(factory=trio.Event)
    added: bool = False

    def add_to_totals(self) -> None:
        if not self.added:
            self.added = True
            self.totals.add(self.attempts, self.choices, self.counts)

    def keep_until_run_exit(self, name: str) -> None:
        """Hand the transport to a system task that closes it when the run ends."""
        self.keeper_scope = scope = trio.CancelScope()
        trio.lowlevel.spawn_system_task(self._close_at_run_exit, scope, name=name)

    async def close(self) -> None:
        """Add the counts to the totals and close the transport: through the system task
        that keeps it, if any, else here. Cancellation: the close runs shielded, bounded
        by :data:`CLOSE_GRACE`, and completes even if this is cancelled."""
        self.add_to_totals()
        if self.keeper_scope is not None:
            self.keeper_scope.cancel()
            await self.closed.wait()
            return
        await self._close_transport()

    async def _close_at_run_exit(self, scope: trio.CancelScope) -> None:
        """System task: keeps the transport open until aclose() or the end of the run."""
        try:
            with scope:
                await trio.sleep_forever()
        finally:
            self.add_to_totals()
            await self._close_transport()

    async def _close_transport(self) -> None:
        # Trio cancels system tasks once the main task has returned; the shield lets the
        # sockets close anyway, and the grace bound keeps a stuck close from hanging exit.
        with trio.move_on_after(CLOSE_GRACE, shield=True):
            try:
                await self.transport.aclose()
            except Exception:
                # An exception escaping a system task would crash the whole run.
                logger.warning("closing the inference HTTP transport failed", exc_info=True)
        self.closed.set()
