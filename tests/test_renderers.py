"""``PlainRenderer``: the plain layout in code points, its bridge (the extension
property), and tool calls parsed from the sampled ids, never repaired."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_rollouts import AssistantTurn, ChatMessage, PlainRenderer, Renderer, ToolCall
from trio_rollouts.inference import EmbeddedInference, InferenceRequest, render_plain_chat

R = PlainRenderer()
TOOLS = [{"type": "function", "function": {"name": "calculator"}}]


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def test_it_is_a_renderer_with_no_stop_or_close_ids() -> None:
    assert isinstance(R, Renderer)
    assert R.stop_token_ids == R.close_ids == []


def test_render_is_render_plain_chat_in_code_points() -> None:
    messages = [ChatMessage(role="system", content="be brief"), user("2 + 2?")]
    assert R.render(messages) == [ord(c) for c in render_plain_chat(messages)]
    assert R.decode(R.render(messages, add_generation_prompt=False)) == (
        "<|system|>\nbe brief\n<|user|>\n2 + 2?\n"
    )
    assert R.decode(R.render(messages, tools=TOOLS)).startswith(
        f"<|tools|>\n{json.dumps(TOOLS)}\n<|system|>"
    )


async def test_it_matches_the_embedded_backends_tokens() -> None:
    messages = [user("hello")]
    ids = R.render(messages)
    by_text = await EmbeddedInference(seed=1).agenerate(InferenceRequest(prompt=messages))
    # The policy sees the conversation as the agent keeps it; the prompt is the ids.
    by_ids = await EmbeddedInference(seed=1).agenerate(
        InferenceRequest(prompt=messages, prompt_ids=ids)
    )
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.prompt_length == by_ids.prompt_length == len(ids)


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
roles = st.sampled_from(["user", "tool", "system"])
messages_strategy = st.lists(st.builds(ChatMessage, role=roles, content=texts), max_size=3)


@given(
    history=st.lists(st.builds(ChatMessage, role=roles, content=texts), min_size=1, max_size=3),
    turns=st.lists(st.tuples(texts, messages_strategy), min_size=1, max_size=4),
    with_tools=st.booleans(),
)
def test_the_bridge_extends_the_ids_to_the_full_render(
    history: list[ChatMessage], turns: list[tuple[str, list[ChatMessage]]], with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    ids = R.render(history, tools=tools)
    conversation = list(history)
    for sampled, new_messages in turns:
        ids += R.encode(sampled)  # the assistant turn, verbatim
        conversation.append(ChatMessage(role="assistant", content=sampled))
        bridge = R.bridge(ids, new_messages, tools=tools)
        assert bridge is not None
        ids += bridge
        conversation += new_messages
        assert ids == R.render(conversation, tools=tools)


def test_an_assistant_message_in_a_bridge_is_refused() -> None:
    with pytest.raises(ValueError, match=r"new_messages\[1\] is an assistant message"):
        R.bridge([], [user("a"), ChatMessage(role="assistant", content="b")])


def test_parse_reads_tool_calls_and_reasoning_from_the_ids() -> None:
    text = (
        '<think>add them</think>Let me compute. <tool_call>{"name": "calculator", '
        '"arguments": {"expression": "2+2"}}</tool_call>'
    )
    turn = R.parse(R.encode(text))
    assert turn == AssistantTurn(
        content="Let me compute.",
        tool_calls=(
            ToolCall(
                id="call_0",
                name="calculator",
                arguments={"expression": "2+2"},
                raw='{"name": "calculator", "arguments": {"expression": "2+2"}}',
            ),
        ),
        reasoning="add them",
        parse_error=None,
    )


@pytest.mark.parametrize(
    ("body", "closed", "name", "says"),
    [
        ("{'name': 'calculator'}", True, None, "tool call 0: not JSON"),
        ('["calculator"]', True, None, "tool call 0: a list, not an object"),
        ('{"name": 3}', True, None, "tool call 0: 'name' is 3, not a string"),
        ('{"name": "calc", "arguments": "2+2"}', True, "calc", "'arguments' is a str"),
        ('{"name": "calc", "arguments": {}}', False, None, "tool call 0: no </tool_call>"),
    ],
)
def test_a_broken_tool_call_is_kept_raw_and_named_never_repaired(
    body: str, closed: bool, name: str | None, says: str
) -> None:
    text = f"<tool_call>{body}" + ("</tool_call>" if closed else "")
    turn = R.parse(R.encode(text))
    [call] = turn.tool_calls
    assert call.raw == body
    assert call.arguments is None
    assert call.name == name
    assert turn.parse_error is not None
    assert says in turn.parse_error


def test_a_call_without_arguments_has_empty_arguments() -> None:
    turn = R.parse(R.encode('<tool_call>{"name": "now"}</tool_call> done'))
    assert turn.tool_calls[0].arguments == {}
    assert (turn.content, turn.parse_error) == ("done", None)


def test_decode_refuses_ids_that_are_not_code_points() -> None:
    with pytest.raises(ValueError, match=r"ids\[1\] = -1 is not a PlainRenderer token"):
        R.decode([65, -1])
