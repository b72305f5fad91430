"""An OpenAI Agents SDK agent that knows nothing of trio_rollouts, with one function tool.

Run by :class:`~trio_rollouts.gateway.GatewayAgent` as a command (``pip install
openai-agents``): the SDK with its defaults, the Responses API on a client it makes from
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``; the problem comes from
``TRIO_ROLLOUTS_PROBLEM``; the last line printed is ``{"reward": ...}``. The SDK runs on
asyncio, in its own process: nothing here needs Trio. Tracing is off (it would upload
traces to OpenAI).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from typing import Any

from agents import Agent, Runner, function_tool, set_tracing_disabled


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of two integers, such as '17 * 3'.

    Args:
        expression: the expression, 'a op b' with op one of + - *.
    """
    found = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expression)
    if found is None:
        return "error: write 'a op b' with op one of + - *"
    a, op, b = int(found[1]), found[2], int(found[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def reward(answer: Any, text: str) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    if answer is None or not numbers:
        return 0.0
    return float(math.isclose(float(numbers[-1]), float(answer), abs_tol=1e-9))


async def main() -> None:
    set_tracing_disabled(True)
    problem = json.loads(os.environ["TRIO_ROLLOUTS_PROBLEM"])
    agent = Agent(
        name="calculator agent",
        instructions="Use the calculator, then state the answer.",
        tools=[calculator],
    )
    result = await Runner.run(agent, problem["prompt"], max_turns=4)
    print(json.dumps({"reward": reward(problem.get("answer"), str(result.final_output))}))


if __name__ == "__main__":
    asyncio.run(main())
