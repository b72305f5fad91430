"""Scale out on Ray: rollout actors and one merged stream (needs the ``ray`` extra).

``open_ray_rollouts`` (Trio) and ``blocking_ray_rollouts`` (synchronous code) run an agent's
grouped pipeline in several Ray actors and hand the consumer one stream: a
:class:`~trio_rollouts.RolloutStream` over the merge of the actors' groups. See
docs/scaling.md; the merge's invariants are numbered in ``trio_rollouts/ray/_merge.py``.

The modules:
- ``_actor.py``: :class:`RolloutActor`, one agent's pipeline in a Ray actor, in a Trio
  thread of its own (the sync bridge's :class:`~trio_rollouts.bridge._thread.TrioThread`).
- ``_lanes.py``: one actor as the merge sees it (its lane), and the merged counters,
  :class:`RayRolloutStreamStatistics`.
- ``_actors.py``: the actors' life (create, start, stop, kill) and the questions asked of
  all of them (counters, prompt states).
- ``_merge.py``: the merge, the :class:`~trio_rollouts.pipeline._stream.GroupSource` of
  the Ray stream: feeders, watchers, round-robin, staleness, settling prompts; its
  docstring numbers the invariants.
- ``_update.py``: weight updates across the actors, and the stream's policy epoch.
- ``_stream.py``: :class:`RayRolloutStream`, the stream with Ray's extras.
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
from trio_rollouts.ray._lanes import RayRolloutStreamStatistics as RayRolloutStreamStatistics
from trio_rollouts.ray._open import BlockingRayRolloutStream as BlockingRayRolloutStream
from trio_rollouts.ray._open import blocking_ray_rollouts as blocking_ray_rollouts
from trio_rollouts.ray._open import open_ray_rollouts as open_ray_rollouts
from trio_rollouts.ray._stream import RayRolloutStream as RayRolloutStream

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
