"""Test doubles for testing your own agents and trainers, as :mod:`trio.testing` is for
Trio code: a scripted agent, null inference backends, a scripted Pausable backend, and a
token-in backend over a real tokenizer's vocabulary. See ``docs/testing.md``.
"""

from trio_rollouts._testing import GroupScript as GroupScript
from trio_rollouts._testing import NullChatInference as NullChatInference
from trio_rollouts._testing import NullInference as NullInference
from trio_rollouts._testing import ScriptedAgent as ScriptedAgent
from trio_rollouts._testing import ScriptedPausable as ScriptedPausable
from trio_rollouts._testing import VocabularyInference as VocabularyInference
from trio_rollouts._testing import rollouts as rollouts

__all__ = [
    "GroupScript",
    "NullChatInference",
    "NullInference",
    "ScriptedAgent",
    "ScriptedPausable",
    "VocabularyInference",
    "rollouts",
]
