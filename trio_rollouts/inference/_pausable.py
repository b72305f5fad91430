"""The contract between a weight update and the inference backends it pauses.

A trainer that generates while it trains pushes new weights at each optimizer step. The
stream's ``weight_update(mode)`` stops generation, lets the body push the weights, and
resumes under the new *policy epoch*. Backends that can pause implement
:class:`Pausable`; the four modes (see ``docs/weight-updates.md``):

- ``"drain"``: calls in flight finish under the old weights; nothing is asked of the
  backend but to hold new requests (``pause`` is called once no call is in flight).
- ``"restart"``: calls in flight are cancelled by the pipeline and generated again after
  the update; as for drain, ``pause`` is called once no call is in flight.
- ``"keep"``: the backend holds calls in flight (their KV cache kept) and continues them
  under the new weights after ``resume``.
- ``"abort"``: the backend stops calls in flight, keeps their partial output, and after
  ``resume`` continues each from that output; the caller sees one call.
"""

from __future__ import annotations

import abc
from typing import Final, Literal

__all__ = ["WEIGHT_UPDATE_MODES", "Pausable", "WeightUpdateError", "WeightUpdateMode"]

#: How a weight update treats the calls in flight.
WeightUpdateMode = Literal["drain", "restart", "keep", "abort"]

#: Every mode, in the order of what they keep of calls in flight (least work lost last).
WEIGHT_UPDATE_MODES: Final[tuple[WeightUpdateMode, ...]] = ("restart", "abort", "keep", "drain")


class WeightUpdateError(RuntimeError):
    """Pausing the backends for a weight update failed. Every backend whose ``pause`` was
    called has been resumed under the old epoch; the pause's error is the ``__cause__``
    (failures to resume are added as notes)."""


class Pausable(abc.ABC):
    """An inference backend that a weight update can pause and resume.

    Implementations hold requests that arrive while paused until :meth:`resume`, and stamp
    the policy epoch into what they return (``InferenceResponse.policy_epoch``).
    """

    @property
    @abc.abstractmethod
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """The modes this backend can pause for (``drain`` and ``restart`` need only that
        it holds new requests)."""

    @property
    @abc.abstractmethod
    def policy_epoch(self) -> int:
        """The epoch generation runs under now (the last one given to :meth:`resume`)."""

    @property
    @abc.abstractmethod
    def stamps_policy_epoch(self) -> bool:
        """Whether a response records the token at which its epoch changed
        (``policy_epoch`` boundaries); when ``False``, a call that spans an update is
        stamped with the epoch it started under only."""

    @abc.abstractmethod
    async def pause(self, mode: WeightUpdateMode) -> None:
        """Stop generating as ``mode`` says; return once no token is being generated.

        Requests that arrive while paused are held until :meth:`resume`. Raises
        ``TypeError`` for a mode outside :attr:`supported_modes`.

        Cancellation: cancelling a pause leaves the backend in an unknown state; callers
        follow a cancelled or failed pause with :meth:`resume` under the old epoch.
        """

    @abc.abstractmethod
    async def resume(self, epoch: int) -> None:
        """Generate under ``epoch`` from now on, and release what the pause held.
        Idempotent when not paused (it only sets the epoch).

        Cancellation: callers run it shielded; an implementation must not leave the
        backend paused if it is cancelled anyway.
        """
