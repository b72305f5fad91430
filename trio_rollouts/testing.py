"""Test doubles for testing your own agents and trainers, as :mod:`trio.testing` is for
Trio code: a scripted agent, null inference backends and a scripted Pausable backend.
See ``docs/testing.md``.
"""

from ._testing import GroupScript as GroupScript
from ._testing import NullChatInference as NullChatInference
from ._testing import NullInference as NullInference
from ._testing import ScriptedAgent as ScriptedAgent
from ._testing import ScriptedPausable as ScriptedPausable
from ._testing import rollouts as rollouts

__all__ = [
    "GroupScript",
    "NullChatInference",
    "NullInference",
    "ScriptedAgent",
    "ScriptedPausable",
    "rollouts",
]
