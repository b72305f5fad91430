"""Adapters between this library and other RL frameworks' environments, each an optional
extra, imported by its own module (so ``import trio_rollouts`` never imports them):

- :mod:`trio_rollouts.integrations.tinker` (extra ``[tinker]``, tinker-cookbook):
  :func:`~trio_rollouts.integrations.tinker.from_message_env` runs a ``MessageEnv`` as
  the :class:`~trio_rollouts.Environment` of a :class:`~trio_rollouts.MultiTurnAgent`,
  and :class:`~trio_rollouts.integrations.tinker.EnvAgent` runs a token-level ``Env`` on
  a backend that generates from token ids.
- :mod:`trio_rollouts.integrations.verifiers` (extra ``[verifiers]``):
  :class:`~trio_rollouts.integrations.verifiers.VerifiersAgent` runs a verifiers
  environment unmodified, each member through a gateway session, scored by its rubric
  as a group.
- :mod:`trio_rollouts.integrations.trl` (extra ``[trl]``): a ``rollout_func`` for TRL's
  ``GRPOTrainer`` and a ``RolloutWorker`` for its ``AsyncGRPOTrainer``, fed by a
  streaming pipeline within the staleness bound.
"""
