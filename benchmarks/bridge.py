"""The renderer's share of a turn: ``bridge`` proved on the conversation at hand, beside
the fixed-base proof it replaced.

Usage: python benchmarks/bridge.py [--contexts 256,2048,8192] [--turns 8] [--repeats 5]

For each renderer and initial context ``C`` (ids of the first render), an episode of
``--turns`` turns is built the way ``MultiTurnAgent`` builds it: a sampled turn (a tool
call written in the renderer's canonical form, then the close), the turn's structured
message (``AssistantTurn.to_message``), a ``"tool"`` reply, and the bridge. What is timed
is the bridge of each turn (CPU time, ``time.process_time``, median over repeats, per
turn): ``conversation`` (``bridge(..., messages=conversation)``, what the agent calls)
and ``fixed bases`` (``bridge(...)`` without it: two fixed base conversations, what it
called before). ``parse`` is timed beside them.

- ``PlainRenderer``: code points, ``render_plain_chat``'s layout.
- ``HFRenderer``: Qwen2.5's published chat template (``tests/data/chat_templates``) on a
  byte-level BPE trained here (512 ids; a real vocabulary encodes shorter texts, so the
  encode and decode shares are upper bounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _report import Report, machine_lines

import trio_rollouts as tr

TEMPLATE = Path(__file__).parents[1] / "tests" / "data" / "chat_templates" / "qwen2.5.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
FILLER = "Please add the numbers in this list and tell me the total. 17 25 31 4 99 "


def hf_renderer() -> tr.HFRenderer:
    import tokenizers
    import transformers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator([FILLER, json.dumps(TOOLS), "<tool_call> </tool_call>"] * 50, trainer)
    model.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        chat_template=TEMPLATE.read_text(encoding="utf-8"),
        eos_token="<|im_end|>",
    )
    return tr.HFRenderer(tokenizer)


def canonical_turn(renderer: Any, index: int) -> str:
    call = {"name": "calculator", "arguments": {"expression": f"{index} + 17"}}
    if isinstance(renderer, tr.HFRenderer):
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def episode(renderer: Any, context: int, turns: int) -> list[tuple[Callable[[], object], ...]]:
    """Per turn: (bridge on the conversation, bridge on the fixed bases, parse) calls."""
    prompt = ""
    while (
        len(renderer.render([tr.ChatMessage(role="user", content=prompt)], tools=TOOLS)) < context
    ):
        prompt += FILLER
    conversation = [tr.ChatMessage(role="user", content=prompt)]
    ids = renderer.render(conversation, tools=TOOLS)
    calls = []
    for index in range(turns):
        sampled = renderer.encode(canonical_turn(renderer, index)) + renderer.close_ids
        turn = renderer.parse(sampled)
        ids = ids + sampled
        history = [*conversation, turn.to_message()]
        call_id = turn.tool_calls[0].id
        reply = [tr.ChatMessage(role="tool", content="42", extra={"tool_call_id": call_id})]
        previous = list(ids)
        calls.append(
            (
                lambda p=previous, r=reply, h=history: renderer.bridge(
                    p, r, tools=TOOLS, messages=h
                ),
                lambda p=previous, r=reply: renderer.bridge(p, r, tools=TOOLS),
                lambda s=sampled: renderer.parse(s),
            )
        )
        bridge = renderer.bridge(previous, reply, tools=TOOLS, messages=history)
        if bridge is None:
            raise SystemExit(f"{type(renderer).__name__}: turn {index} did not bridge")
        ids = ids + bridge
        conversation = [*history, *reply]
    return calls


def per_turn_us(calls: list[Callable[[], object]], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for call in calls:
            call()
        times.append((time.process_time() - start) / len(calls) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,2048,8192")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    report = Report()
    for line in machine_lines("renderers"):
        report.line(line)
    rows: list[list[str]] = []
    for renderer in (tr.PlainRenderer(), hf_renderer()):
        for context in (int(c) for c in options.contexts.split(",")):
            calls = episode(renderer, context, options.turns)
            proof, bases, parse = (
                per_turn_us([c[i] for c in calls], options.repeats) for i in range(3)
            )
            rows.append(
                [
                    type(renderer).__name__,
                    f"{context:,}",
                    f"{proof:.1f}",
                    f"{bases:.1f}",
                    f"{proof / bases:.2f}x",
                    f"{parse:.1f}",
                ]
            )
    report.table(
        f"The bridge's CPU per turn (µs, median of {options.repeats} repeats of "
        f"{options.turns} turns)",
        ["renderer", "C", "conversation", "fixed bases", "ratio", "parse"],
        rows,
    )


if __name__ == "__main__":
    main()
