"""A RewardOnlyAgent that scores each completion with math_verify (parse, then verify)
in a worker process of run_reward's pool, with a timeout; the embedded backend stands in
for the model server. Needs the math extra: python -m pip install -e '.[math]'.

Run: python examples/math_reward.py
The code is the examples of docs/rewards.md, verbatim.
"""

import math_verify
import trio

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference, InferenceResponse


def score(answer: str, completion: str) -> float:
    """1.0 when the completion's answer is ``answer``, mathematically. This runs in a
    worker process, in its main thread, where math_verify's own timeouts work."""
    gold = math_verify.parse(f"${answer}$")
    return 1.0 if math_verify.verify(gold, math_verify.parse(completion)) else 0.0


class MathAgent(tr.RewardOnlyAgent):
    """A group: one problem, several completions, each scored in a worker."""

    async def get_reward(self, problem: tr.Problem, response: InferenceResponse) -> float:
        return await tr.run_reward(
            score, str(problem.answer), response.response.content, timeout=20.0
        )


PROBLEMS = [
    tr.Problem(problem_id="sum", prompt="What is 1/2 + 1/4?", answer=r"\frac{3}{4}"),
    tr.Problem(problem_id="root", prompt="Simplify sqrt(8).", answer=r"2\sqrt{2}"),
    tr.Problem(problem_id="square", prompt="Which x > 0 has x^2 = 9?", answer="3"),
]
#: What the simulated model answers to each prompt, each answer as likely.
ANSWERS = {
    "What is 1/2 + 1/4?": [r"The answer is $\frac{3}{4}$.", "That is 0.75.", r"$\frac{2}{6}$"],
    "Simplify sqrt(8).": [r"$2\sqrt{2}$", r"$\sqrt{8}$", "about 2.83", r"$4\sqrt{2}$"],
    "Which x > 0 has x^2 = 9?": ["x = 3", "$x = -3$", "It is 3."],
}


def model(prompt: list[tr.ChatMessage]) -> tuple[list[str], list[float]]:
    answers = ANSWERS[prompt[-1].content]
    return answers, [1.0] * len(answers)


async def main() -> None:
    tr.current_reward_limiter().total_tokens = 2  # at most 2 worker processes
    agent = MathAgent(
        prompts=tr.PromptSource(PROBLEMS, seed=0),
        parallel_generation_tasks=6,
        failure_policy=tr.FailurePolicy(max_attempts=2),  # RewardTimeoutError is transient
    )
    request = tr.GroupedRolloutRequest(
        num_groups=3,
        rollouts_per_group=4,
        inference_interface=EmbeddedInference(seed=0, policy=model),
        streaming=True,
    )
    groups = 0
    rewards: list[float] = []
    async with agent.get_grouped_rollouts(request) as stream:
        for _ in range(2 * request.num_groups):  # two batches
            group = await stream.receive()
            groups += 1
            rewards += group.rewards().tolist()
            print(group[0].problem_id, [r.extra["completion"] for r in group], group.rewards())
    mean = sum(rewards) / len(rewards)
    print(f"{groups} groups scored in worker processes, mean reward {mean:.2f}")


if __name__ == "__main__":  # each worker imports this script: only the parent runs main
    trio.run(main)
