"""Token-exact episodes: the token-stream element, :class:`MultiTurnAgent` on it, and the
core the gateway's sessions build on.

- :mod:`._element`: the shared core, the token-stream element (:class:`Element`) and its
  helpers: fidelity ranks, reading a turn's ids off a response, closing and bridging,
  breaks, the per-turn record, the rollout, the epoch a call started under;
- :mod:`._errors`: :class:`TemplateBreakError`, :class:`TokenFidelityError` and the
  messages they share;
- :mod:`._checks`: the checks of the settings the agent and the gateway share;
- :mod:`._agent`: :class:`MultiTurnAgent` (its settings, the problem draw, a group);
- :mod:`._episode`: one episode, the environment-stepping loop;
- :mod:`._first_turns`: the first turns of a group's episodes as one group call.

The public names of the library (``trio_rollouts.MultiTurnAgent``,
``trio_rollouts.TemplateBreakError``, ``trio_rollouts.TokenFidelityError``) are
re-exported here, with the core the gateway imports.
"""

from trio_rollouts.episodes._agent import DEFAULT_MAX_EPISODE_TOKENS as DEFAULT_MAX_EPISODE_TOKENS
from trio_rollouts.episodes._agent import DEFAULT_STEP_TIMEOUT as DEFAULT_STEP_TIMEOUT
from trio_rollouts.episodes._agent import MultiTurnAgent as MultiTurnAgent
from trio_rollouts.episodes._checks import check_min_fidelity as check_min_fidelity
from trio_rollouts.episodes._checks import check_on_break as check_on_break
from trio_rollouts.episodes._checks import check_renderer as check_renderer
from trio_rollouts.episodes._checks import check_vocabulary as check_vocabulary
from trio_rollouts.episodes._element import RANK as RANK
from trio_rollouts.episodes._element import Element as Element
from trio_rollouts.episodes._element import backend_fidelity as backend_fidelity
from trio_rollouts.episodes._element import bridge_ids as bridge_ids
from trio_rollouts.episodes._element import call_start_epoch_or as call_start_epoch_or
from trio_rollouts.episodes._element import close_ids as close_ids
from trio_rollouts.episodes._element import numbered as numbered
from trio_rollouts.episodes._element import read_turn as read_turn
from trio_rollouts.episodes._element import request_start_epoch as request_start_epoch
from trio_rollouts.episodes._element import start_element as start_element
from trio_rollouts.episodes._element import takes_messages as takes_messages
from trio_rollouts.episodes._element import token_rollout as token_rollout
from trio_rollouts.episodes._element import turn_record as turn_record
from trio_rollouts.episodes._episode import ACLOSE_SECONDS as ACLOSE_SECONDS
from trio_rollouts.episodes._errors import TemplateBreakError as TemplateBreakError
from trio_rollouts.episodes._errors import TokenFidelityError as TokenFidelityError
from trio_rollouts.episodes._errors import fidelity_error as fidelity_error
from trio_rollouts.episodes._errors import what_lacked as what_lacked
