"""A training run through the sync bridge that checkpoints its PromptSource, for
``test_prompts.py``'s kill-and-restart test: the parent SIGKILLs it at random moments
and starts it again; each run restores the last checkpoint.

Usage: python _resume_worker.py CHECKPOINT_JSON NUM_PROBLEMS EPOCHS

Prints ``took`` after every group it takes and ``finished`` once every epoch is done.
The checkpoint holds the source's state and the (epoch, problem_id) of every group taken
up to it, written atomically (write, then rename).
"""

from __future__ import annotations

import json
import os
import random
import sys

import attrs
import trio

import trio_rollouts as tr
from trio_rollouts._context import current_call
from trio_rollouts.testing import NullInference

sys.path.insert(0, os.path.dirname(__file__))

FILTERED = {"p2"}


@attrs.define
class Agent(tr.GroupedRolloutGenerator):
    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        if self.prompts is None:
            raise TypeError("prompts needed")
        problem = self.prompts.draw()
        draws = current_call().draws
        epoch = draws[-1][1] if draws else -1
        await trio.sleep(random.uniform(0.0005, 0.005))
        pid = problem.problem_id
        if random.random() < 0.1:
            raise ConnectionError("flaky")
        rewards = [1.0, 1.0] if pid in FILTERED else [0.0, 1.0]
        return [
            tr.Rollout(trajectory=["x"], reward=r, problem_id=pid, extra={"epoch": epoch})
            for r in rewards
        ]


def main() -> None:
    path, num_problems, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    problems = [tr.Problem(problem_id=f"p{i}", prompt="q") for i in range(num_problems)]
    source = tr.PromptSource(problems, seed=7)
    kept: list[list[object]] = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            checkpoint = json.load(file)
        source.load_state_dict(checkpoint["source"])
        kept = checkpoint["kept"]
    agent = Agent(
        prompts=source,
        parallel_generation_tasks=4,
        buffer_size=2,
        failure_policy=tr.FailurePolicy(
            max_attempts=3, retry_on=(ConnectionError,), on_failure="skip", wait_initial=0.0
        ),
    )
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=NullInference(),
        streaming=True,
        filter_groups_with_same_reward=True,
    )
    uncommitted: list[list[object]] = []
    with tr.blocking_grouped_rollouts(agent, request) as stream:
        while True:
            for group in stream.take(random.randint(1, 3), timeout=30):
                uncommitted.append([group[0].extra["epoch"], group[0].problem_id])
                print("took", flush=True)
            if random.random() < 0.5:
                kept.extend(uncommitted)
                uncommitted.clear()
                state = {"source": source.state_dict(), "kept": kept}
                with open(path + ".tmp", "w", encoding="utf-8") as file:
                    json.dump(state, file)
                os.replace(path + ".tmp", path)
                if source.epoch >= epochs and all(e >= epochs for e, _ in source.pending()):
                    print("finished", flush=True)
                    return


if __name__ == "__main__":
    main()
