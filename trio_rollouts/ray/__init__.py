"""Scale out on Ray: rollout actors and one merged stream (needs the ``ray`` extra).

``open_ray_rollouts`` (Trio) and ``blocking_ray_rollouts`` (synchronous code) run an agent's
grouped pipeline in several Ray actors and hand the consumer one stream with the surface
of :class:`~trio_rollouts.RolloutStream`. See docs/scaling.md; the implementation and its
invariants are in ``trio_rollouts/ray/_merge.py``.

The modules:
- ``_actor.py``: :class:`RolloutActor`, one agent's pipeline in a Ray actor, in a Trio
  thread of its own (the sync bridge's :class:`~trio_rollouts.bridge._thread.TrioThread`).
- ``_merge.py``: :class:`RayRolloutStream`, the actors' groups merged into one stream; its
  docstring numbers the merge's invariants.
- ``_open.py``: :func:`open_ray_rollouts` and :func:`blocking_ray_rollouts` (the sync
  twin, :class:`BlockingRayRolloutStream`), with the checks made before any actor starts.
- ``_errors.py``: the errors the consumer sees for an actor.

"""

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without ray
    msg = "trio_rollouts.ray needs Ray; install it with: pip install 'trio-rollouts[ray]'"
    raise ImportError(msg) from exc

from trio_rollouts.ray._actor import RolloutActor as RolloutActor
from trio_rollouts.ray._actor import RolloutActorInfo as RolloutActorInfo
from trio_rollouts.ray._actor import RolloutActorReply as RolloutActorReply
from trio_rollouts.ray._errors import RolloutActorDiedError as RolloutActorDiedError
from trio_rollouts.ray._errors import RolloutActorError as RolloutActorError
from trio_rollouts.ray._merge import RayRolloutStream as RayRolloutStream
from trio_rollouts.ray._merge import RayRolloutStreamStatistics as RayRolloutStreamStatistics
from trio_rollouts.ray._open import BlockingRayRolloutStream as BlockingRayRolloutStream
from trio_rollouts.ray._open import blocking_ray_rollouts as blocking_ray_rollouts
from trio_rollouts.ray._open import open_ray_rollouts as open_ray_rollouts

__all__ = [
    "BlockingRayRolloutStream",
    "RayRolloutStream",
    "RayRolloutStreamStatistics",
    "RolloutActor",
    "RolloutActorDiedError",
    "RolloutActorError",
    "RolloutActorInfo",
    "RolloutActorReply",
    "blocking_ray_rollouts",
    "open_ray_rollouts",
]

__all__ = [
    "BlockingRayRolloutStream",
    "RayRolloutStream",
    "RayRolloutStreamStatistics",
    "RolloutActor",
    "RolloutActorDiedError",
    "RolloutActorError",
    "RolloutActorInfo",
    "RolloutActorReply",
    "blocking_ray_rollouts",
    "open_ray_rollouts",
]
