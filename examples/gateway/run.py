"""An unmodified agent script (``agent.py``: the OpenAI SDK and a calculator tool) as a
GRPO agent: :class:`~trio_rollouts.gateway.GatewayAgent` runs it once per member behind
the gateway, on the embedded backend, and each run becomes a token-exact rollout.

The model is the tool demo's (:class:`~trio_rollouts.envs.ToolUsePolicy`): it writes
``<tool_call>{...}</tool_call>`` in :class:`~trio_rollouts.PlainRenderer`'s format, which
the gateway returns to the script as OpenAI ``tool_calls``; the script runs the
calculator, sends a ``tool`` message back, and prints ``{"reward": ...}`` at the end.

Needs ``pip install -e '.[gateway]'`` (the gateway and the ``openai`` SDK)::

    python examples/gateway/run.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import trio

import trio_rollouts as tr
from trio_rollouts.envs import ToolUsePolicy, make_problems
from trio_rollouts.gateway import GatewayAgent
from trio_rollouts.inference import EmbeddedInference

AGENT = Path(__file__).with_name("agent.py")


async def main() -> None:
    problems = make_problems(8, seed=0)
    policy = ToolUsePolicy.initial(problems, num_candidates=4, seed=0)
    # A model that calls the calculator most of the time, and mostly answers its result.
    policy.call_logits = np.array([2.0, 0.0, 0.0, 0.0])
    policy.answer_logits = np.array([2.0, 0.0, 0.0, 0.0])
    agent = GatewayAgent(
        command=[sys.executable, str(AGENT)],
        renderer=tr.PlainRenderer(),
        prompts=tr.PromptSource(problems, seed=0),
        env_id="calculator",
        command_timeout=60,
    )
    model = EmbeddedInference(policy=policy, seed=0)
    request = tr.GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=4, inference_interface=model
    )
    async with agent.get_grouped_rollouts(request) as stream:
        async for group in stream:
            for rollout in group:
                gateway = rollout.extra["gateway"]
                print(
                    f"{rollout.problem_id}: fidelity {rollout.fidelity}, "
                    f"{gateway['calls']} turns, {gateway['tool_calls']} tool calls, "
                    f"{gateway['breaks']} breaks, {sum(map(sum, rollout.generation_mask))} "
                    f"sampled ids, reward {rollout.reward}"
                )
            print(f"group of {group[0].problem_id}: advantages {np.round(group.advantages(), 2)}")


if __name__ == "__main__":
    trio.run(main)
