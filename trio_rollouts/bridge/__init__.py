"""The sync bridge: a rollout stream driven from synchronous code (PyTorch-style trainers).

One concern a module:

- ``_thread``: Trio in a background thread (:class:`TrioThread`): starting and stopping
  the run, calling into it from other threads, failures raised as themselves, and
  async context managers held open while their body runs in another thread (the sync
  weight update). The Ray actors use it too;
- ``_blocking``: the blocking streams: :func:`blocking_grouped_rollouts` and
  :class:`BlockingRolloutStream` (``take``, ``drain``, iteration, ``weight_update`` as a
  plain ``with``), one round trip into the Trio thread per call, over any stream's
  source (the local pipeline or the Ray merge).
"""

from trio_rollouts.bridge._blocking import BlockingRolloutStream as BlockingRolloutStream
from trio_rollouts.bridge._blocking import blocking_grouped_rollouts as blocking_grouped_rollouts
from trio_rollouts.bridge._thread import TrioThread as TrioThread
from trio_rollouts.bridge._thread import TrioThreadStopped as TrioThreadStopped

__all__ = [
    "BlockingRolloutStream",
    "TrioThread",
    "TrioThreadStopped",
    "blocking_grouped_rollouts",
]
