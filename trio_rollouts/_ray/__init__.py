"""Scaling out on Ray (needs the ``ray`` extra): rollout actors, each running a grouped
pipeline, merged into one stream.

- ``_actor.py``: :class:`RolloutActor`, one agent's pipeline in a Ray actor, in a Trio
  thread of its own (the sync bridge's :class:`~trio_rollouts._thread_runner.TrioThread`).
- ``_merge.py``: :class:`RayRolloutStream`, the actors' groups merged into one stream; its
  docstring numbers the merge's invariants.
- ``_open.py``: :func:`open_ray_rollouts` and :func:`blocking_ray_rollouts` (the sync
  twin, :class:`BlockingRayRolloutStream`), with the checks made before any actor starts.
- ``_errors.py``: the errors the consumer sees for an actor.

The public names are re-exported by ``trio_rollouts.ray``.
"""

try:
    import ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without ray
    msg = "trio_rollouts.ray needs Ray; install it with: pip install 'trio-rollouts[ray]'"
    raise ImportError(msg) from exc

from ._actor import RolloutActor as RolloutActor
from ._actor import RolloutActorInfo as RolloutActorInfo
from ._actor import RolloutActorReply as RolloutActorReply
from ._errors import RolloutActorDiedError as RolloutActorDiedError
from ._errors import RolloutActorError as RolloutActorError
from ._merge import RayRolloutStream as RayRolloutStream
from ._merge import RayRolloutStreamStatistics as RayRolloutStreamStatistics
from ._open import BlockingRayRolloutStream as BlockingRayRolloutStream
from ._open import blocking_ray_rollouts as blocking_ray_rollouts
from ._open import open_ray_rollouts as open_ray_rollouts

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
