"""Example environments: agents with verifiable rewards that run on any inference interface.

:class:`ArithmeticEnvironment` (arithmetic problems, reward 1.0 for the right number) is
the environment of ``trio-rollouts demo``, and :class:`AnswerTablePolicy` the policy
that learns it on the embedded backend; it is a :class:`RewardOnlyAgent`, the base for
environments that sample completions of one prompt per group and score them. The
preference environments pair completions for DPO-style training
(:class:`BestWorstContrastiveGenerator`) and compare several interfaces on the same
prompts (:class:`HeadToHeadRolloutGenerator`). :class:`CalculatorEnvironment` is a
multi-turn environment (for :class:`~trio_rollouts.MultiTurnAgent`) with a
``calculator`` tool, and :class:`ToolUsePolicy` the policy of ``trio-rollouts demo --task
tool`` that learns to call it.
"""

from trio_rollouts.agents._reward_only import REWARD_FUNCTIONS as REWARD_FUNCTIONS
from trio_rollouts.agents._reward_only import RewardOnlyAgent as RewardOnlyAgent
from trio_rollouts.agents._reward_only import build_rollouts as build_rollouts
from trio_rollouts.agents._reward_only import contains_reward as contains_reward
from trio_rollouts.agents._reward_only import exact_match_reward as exact_match_reward
from trio_rollouts.agents._reward_only import last_number_reward as last_number_reward
from trio_rollouts.envs._answer_table import AnswerTablePolicy as AnswerTablePolicy
from trio_rollouts.envs._preference import (
    BestWorstContrastiveGenerator as BestWorstContrastiveGenerator,
)
from trio_rollouts.envs._preference import HeadToHeadResult as HeadToHeadResult
from trio_rollouts.envs._preference import HeadToHeadRolloutGenerator as HeadToHeadRolloutGenerator
from trio_rollouts.envs.arithmetic import ArithmeticEnvironment as ArithmeticEnvironment
from trio_rollouts.envs.arithmetic import make_problems as make_problems
from trio_rollouts.envs.calculator import CALCULATOR_TOOL as CALCULATOR_TOOL
from trio_rollouts.envs.calculator import CalculatorEnvironment as CalculatorEnvironment
from trio_rollouts.envs.calculator import CalculatorError as CalculatorError
from trio_rollouts.envs.calculator import ToolUsePolicy as ToolUsePolicy
from trio_rollouts.envs.calculator import calculate as calculate
