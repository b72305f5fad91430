"""Prompts: where a run's problems come from, and what settles each draw exactly once.

One concern a module:

- ``_source``: :class:`PromptSource`, a checkpointable source that hands out every
  problem of every epoch exactly once (``state_dict``/``load_state_dict``), safe to call
  from the trainer's thread while the pipeline runs;
- ``_draws``: the book that settles a call's draws once, *done* (taken or filtered) or
  *given back* (drawn again first): what the pipeline, the sync bridge and Ray call;
- ``_file``: the command line's files: prompt files in (:func:`load_problems`,
  :class:`PromptFileError`), rollout groups out (:func:`write_groups`), and the scan
  that resumes a job from its output.
"""

from trio_rollouts.prompts._file import PromptFileError as PromptFileError
from trio_rollouts.prompts._file import load_problems as load_problems
from trio_rollouts.prompts._file import write_groups as write_groups
from trio_rollouts.prompts._source import PromptSource as PromptSource

__all__ = ["PromptFileError", "PromptSource", "load_problems", "write_groups"]
