"""The data model: attrs records, checked where they are made, and their cattrs conversion.

Every model is an attrs class with keyword-only fields; a constructor (or
:func:`structure`, which goes through it) raises ``TypeError``/``ValueError`` naming the
field, the value and what is allowed. Records that cross process boundaries keep the
keys they do not know in ``extra``, so a structure -> unstructure round trip is lossless.

One concern a module:

- ``_requests``: what a trainer asks an agent for (:class:`Request`,
  :class:`RolloutRequest`, :class:`GroupedRolloutRequest`,
  :class:`Head2HeadRolloutRequest`, :class:`EvaluationRequest`);
- ``_rollouts``: what the pipeline delivers (:class:`Rollout`, :class:`TokenRollout`,
  :class:`SamplingSpan`, :class:`RolloutGroup` and its :class:`Cut` members,
  :class:`ContrastiveRollout`);
- ``_evaluation``: :class:`EvaluationResult`, :class:`RewardEvaluationResult` and the
  registered :class:`EvaluationResponse` subclasses;
- ``_problems``: :class:`Problem`, what a prompt source draws;
- ``_training``: :class:`TrainingBatch`, delivered groups as padded numpy arrays;
- ``_convert/``: the one cattrs converter (:func:`structure`, :func:`unstructure`,
  :class:`ValidationError`) and JSON lines (:func:`dump_jsonl`, :func:`load_jsonl`).

:class:`ChatMessage`, :class:`GenerationArgs` and the ``Record`` base are re-exported
from ``trio_rollouts._messages``, the ground floor below both this package and
``inference/``: the requests here hold an inference interface, so ``models/`` is above
the inference contract, whose requests and responses are made of messages.
"""

from trio_rollouts._messages import ChatMessage as ChatMessage
from trio_rollouts._messages import GenerationArgs as GenerationArgs
from trio_rollouts._messages import LLMChatMessage as LLMChatMessage
from trio_rollouts.models._convert import ValidationError as ValidationError
from trio_rollouts.models._convert import dump_jsonl as dump_jsonl
from trio_rollouts.models._convert import load_jsonl as load_jsonl
from trio_rollouts.models._convert import structure as structure
from trio_rollouts.models._convert import unstructure as unstructure
from trio_rollouts.models._evaluation import EvaluationResponse as EvaluationResponse
from trio_rollouts.models._evaluation import EvaluationResult as EvaluationResult
from trio_rollouts.models._evaluation import RewardEvaluationResult as RewardEvaluationResult
from trio_rollouts.models._problems import Problem as Problem
from trio_rollouts.models._problems import ProblemLike as ProblemLike
from trio_rollouts.models._requests import EvaluationRequest as EvaluationRequest
from trio_rollouts.models._requests import GroupedRolloutRequest as GroupedRolloutRequest
from trio_rollouts.models._requests import Head2HeadRolloutRequest as Head2HeadRolloutRequest
from trio_rollouts.models._requests import Request as Request
from trio_rollouts.models._requests import RolloutRequest as RolloutRequest
from trio_rollouts.models._rollouts import ContrastiveRollout as ContrastiveRollout
from trio_rollouts.models._rollouts import Cut as Cut
from trio_rollouts.models._rollouts import Rollout as Rollout
from trio_rollouts.models._rollouts import RolloutGroup as RolloutGroup
from trio_rollouts.models._rollouts import SamplingSpan as SamplingSpan
from trio_rollouts.models._rollouts import TokenRollout as TokenRollout
from trio_rollouts.models._training import TrainingBatch as TrainingBatch

__all__ = [
    "ChatMessage",
    "ContrastiveRollout",
    "Cut",
    "EvaluationRequest",
    "EvaluationResponse",
    "EvaluationResult",
    "GenerationArgs",
    "GroupedRolloutRequest",
    "Head2HeadRolloutRequest",
    "LLMChatMessage",
    "Problem",
    "ProblemLike",
    "Request",
    "RewardEvaluationResult",
    "Rollout",
    "RolloutGroup",
    "RolloutRequest",
    "SamplingSpan",
    "TokenRollout",
    "TrainingBatch",
    "ValidationError",
    "dump_jsonl",
    "load_jsonl",
    "structure",
    "unstructure",
]
