"""What a ``group_rollout`` call returned, checked and made into its slot's
:class:`~trio_rollouts.RolloutGroup`; and the watch for groups whose rewards are all the
same.

Nothing here awaits or keeps books: :mod:`._attempts` calls these and books what they
raise as a broken contract (never retried or skipped).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from trio_rollouts._context import Draw
from trio_rollouts.models._rollouts import Cut, Rollout, RolloutGroup, TokenRollout, checked_group

__all__ = [
    "FILTER_STD_THRESHOLD",
    "SAME_REWARD_WARNING_AFTER",
    "RewardWatch",
    "check_draws",
    "make_group",
]

#: A group whose rewards have a population std at or below this is "all the same".
FILTER_STD_THRESHOLD = 1e-6
#: After this many groups in a row, from the start, whose rewards were all the same
#: within each group, the pipeline warns: every GRPO advantage is 0.
SAME_REWARD_WARNING_AFTER = 32
_ROLLOUT_TYPES = frozenset({Rollout, TokenRollout})


def make_group(
    result: object,
    where: str,
    slot: tuple[int, int],
    start_epoch: int,
    cuts: tuple[Cut, ...],
    *,
    finite_rewards: bool,
) -> RolloutGroup:
    """Check what ``group_rollout`` returned (``where`` names the call in errors) and wrap
    it in ``slot``'s group. ``finite_rewards``: every rollout needs a finite reward (the
    group is filtered by reward)."""
    rollouts = result.rollouts if isinstance(result, RolloutGroup) else result
    if type(rollouts) is not list:
        if not isinstance(rollouts, Sequence) or isinstance(rollouts, (str, bytes)):
            msg = f"{where} must return a list of rollouts, got {result!r:.80}"
            raise TypeError(msg)
        rollouts = list(rollouts)
    if not rollouts:
        msg = f"{where} returned an empty group; a group needs at least one rollout"
        raise ValueError(msg)
    for i, rollout in enumerate(rollouts):
        if type(rollout) not in _ROLLOUT_TYPES and not isinstance(rollout, (Rollout, TokenRollout)):
            msg = (
                f"{where} returned a group whose item {i} is a {type(rollout).__name__}, not "
                "a Rollout or TokenRollout"
            )
            raise TypeError(msg)
        if finite_rewards:
            reward = rollout.reward if isinstance(rollout, Rollout) else rollout.scalar_reward
            if reward is None or not math.isfinite(reward):
                msg = (
                    f"{where}: rollout {i} has reward {reward!r} (env_id={rollout.env_id!r}, "
                    f"problem_id={rollout.problem_id!r}); filtering groups by reward needs "
                    "finite float rewards"
                )
                raise ValueError(msg)
    return checked_group(rollouts, slot[0], slot[1], start_epoch, cuts)


def check_draws(group: RolloutGroup, draws: list[Draw], where: str, *, required: bool) -> None:
    """A call draws one prompt (``required``: the agent has a prompt source), and its
    rollouts are about that problem."""
    if len(draws) > 1:
        ids = ", ".join(repr(draw.problem_id) for draw in draws)
        msg = (
            f"{where} drew {len(draws)} prompts ({ids}); a call must draw exactly one "
            "(self.prompts.draw() once per group)"
        )
        raise ValueError(msg)
    if not draws:
        if required:
            msg = (
                f"{where} drew no prompt from its prompts source; a call must draw exactly "
                "one (self.prompts.draw() once per group)"
            )
            raise ValueError(msg)
        return
    problem_id = draws[0].problem_id
    for i, rollout in enumerate(group):
        if rollout.problem_id is not None and rollout.problem_id != problem_id:
            msg = (
                f"{where} drew problem {problem_id!r}, but its rollout {i} has "
                f"problem_id={rollout.problem_id!r}"
            )
            raise ValueError(msg)


class RewardWatch:
    """Warns early when the groups from the start all have one reward each: every
    advantage is 0 and training learns nothing (a reward function that cannot be met, or
    a policy that cannot meet it). Looks at the first groups only."""

    def __init__(self, rollouts_per_group: int) -> None:
        # Groups from the start whose rewards were all the same; -1 once a group with
        # different rewards was seen, or the warning was given.
        self.same = 0 if rollouts_per_group > 1 else -1

    def seen(self, group: RolloutGroup) -> None:
        """A group was taken or filtered."""
        if self.same < 0:
            return
        rewards = [r.reward if isinstance(r, Rollout) else r.scalar_reward for r in group.rollouts]
        if any(reward is None for reward in rewards):
            self.same = -1  # no rewards to judge
            return
        low, high = min(rewards), max(rewards)  # type: ignore[type-var]
        if high - low > FILTER_STD_THRESHOLD:  # type: ignore[operator]
            self.same = -1
            return
        self.same += 1
        if self.same >= SAME_REWARD_WARNING_AFTER:
            self.same = -1
            first = group.rollouts[0]
            msg = (
                f"the first {SAME_REWARD_WARNING_AFTER} groups each had one reward for all "
                f"their rollouts (the last: {low!r}, env_id={first.env_id!r}): every GRPO "
                "advantage is 0 and a trainer learns nothing from them. Check the reward "
                "function against the completions; EmbeddedInference's default policy "
                "(HashedPromptPolicy) answers 'The answer is A.' and the like, which no "
                "task's reward accepts: use a policy that can answer "
                "(trio_rollouts.envs.AnswerTablePolicy for ArithmeticEnvironment) or a "
                "real model"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
