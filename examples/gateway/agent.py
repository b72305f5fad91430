"""An agent that knows nothing of trio_rollouts: the OpenAI SDK and a calculator tool.

It is what an existing harness looks like: ``OpenAI()`` reads ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY``; the problem comes from ``TRIO_ROLLOUTS_PROBLEM`` (JSON:
``problem_id``, ``prompt``, ``answer``); the model may call ``calculator`` (at most
``MAX_TURNS`` model calls); the last line printed is ``{"reward": ...}``: 1.0 when the
last number of the final answer is the problem's answer.

Run it by hand against any OpenAI-compatible server::

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \\
    TRIO_ROLLOUTS_PROBLEM='{"problem_id": "p0", "prompt": "What is 6 * 7?", "answer": 42}' \\
    python examples/gateway/agent.py
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import sys
from typing import Any

from openai import OpenAI

MAX_TURNS = 4

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as '17 * (3 + 4)'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def calculate(expression: str) -> str:
    """The value of ``expression`` (numbers, + - * / // %, parentheses), or an error."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return float(_OPERATORS[type(node.op)](value(node.left), value(node.right)))
        raise ValueError(f"not allowed: {ast.dump(node)[:60]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as error:
        return f"error: {error}"
    return str(int(result)) if result.is_integer() else str(result)


def reward(answer: Any, text: str) -> float:
    """1.0 when the last number of ``text`` equals ``answer``."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    if answer is None or not numbers:
        return 0.0
    try:
        return float(math.isclose(float(numbers[-1]), float(answer), abs_tol=1e-9))
    except ValueError:
        return 0.0


def main() -> None:
    problem = json.loads(os.environ["TRIO_ROLLOUTS_PROBLEM"])
    prompt = problem["prompt"]
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    )
    client = OpenAI(max_retries=0)
    model = client.models.list().data[0].id
    final = ""
    for _ in range(MAX_TURNS):
        completion = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR]
        )
        message = completion.choices[0].message
        assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            assistant["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in message.tool_calls
            ]
        messages.append(assistant)
        if not message.tool_calls:
            final = message.content or ""
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]
                result = calculate(str(expression))
            except (ValueError, KeyError, TypeError) as error:
                result = f"error: bad arguments ({error})"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        print(f"turn {len(messages)}: tool calls answered", file=sys.stderr)
    print(json.dumps({"reward": reward(problem.get("answer"), final)}))


if __name__ == "__main__":
    main()
