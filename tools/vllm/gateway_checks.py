"""The gateway against the real vLLM: unmodified SDK tool agents in its three dialects,
token-in.

Six sessions at once, each an agent that knows nothing of trio_rollouts, two per dialect:
the openai SDK's Chat Completions and Responses APIs (``AsyncOpenAI`` pointed at
``session.base_url``) and Anthropic's Messages API (``AsyncAnthropic`` pointed at
``session.anthropic_base_url``); a calculator tool, three calls (a tool result after a
tool call, else "Go on."). Through ``trio_rollouts.gateway.serve``
with Qwen2.5's template on the served tokenizer and ``OpenAIInference(server="vllm")``
(vLLM's RL interface on this server): every rollout is ``"exact"``, every sampled id's
logprob equals vLLM's re-score of its element, every call is committed, and every break
is counted (the random model ends turns on stop bytes the template writes otherwise).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import transformers
import trio
from checks import QWEN_TEMPLATE, VLLM, episode_logprob_gap, exact_episode
from run import check

import trio_rollouts as tr

SESSIONS = 6
CALLS = 3
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


async def sdk_agent(base_url: str, api_key: str, question: str) -> int:
    """An agent as people write them; returns the calls it made."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(CALLS):
        completion = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        else:
            messages.append({"role": "user", "content": "Go on."})
    await client.close()
    return CALLS


async def responses_agent(base_url: str, api_key: str, question: str) -> int:
    """The same agent on the Responses API (the OpenAI Agents SDK's default): the output
    items go back as input, with a ``function_call_output`` per call."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    items: list[Any] = [{"role": "user", "content": question}]
    for _ in range(CALLS):
        response = await client.responses.create(model="policy", input=items, tools=tools)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
        if not calls:
            items.append({"role": "user", "content": "Go on."})
    await client.close()
    return CALLS


async def messages_agent(base_url: str, api_key: str, question: str) -> int:
    """The same agent on Anthropic's Messages API: ``tool_use`` blocks answered by
    ``tool_result`` blocks."""
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [
        {
            "name": tool["function"]["name"],
            "description": tool["function"]["description"],
            "input_schema": tool["function"]["parameters"],
        }
        for tool in TOOLS
    ]
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(CALLS):
        reply = await client.messages.create(
            model="policy", max_tokens=64, messages=messages, tools=tools
        )
        messages.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            }
        )
        uses = [block for block in reply.content if block.type == "tool_use"]
        if uses:
            results = [{"type": "tool_result", "tool_use_id": u.id, "content": "42"} for u in uses]
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": "Go on."})
    await client.close()
    return CALLS


async def check_gateway(vllm: VLLM) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(vllm.model)
    tokenizer.chat_template = QWEN_TEMPLATE.read_text(encoding="utf-8")
    renderer = tr.HFRenderer(tokenizer)
    inference = tr.OpenAIInference(vllm.base_url, vllm.model, server="vllm")
    rollouts: list[tr.TokenRollout] = []

    async def member(gw: tr.gateway.Gateway, index: int) -> None:
        problem = tr.Problem(problem_id=f"q{index}", prompt=f"What is {index} + 40?")
        async with gw.session(problem) as session:
            question = str(problem.prompt)
            if index % 3 == 0:
                await sdk_agent(session.base_url, session.api_key, question)
            elif index % 3 == 1:
                await responses_agent(session.base_url, session.api_key, question)
            else:
                await messages_agent(session.anthropic_base_url, session.api_key, question)
        rollouts.append(session.rollout(1.0, env_id="gateway"))

    args = tr.GenerationArgs(max_tokens=8, temperature=1.0)
    async with (
        tr.gateway.serve(inference, renderer, generation_args=args, min_fidelity="exact") as gw,
        trio.open_nursery() as nursery,
    ):
        for index in range(SESSIONS):
            nursery.start_soon(member, gw, index)
    worst, calls, breaks, elements = 0.0, 0, 0, 0
    for rollout in rollouts:
        exact_episode(rollout)
        worst = max(worst, await episode_logprob_gap(vllm, rollout))
        summary = rollout.extra["gateway"]
        calls += summary["calls"]
        breaks += summary["breaks"]
        elements += len(rollout.trajectory)
        check(
            len(rollout.trajectory) == summary["breaks"] + 1,
            f"{len(rollout.trajectory)} elements for {summary['breaks']} breaks",
        )
    check(calls == SESSIONS * CALLS, f"{calls} calls committed, not {SESSIONS * CALLS}")
    check(worst == 0.0, f"a sampled id's logprob is {worst:.3g} off vLLM's re-score")
    await inference.aclose()
    return (
        f"{SESSIONS} SDK sessions (chat, responses, messages), {calls} calls, all exact; "
        f"{elements} elements "
        f"({breaks} breaks: turns the random model ended on a stop byte); worst logprob gap "
        f"{worst:.3g}; {json.dumps(rollouts[0].extra['gateway']['per_turn'][0]['finish_reason'])}"
        " first finish"
    )
