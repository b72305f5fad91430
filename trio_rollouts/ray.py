"""Scale out on Ray: rollout actors and one merged stream (needs the ``ray`` extra).

``open_ray_rollouts`` (Trio) and ``blocking_ray_rollouts`` (synchronous code) run an agent's
grouped pipeline in several Ray actors and hand the consumer one stream with the surface
of :class:`~trio_rollouts.RolloutStream`. See docs/scaling.md; the implementation and its
invariants are in ``trio_rollouts/_ray/_merge.py``.
"""

from ._ray import BlockingRayRolloutStream as BlockingRayRolloutStream
from ._ray import RayRolloutStream as RayRolloutStream
from ._ray import RayRolloutStreamStatistics as RayRolloutStreamStatistics
from ._ray import RolloutActor as RolloutActor
from ._ray import RolloutActorDiedError as RolloutActorDiedError
from ._ray import RolloutActorError as RolloutActorError
from ._ray import RolloutActorInfo as RolloutActorInfo
from ._ray import RolloutActorReply as RolloutActorReply
from ._ray import blocking_ray_rollouts as blocking_ray_rollouts
from ._ray import open_ray_rollouts as open_ray_rollouts

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
