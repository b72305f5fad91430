"""Benchmark: structuring and unstructuring TokenRollouts, trio_rollouts vs pydantic v2.

The workload is what a trainer reads back from a rollout log: 64 TokenRollouts, each with
one trajectory element of 1,024 token ids, a generation mask of 1,024 booleans (the first
256 are prompt tokens, ``False``) and one log-probability per generated token, decoded
with ``json.loads``. Both libraries validate strictly: pydantic models shaped like the
origin's (``ConfigDict(strict=True, extra="allow")``), with the ``(start, epoch)`` pairs
accepted as JSON lists. We time ``structure``/``unstructure`` against pydantic's
``validate_python``/``dump_python`` for a plain list of rollouts and for a RolloutGroup
(where each rollout goes through the ``Rollout | TokenRollout`` union), best of N repeats.
Note that ``structure`` takes well-formed lists of primitives over without copying them
(see its docstring), where pydantic copies; copying would cost us about 15%.

Run: ``python benchmarks/models.py [--repeat N]`` (pydantic is a benchmark-only dependency).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import timeit
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter

from trio_rollouts import RolloutGroup, TokenRollout
from trio_rollouts.models._convert import structure, unstructure

ROLLOUTS = 64
TOKENS = 1024
PROMPT_TOKENS = 256

# --------------------------------------------------------------------------- pydantic side

# Strict mode refuses lists for tuples; JSON has no tuples, so the pairs alone are lax
# (their ints stay strict).
_EpochPair = Annotated[tuple[StrictInt, StrictInt], Field(strict=False)]


class PydRollout(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    trajectory: list[str]
    prompt_length: list[int] | None = None
    reward: float | None = None
    env_id: str = ""
    problem_id: str | None = None
    policy_epoch: list[list[_EpochPair]] = []
    kv_cache_epoch: list[list[_EpochPair]] = []
    num_evictions: list[int] = []


class PydTokenRollout(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    trajectory: list[list[int]]
    reward: list[float] | float
    generation_mask: list[list[bool]] | None = None
    logprobs: list[list[float]] | None = None
    env_id: str = ""
    problem_id: str | None = None
    policy_epoch: list[list[_EpochPair]] = []
    kv_cache_epoch: list[list[_EpochPair]] = []
    num_evictions: list[int] = []


class PydRolloutGroup(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    rollouts: list[PydTokenRollout | PydRollout]
    batch_id: int = 0
    index_in_batch: int = 0


# --------------------------------------------------------------------------- data


def make_rollout(rng: random.Random, i: int) -> TokenRollout:
    generated = TOKENS - PROMPT_TOKENS
    return TokenRollout(
        trajectory=[[rng.randrange(2, 150_000) for _ in range(TOKENS)]],
        reward=rng.random(),
        generation_mask=[[False] * PROMPT_TOKENS + [True] * generated],
        logprobs=[[-rng.random() * 5 for _ in range(generated)]],
        env_id="math",
        problem_id=f"problem-{i}",
        policy_epoch=[[(0, 3), (700, 4)]],
        kv_cache_epoch=[[(0, 3)]],
        num_evictions=[0],
        extra={"sampler": "v2"},
    )


def best_of_interleaved(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeat: int, number: int
) -> tuple[float, float]:
    """Best time of one call of each, in milliseconds.

    Time is this process's CPU time, and the two alternate: other load on the machine
    neither inflates the numbers nor biases the ratio (both are single-threaded).
    """
    best_ours = best_theirs = float("inf")
    for _ in range(repeat):
        timer_ours = timeit.Timer(ours, timer=time.process_time)
        timer_theirs = timeit.Timer(theirs, timer=time.process_time)
        best_ours = min(best_ours, timer_ours.timeit(number=number))
        best_theirs = min(best_theirs, timer_theirs.timeit(number=number))
    return best_ours / number * 1e3, best_theirs / number * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="repeats (best is kept)")
    parser.add_argument("--number", type=int, default=5, help="calls per repeat")
    args = parser.parse_args()

    rng = random.Random(0)
    rollouts = [make_rollout(rng, i) for i in range(ROLLOUTS)]
    group = RolloutGroup(rollouts=list(rollouts), batch_id=1)
    rollouts_data = json.loads(json.dumps(unstructure(rollouts)))
    group_data = json.loads(json.dumps(unstructure(group)))

    pyd_rollouts = TypeAdapter(list[PydTokenRollout])
    pyd_group = TypeAdapter(PydRolloutGroup)

    # Both sides must accept the same data and give the same data back.
    ours = structure(rollouts_data, list[TokenRollout])
    theirs = pyd_rollouts.validate_python(rollouts_data)
    ours_group = structure(group_data, RolloutGroup)
    theirs_group = pyd_group.validate_python(group_data)
    if ours != rollouts or ours_group != group:
        raise SystemExit("trio_rollouts round trip changed the data")
    if json.loads(json.dumps(unstructure(ours))) != rollouts_data:
        raise SystemExit("trio_rollouts unstructure does not reproduce the data")
    if json.loads(json.dumps(pyd_rollouts.dump_python(theirs))) != rollouts_data:
        raise SystemExit("pydantic dump does not reproduce the data")

    cases = [
        (
            f"{ROLLOUTS} TokenRollouts",
            lambda: structure(rollouts_data, list[TokenRollout]),
            lambda: pyd_rollouts.validate_python(rollouts_data),
            lambda: unstructure(ours),
            lambda: pyd_rollouts.dump_python(theirs),
        ),
        (
            f"RolloutGroup of {ROLLOUTS}",
            lambda: structure(group_data, RolloutGroup),
            lambda: pyd_group.validate_python(group_data),
            lambda: unstructure(ours_group),
            lambda: pyd_group.dump_python(theirs_group),
        ),
    ]
    print(
        f"{ROLLOUTS} rollouts x {TOKENS} tokens, best of {args.repeat} x {args.number} calls, "
        f"CPU ms per call; ratio = pydantic / ours (>= 1.0: we are at least as fast)"
    )
    header = f"{'workload':<24}{'op':<13}{'ours':>9}{'pydantic':>10}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, s_ours, s_pyd, u_ours, u_pyd in cases:
        for op, fn_ours, fn_pyd in (("structure", s_ours, s_pyd), ("unstructure", u_ours, u_pyd)):
            t_ours, t_pyd = best_of_interleaved(fn_ours, fn_pyd, args.repeat, args.number)
            print(f"{name:<24}{op:<13}{t_ours:>9.2f}{t_pyd:>10.2f}{t_pyd / t_ours:>8.2f}")


if __name__ == "__main__":
    main()
