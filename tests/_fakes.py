"""Setup shared by the pipeline tests; the test doubles themselves are the public ones
of :mod:`trio_rollouts.testing`."""

from __future__ import annotations

import attrs

import trio_rollouts as tr
from trio_rollouts.testing import NullInference, ScriptedPausable


@attrs.define(eq=False, kw_only=True)
class Backend(ScriptedPausable):
    """The scripted Pausable backend under the name the weight-update tests match in
    error messages (``pausing Backend ...``); a request takes 1 s unless told."""

    latency: float = 1.0


def request(
    *,
    num_groups: int = 1,
    rollouts_per_group: int = 2,
    streaming: bool = False,
    enforce_order: bool = False,
    filter_groups_with_same_reward: bool = False,
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=rollouts_per_group,
        inference_interface=NullInference(),
        streaming=streaming,
        enforce_order=enforce_order,
        filter_groups_with_same_reward=filter_groups_with_same_reward,
    )


@attrs.define(eq=False, kw_only=True)
class RawInterface(NullInference):
    """The null ``ReturnsRaw`` backend under the name the tests match in error messages
    (``RawInterface is not Pausable``)."""
