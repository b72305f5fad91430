"""The quickstart's first pipeline, on Trio: a toy model answers sums, a grouped agent
scores its answers, and the loop prints each group's rewards and GRPO advantages until
batch 2. No server needed.

Run: python examples/quickstart.py
The code is the example of docs/quickstart.md ("A first pipeline"), verbatim.
"""

import random

import attrs
import trio

import trio_rollouts as tr
from trio_rollouts.inference import render_plain_chat


class GuessingModel(tr.InferenceInterface, tr.ReturnsRaw):
    """Stands in for a model server: it answers a sum, off by one half of the time."""

    async def base_generate(self, request: tr.InferenceRequest) -> tr.InferenceResponse:
        await trio.sleep(0.01)  # the time a server would take
        a, b = (int(word) for word in request.prompt[-1].content.split() if word.isdigit())
        answer = str(a + b + random.choice([-1, 0, 0, 1]))
        return tr.InferenceResponse(
            response=tr.ChatMessage(role="assistant", content=answer),
            raw_text=render_plain_chat(request.prompt) + answer,
        )


@attrs.define
class AdditionAgent(tr.GroupedRolloutGenerator):
    """One group: one addition problem, answered rollouts_per_group times."""

    max_operand: int = 99

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        a = random.randint(0, self.max_operand)
        b = random.randint(0, self.max_operand)
        interface = request.inference_interface
        prompt = interface.prepare_request(f"What is {a} + {b} ?", request.generation_args)
        rollouts: list[tr.Rollout] = []

        async def answer_once() -> None:
            response = await interface.agenerate(prompt)
            rollouts.append(
                tr.Rollout(
                    trajectory=[response.raw_text],
                    reward=1.0 if response.response.content == str(a + b) else 0.0,
                    env_id="addition",
                    problem_id=f"{a}+{b}",
                )
            )

        async with trio.open_nursery() as nursery:  # the group's answers, concurrently
            for _ in range(request.rollouts_per_group):
                nursery.start_soon(answer_once)
        return rollouts


async def main() -> None:
    agent = AdditionAgent(parallel_generation_tasks=16, buffer_size=8)
    request = tr.GroupedRolloutRequest(
        num_groups=4,
        rollouts_per_group=8,
        inference_interface=GuessingModel(),
        generation_args=tr.GenerationArgs(temperature=1.0, max_tokens=16),
        streaming=True,
    )
    async with agent.get_grouped_rollouts(request) as stream:
        async for group in stream:
            print(
                group.batch_id,
                group.index_in_batch,
                group[0].problem_id,
                group.rewards(),
                group.advantages().round(2),
            )
            if group.batch_id == 2:
                break
    # Leaving the block cancelled every group still being generated.


trio.run(main)
