"""Delivered groups to a trainer's arrays: the cost of ``TrainingBatch.from_groups``.

Usage: python benchmarks/training_batch.py [--quick] [--repeats N] [--rollouts N]

What is timed: the process's CPU time (``time.process_time``) of one
``TrainingBatch.from_groups(groups)`` call over ``--rollouts`` rollouts, groups of
``GROUP_SIZE``, built before timing; the figure is its median over ``--repeats`` repeats
(after one untimed call), per 1,000 rollouts, in milliseconds. The garbage collector is
off while timing.

The cases:

- ``single-turn``: one element per rollout, 1,024 ids of which the last 512 are
  generated (one run of mask 1, the shape ``RewardOnlyAgent`` makes), 512 logprobs,
  ``policy_epoch == [[(0, 0)]]``.
- ``episode``: a split multi-turn episode, two elements per rollout, each 2,048 ids: a
  256-id prompt, then 8 turns of 128 sampled ids (mask 1) each followed by a 96-id tool
  reply and bridge (mask 0), 1,024 logprobs per element, and an epoch boundary inside
  the second element (``[(0, 0), (1_500, 1)]``).
- ``single-turn, no logprobs``: as ``single-turn`` with ``logprobs=None``.

Beside each, two references timed the same way on the same groups:

- ``naive``: the loop one writes first, per element ``np.array`` of the ids, the mask
  and the logprobs assigned into preallocated padded arrays (``logprobs[i, :n][mask] =
  lps``), the advantage broadcast with the mask, and the epochs of the first boundary:
  fewer checks and fields than ``from_groups``, and ``naive / ours`` is the speed-up.
- ``ids only``: every element's ids packed into a preallocated padded array with
  ``struct.pack`` (the conversion ``from_groups`` uses) and nothing else: the floor any
  conversion from Python lists pays.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import struct
import time
from collections.abc import Callable

import numpy as np
from _report import Report, machine_lines, progress

import trio_rollouts as tr
from trio_rollouts import TrainingBatch

#: Rollouts per group, in every case.
GROUP_SIZE = 8


def single_turn(rng: random.Random, logprobs: bool) -> tr.TokenRollout:
    ids = [rng.randrange(50_000) for _ in range(1_024)]
    return tr.TokenRollout(
        trajectory=[ids],
        reward=float(rng.random() < 0.5),
        generation_mask=[[False] * 512 + [True] * 512],
        logprobs=[[-rng.random() for _ in range(512)]] if logprobs else None,
        policy_epoch=[[(0, 0)]],
    )


def episode_element(rng: random.Random) -> tuple[list[int], list[bool], list[float]]:
    mask = [False] * 256
    for _ in range(8):
        mask += [True] * 128 + [False] * 96
    ids = [rng.randrange(50_000) for _ in mask]
    return ids, mask, [-rng.random() for _ in range(mask.count(True))]


def episode(rng: random.Random) -> tr.TokenRollout:
    (ids0, mask0, lps0), (ids1, mask1, lps1) = episode_element(rng), episode_element(rng)
    return tr.TokenRollout(
        trajectory=[ids0, ids1],
        reward=float(rng.random() < 0.5),
        generation_mask=[mask0, mask1],
        logprobs=[lps0, lps1],
        policy_epoch=[[(0, 0)], [(0, 0), (1_500, 1)]],
    )


def make_groups(
    make: Callable[[random.Random], tr.TokenRollout], rollouts: int
) -> list[tr.RolloutGroup]:
    rng = random.Random(0)
    made = [make(rng) for _ in range(rollouts)]
    return [
        tr.RolloutGroup(rollouts=list(made[i : i + GROUP_SIZE]), index_in_batch=i // GROUP_SIZE)
        for i in range(0, rollouts, GROUP_SIZE)
    ]


def ids_only(groups: list[tr.RolloutGroup]) -> None:
    elements = [ids for group in groups for rollout in group for ids in rollout.trajectory]
    out = np.zeros((len(elements), max(len(ids) for ids in elements)), dtype=np.int64)
    for i, ids in enumerate(elements):
        out[i, : len(ids)] = np.frombuffer(struct.pack(f"{len(ids)}q", *ids), dtype=np.int64)


def naive(groups: list[tr.RolloutGroup]) -> None:
    """The straightforward loop: np.array per list, boolean-mask assignment."""
    elements = [
        (ids, rollout, e, advantage)
        for group in groups
        for rollout, advantage in zip(group, group.advantages(), strict=True)
        for e, ids in enumerate(rollout.trajectory)
    ]
    shape = (len(elements), max(len(ids) for ids, *_ in elements))
    input_ids = np.zeros(shape, dtype=np.int64)
    attention_mask = np.zeros(shape, dtype=np.bool_)
    loss_mask = np.zeros(shape, dtype=np.bool_)
    logprobs = np.zeros(shape, dtype=np.float32)
    policy_epoch = np.full(shape, -1, dtype=np.int64)
    advantages = np.zeros(shape, dtype=np.float32)
    for i, (ids, rollout, e, advantage) in enumerate(elements):
        n = len(ids)
        input_ids[i, :n] = np.array(ids, dtype=np.int64)
        attention_mask[i, :n] = True
        mask = np.array(rollout.generation_mask[e], dtype=np.bool_)
        loss_mask[i, :n] = mask
        if rollout.logprobs is not None:
            logprobs[i, :n][mask] = np.array(rollout.logprobs[e], dtype=np.float32)
        advantages[i, :n] = mask * np.float32(advantage)
        policy_epoch[i, :n] = rollout.policy_epoch[e][0][1]


def cpu_ms(call: Callable[[], object], repeats: int) -> list[float]:
    call()  # warm: imports, caches, the allocator
    times = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.process_time()
            call()
            times.append((time.process_time() - start) * 1e3)
    finally:
        gc.enable()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, help="repeats per case (default 15; 3 --quick)")
    parser.add_argument("--rollouts", type=int, default=1_000, help="rollouts per call")
    options = parser.parse_args()
    repeats = options.repeats or (3 if options.quick else 15)
    if repeats < 1 or options.rollouts < GROUP_SIZE:
        parser.error(f"--repeats must be >= 1 and --rollouts >= {GROUP_SIZE}")
    report = Report()
    for line in machine_lines(f"numpy {np.__version__}"):
        report.line(line)
    report.line()
    cases: list[tuple[str, Callable[[random.Random], tr.TokenRollout]]] = [
        ("single-turn", lambda rng: single_turn(rng, logprobs=True)),
        ("episode (2 elements, 8 turns each)", episode),
        ("single-turn, no logprobs", lambda rng: single_turn(rng, logprobs=False)),
    ]
    per = 1_000 / options.rollouts
    rows = []
    for name, make in cases:
        progress(f"building {options.rollouts} rollouts: {name}")
        groups = make_groups(make, options.rollouts)
        batch = TrainingBatch.from_groups(groups)
        ours = cpu_ms(lambda groups=groups: TrainingBatch.from_groups(groups), repeats)
        slow = cpu_ms(lambda groups=groups: naive(groups), repeats)
        floor = cpu_ms(lambda groups=groups: ids_only(groups), repeats)
        progress(f"  from_groups ms: {', '.join(f'{t:.1f}' for t in ours)}")
        n_rows, width = batch.input_ids.shape
        ids = int(batch.attention_mask.sum())
        arrays = (
            sum(
                getattr(batch, f).nbytes
                for f in ("input_ids", "attention_mask", "loss_mask", "logprobs", "policy_epoch")
            )
            + batch.advantages.nbytes
        )
        median = statistics.median(ours) * per
        slow_median = statistics.median(slow) * per
        floor_median = statistics.median(floor) * per
        rows.append(
            [
                name,
                f"{n_rows:,} x {width:,}",
                f"{ids / options.rollouts:,.0f}",
                f"{median:.1f}",
                f"{(max(ours) - min(ours)) / statistics.median(ours):.0%}",
                f"{median * 1e3 / (ids / options.rollouts):.1f}",
                f"{slow_median:.1f}",
                f"{slow_median / median:.2f}x",
                f"{floor_median:.1f}",
                f"{arrays / 2**20:,.0f}",
            ]
        )
    report.table(
        f"TrainingBatch.from_groups: CPU ms per 1,000 rollouts (groups of {GROUP_SIZE}, "
        f"{options.rollouts:,} rollouts per call), median of {repeats} repeats",
        [
            "case",
            "rows x length",
            "ids/rollout",
            "ms / 1k rollouts",
            "spread",
            "ns / id",
            "naive",
            "naive / ours",
            "ids only",
            "MiB out",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
