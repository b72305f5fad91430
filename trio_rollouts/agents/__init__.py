"""Agents: the classes users subclass to produce rollouts, groups and evaluations.

Every agent is an attrs class; users subclass with ``@attrs.define`` and add fields. One
concern a module:

- ``_base``: the agent family (:class:`Agent`, :class:`RolloutGenerator`,
  :class:`TokenizedRolloutGenerator`, :class:`ContrastiveRolloutGenerator`,
  :class:`EvaluationAgent`, :class:`GroupedRolloutGenerator`, whose
  ``get_grouped_rollouts`` opens the pipeline);
- ``_environment``: what a multi-turn episode talks to (:class:`Environment`,
  :class:`BaseEnvironment`, :class:`EnvironmentStep`);
- ``_multitask``: weighted multi-task mixing (:class:`WeightedTask`,
  :class:`WeightedMultiTask`, :class:`MultiTaskEvaluationResponse`);
- ``_evaluation``: :func:`pass_at_k`, sharding prompts across ranks
  (:func:`shard_indices`), merging the ranks' responses
  (:func:`merge_evaluation_responses`) and the pass@k agent
  (:class:`PassAtKEvaluationAgent`);
- ``_reward_only``: :class:`RewardOnlyAgent`, one prompt per group with a verifiable
  reward, and the reward functions it can be given by name (:data:`REWARD_FUNCTIONS`);
- ``_rewards``: reward code in worker processes (:func:`run_reward`, its pool and
  :func:`current_reward_limiter`).
"""

from trio_rollouts.agents._base import Agent as Agent
from trio_rollouts.agents._base import ContrastiveRolloutGenerator as ContrastiveRolloutGenerator
from trio_rollouts.agents._base import EvaluationAgent as EvaluationAgent
from trio_rollouts.agents._base import GroupedRolloutGenerator as GroupedRolloutGenerator
from trio_rollouts.agents._base import RolloutGenerator as RolloutGenerator
from trio_rollouts.agents._base import TokenizedRolloutGenerator as TokenizedRolloutGenerator
from trio_rollouts.agents._environment import BaseEnvironment as BaseEnvironment
from trio_rollouts.agents._environment import Environment as Environment
from trio_rollouts.agents._environment import EnvironmentStep as EnvironmentStep
from trio_rollouts.agents._evaluation import PassAtKEvaluationAgent as PassAtKEvaluationAgent
from trio_rollouts.agents._evaluation import PassAtKEvaluationResponse as PassAtKEvaluationResponse
from trio_rollouts.agents._evaluation import PassAtKResult as PassAtKResult
from trio_rollouts.agents._evaluation import (
    merge_evaluation_responses as merge_evaluation_responses,
)
from trio_rollouts.agents._evaluation import pass_at_k as pass_at_k
from trio_rollouts.agents._evaluation import shard_indices as shard_indices
from trio_rollouts.agents._multitask import (
    MultiTaskEvaluationResponse as MultiTaskEvaluationResponse,
)
from trio_rollouts.agents._multitask import WeightedMultiTask as WeightedMultiTask
from trio_rollouts.agents._multitask import WeightedTask as WeightedTask
from trio_rollouts.agents._reward_only import REWARD_FUNCTIONS as REWARD_FUNCTIONS
from trio_rollouts.agents._reward_only import RewardOnlyAgent as RewardOnlyAgent
from trio_rollouts.agents._reward_only import contains_reward as contains_reward
from trio_rollouts.agents._reward_only import exact_match_reward as exact_match_reward
from trio_rollouts.agents._reward_only import last_number_reward as last_number_reward
from trio_rollouts.agents._rewards import current_reward_limiter as current_reward_limiter
from trio_rollouts.agents._rewards import run_reward as run_reward

__all__ = [
    "REWARD_FUNCTIONS",
    "Agent",
    "BaseEnvironment",
    "ContrastiveRolloutGenerator",
    "Environment",
    "EnvironmentStep",
    "EvaluationAgent",
    "GroupedRolloutGenerator",
    "MultiTaskEvaluationResponse",
    "PassAtKEvaluationAgent",
    "PassAtKEvaluationResponse",
    "PassAtKResult",
    "RewardOnlyAgent",
    "RolloutGenerator",
    "TokenizedRolloutGenerator",
    "WeightedMultiTask",
    "WeightedTask",
    "contains_reward",
    "current_reward_limiter",
    "exact_match_reward",
    "last_number_reward",
    "merge_evaluation_responses",
    "pass_at_k",
    "run_reward",
    "shard_indices",
]
