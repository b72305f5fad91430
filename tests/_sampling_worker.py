"""Subprocess helper for ``test_sampling.py``.

``python _sampling_worker.py derive`` reads a JSON list of part lists on stdin and
prints the JSON list of ``derive_seed(*parts)``: the same seeds must come out of any
process (the parent runs it with another ``PYTHONHASHSEED``).

``python _sampling_worker.py run CHECKPOINT_JSON TOTAL`` is a seeded training run on
the embedded backend and a MockClock that checkpoints its PromptSource after every
group it takes (and a trainer step, during which the pipeline runs ahead), with the
JSONL of every group taken so far (written atomically: write, then rename). It starts
from the checkpoint when there is one. After each checkpoint it prints ``took N`` and
waits for a line on stdin, the whole run blocked so that virtual time stands still (the
parent answers, or SIGKILLs it there, with work in flight); it prints ``finished`` once
``TOTAL`` groups are kept. One call at a time, so a run delivers its groups in the
order their problems were drawn, and a resumed run in the same order.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy.typing as npt
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference, InferenceResponse
from trio_rollouts.inference._sampling import derive_seed

RUN_SEED = 20240611
PROBLEMS = [
    tr.Problem(problem_id=f"p{i}", prompt=f"question {i}" + "?" * i, answer="yes") for i in range(5)
]


def policy(messages: list[tr.ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
    return ["yes", "no", "maybe not", "I would rather not say"], [0.4, 0.3, 0.2, 0.1]


class Graded(tr.RewardOnlyAgent):
    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        await trio.lowlevel.checkpoint()
        return float(response.response.content == problem.answer)


def save(path: str, checkpoint: dict[str, object]) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        json.dump(checkpoint, file)
    os.replace(path + ".tmp", path)


async def run(path: str, total: int, checkpoint: dict[str, Any] | None) -> None:
    source = tr.PromptSource(PROBLEMS, seed=3)
    kept: list[str] = []
    if checkpoint is not None:
        source.load_state_dict(checkpoint["source"])
        kept = checkpoint["kept"]
    agent = Graded(prompts=source, parallel_generation_tasks=1, buffer_size=2)
    request = tr.GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=3,
        inference_interface=EmbeddedInference(seed=0, policy=policy),
        generation_args=tr.GenerationArgs(temperature=0.9),
        streaming=True,
        seed=RUN_SEED,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        while len(kept) < total:
            group = await stream.receive()
            lines = io.StringIO()
            tr.dump_jsonl(group.rollouts, lines)
            kept.append(lines.getvalue())
            # The trainer's step: the pipeline runs ahead (the next call is in flight
            # after the short steps, finished and waiting after the long ones).
            await trio.sleep(0.02 if len(kept) % 2 else 0.3)
            save(path, {"source": source.state_dict(), "kept": kept})
            print(f"took {len(kept)}", flush=True)
            # Blocks the whole run (virtual time stands still): the parent answers or
            # kills the process here, with work in flight.
            if not sys.stdin.readline():
                return
    print("finished", flush=True)


def main() -> None:
    if sys.argv[1] == "derive":
        parts = json.load(sys.stdin)
        print(json.dumps([derive_seed(*p) for p in parts]))
        return
    path, total = sys.argv[2], int(sys.argv[3])
    checkpoint = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            checkpoint = json.load(file)
    trio.run(run, path, total, checkpoint, clock=trio.testing.MockClock(autojump_threshold=0))


if __name__ == "__main__":
    main()
