"""The errors a Ray stream's consumer sees for an actor that failed other than by an
exception of its agent (which is raised as itself)."""

from __future__ import annotations

from typing import Any

__all__ = ["RolloutActorDiedError", "RolloutActorError"]


class RolloutActorError(RuntimeError):
    """A rollout actor failed in a way that is not an exception of its agent.

    ``actor_index`` is the actor's index (0 .. num_actors - 1), ``actor_id`` Ray's id for it
    (hex), ``pid`` its process id when known.
    """

    def __init__(self, msg: str, *, actor_index: int, actor_id: str, pid: int | None) -> None:
        super().__init__(msg)
        self.actor_index = actor_index
        self.actor_id = actor_id
        self.pid = pid

    def __reduce__(self) -> tuple[Any, ...]:
        args = (type(self), str(self), self.actor_index, self.actor_id, self.pid)
        return (_rebuild_actor_error, args)


class RolloutActorDiedError(RolloutActorError):
    """A rollout actor's process died (killed, crashed, or its node was lost)."""


def _rebuild_actor_error(
    cls: type[RolloutActorError], msg: str, actor_index: int, actor_id: str, pid: int | None
) -> RolloutActorError:
    return cls(msg, actor_index=actor_index, actor_id=actor_id, pid=pid)
