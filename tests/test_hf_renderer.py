"""``HFRenderer``: a Hugging Face chat template in its ids, fully offline.

The tokenizers are built here: a byte-level BPE trained on a tiny corpus, with ChatML's
special tokens, wrapped in ``PreTrainedTokenizerFast`` with a Jinja template written after
the real ones (Qwen2.5's ChatML with tools in the system block, Qwen3's that drops earlier
reasoning, Llama 3's headers). Checked: the derived close and stop ids, the bridge's
extension property (and ``None`` for a template that is not append-only), tools, the
parser, and ``from_pretrained`` with and without ``transformers``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_rollouts import AssistantTurn, ChatMessage, HFRenderer, Renderer, ToolCall

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="the hf extra is not installed")

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
#: Added but not special, as in Qwen's tokenizers.
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
CORPUS = [
    "system user assistant tool You are a helpful assistant.",
    "Hello. Hi. What is 2 + 2? It is 4. The weather in Paris is sunny.",
    '{"name": "calculator", "arguments": {"expression": "2+2"}}',
    "<tool_response> </tool_response> # Tools <tools> </tools> function call json",
] * 20

# Modelled on Qwen2.5's template: tools go into the system block, consecutive tool
# results share one user turn, an assistant's tool_calls are written after its content.
CHATML = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- '\\n\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Modelled on Qwen3's: an assistant turn's <think> block is kept only after the last user
# message, so a new user message rewrites the turn before it.
QWEN3 = """
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Modelled on Llama 3's: the end of a turn (<|eot_id|>) is followed by the next header's
# special tokens, and nothing else.
LLAMA3 = """
{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

# ChatML with a system block that counts the messages: every new message rewrites the start
# of the conversation, the same way after either base.
COUNTING = (
    "{{- '<|im_start|>system\\n' + (messages | length | string) + ' messages<|im_end|>\\n' }}"
    + CHATML
)

# No special token ends a turn: the close cannot be derived.
PLAIN = """
{%- for message in messages %}{{- message.role + ': ' + message.content + '\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
"""

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


def _train() -> Any:
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(CORPUS, trainer)
    model.add_tokens(ADDED)
    # Plain encode() adds a BOS, as many real tokenizers do: render and encode must not.
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return model


MODEL = _train()


def tokenizer(template: str = CHATML, eos: str = "<|im_end|>") -> Any:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=MODEL, chat_template=template, eos_token=eos, bos_token="<|endoftext|>"
    )


R = HFRenderer(tokenizer())
IM_START, IM_END, EOT = (MODEL.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|eot_id|>"))
ENDOFTEXT = MODEL.token_to_id("<|endoftext|>")


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", content=text)


def tool(text: str) -> ChatMessage:
    return ChatMessage(role="tool", content=text)


def assistant(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def sampled(renderer: HFRenderer, text: str) -> list[int]:
    """An assistant turn as the engine returns it: the ids, ending with the stop token."""
    return renderer.encode(text) + renderer.close_ids


# --------------------------------------------------------------------------- close, stop


def test_it_is_a_renderer_whose_close_is_read_from_the_template() -> None:
    assert isinstance(R, Renderer)
    assert R.close_ids == [IM_END]
    # The eos is <|im_end|> itself; <|endoftext|> is the family's own stop (Qwen's
    # generation config ends on both).
    assert R.stop_token_ids == [IM_END, ENDOFTEXT]
    assert R.family is not None
    assert (R.family.tool_parser, R.family.reasoning_parser) == ("hermes", None)


def test_the_stop_ids_add_an_eos_that_is_another_token() -> None:
    renderer = HFRenderer(tokenizer(eos="<|endoftext|>"))
    assert renderer.close_ids == [IM_END]
    assert renderer.stop_token_ids == [IM_END, ENDOFTEXT]


def test_the_close_is_only_the_special_tokens_right_after_the_content() -> None:
    # Llama 3 writes no newline: the next header's specials must not join the close.
    renderer = HFRenderer(tokenizer(LLAMA3, eos="<|eot_id|>"))
    assert renderer.close_ids == [EOT]
    history = [user("Hi.")]
    ids = renderer.render(history) + sampled(renderer, "Hello.")
    bridge = renderer.bridge(ids, [user("What is 2 + 2?")])
    assert bridge is not None
    assert renderer.decode(bridge) == (
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ids + bridge == renderer.render([*history, assistant("Hello."), user("What is 2 + 2?")])


def test_a_close_that_cannot_be_derived_must_be_given() -> None:
    with pytest.raises(ValueError, match=r"writes no special token after an assistant.*close_ids="):
        HFRenderer(tokenizer(PLAIN))
    newline = MODEL.encode("\n", add_special_tokens=False).ids
    renderer = HFRenderer(tokenizer(PLAIN), close_ids=newline, stop_token_ids=[ENDOFTEXT])
    assert (renderer.close_ids, renderer.stop_token_ids) == (newline, [ENDOFTEXT])


def test_a_template_that_does_not_render_the_probe_must_be_given_a_close() -> None:
    refusing = "{{ raise_exception('no assistant turns here') }}"
    with pytest.raises(ValueError, match=r"no assistant turns here.*pass close_ids="):
        HFRenderer(tokenizer(refusing))
    assert HFRenderer(tokenizer(refusing), close_ids=[IM_END]).close_ids == [IM_END]


def test_a_missing_install_is_not_taken_for_a_template_without_a_close() -> None:
    class WithoutJinja:
        """transformers without jinja2: apply_chat_template raises ImportError."""

        def apply_chat_template(self, *args: object, **kwargs: object) -> str:
            msg = "apply_chat_template requires jinja2 to be installed"
            raise ImportError(msg)

    with pytest.raises(ImportError, match="requires jinja2"):
        HFRenderer(WithoutJinja())


def test_close_and_stop_ids_must_be_ids() -> None:
    with pytest.raises(TypeError, match=r"close_ids\[0\] = '<\|im_end\|>' is not a token id"):
        HFRenderer(tokenizer(), close_ids=["<|im_end|>"])
    # Empty is a close: the template's next message closes a turn (GLM's <|user|>), so
    # a turn cut by max_tokens is closed by what the proved bridge starts with.
    assert HFRenderer(tokenizer(), close_ids=[]).close_ids == []


# --------------------------------------------------------------------------- render


def test_render_is_the_templates_text_encoded_without_added_tokens() -> None:
    messages = [ChatMessage(role="system", content="Be brief."), user("Hi.")]
    ids = R.render(messages)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi.<|im_end|>\n"
    assert R.decode(ids) == text + "<|im_start|>assistant\n"
    assert ids[0] == IM_START  # no BOS added by the tokenizer's post-processor
    assert R.decode(R.render(messages, add_generation_prompt=False)) == text
    assert ids == R.tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_tools_are_rendered_into_the_system_block() -> None:
    messages = [user("What is 2 + 2?")]
    without, with_tools = R.render(messages), R.render(messages, tools=TOOLS)
    assert without != with_tools
    text = R.decode(with_tools)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n<tools>\n"
    )
    assert json.loads(text.split("<tools>\n")[1].split("\n</tools>")[0]) == TOOLS[0]
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_extra_keys_reach_the_template() -> None:
    call = {"function": {"name": "calculator", "arguments": {"expression": "2+2"}}}
    message = ChatMessage(role="assistant", content="", extra={"tool_calls": [call]})
    assert R.decode(R.render([user("2 + 2?"), message], add_generation_prompt=False)).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "2+2"}}\n</tool_call><|im_end|>\n'
    )


# --------------------------------------------------------------------------- bridge


def test_the_chatml_bridge_starts_with_the_newline_after_im_end() -> None:
    history = [user("What is 2 + 2?")]
    turn = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    ids = R.render(history) + sampled(R, turn)
    assert ids[-1] == IM_END  # as sampled: the engine stops at <|im_end|>
    bridge = R.bridge(ids, [tool("4")])
    assert bridge is not None
    assert R.decode(bridge) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids + bridge == R.render([*history, assistant(turn), tool("4")])


def test_consecutive_tool_results_share_one_turn_in_the_bridge() -> None:
    history = [user("Weather in Paris, and 2 + 2?")]
    ids = R.render(history) + sampled(R, "Two calls.")
    bridge = R.bridge(ids, [tool("sunny"), tool("4")])
    assert bridge is not None
    assert R.decode(bridge).count("<|im_start|>user") == 1
    assert ids + bridge == R.render([*history, assistant("Two calls."), tool("sunny"), tool("4")])


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
# What the model samples after "assistant\n": an empty turn, or one that starts with a
# character the pre-tokenizer cannot merge with that newline (a turn starting with
# whitespace has another canonical tokenization in the full render, whatever the bridge).
turn_texts = st.one_of(st.just(""), st.builds(str.__add__, st.sampled_from("aZ4{<.é"), texts))
roles = st.sampled_from(["user", "tool", "system"])
new_messages = st.lists(st.builds(ChatMessage, role=roles, content=texts), max_size=3)


@settings(derandomize=True, deadline=None, max_examples=60)
@given(
    history=st.lists(st.builds(ChatMessage, role=roles, content=texts), min_size=1, max_size=3),
    turns=st.lists(st.tuples(turn_texts, new_messages), min_size=1, max_size=3),
    with_tools=st.booleans(),
)
def test_the_bridge_extends_the_ids_to_the_full_render(
    history: list[ChatMessage], turns: list[tuple[str, list[ChatMessage]]], with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    ids = R.render(history, tools=tools)
    conversation = list(history)
    for turn, messages in turns:
        ids += sampled(R, turn)
        conversation.append(assistant(turn))
        bridge = R.bridge(ids, messages, tools=tools)
        assert bridge is not None
        assert bridge[0] != IM_END  # the close was sampled: it is not written again
        ids += bridge
        conversation += messages
        assert ids == R.render(conversation, tools=tools)


def test_the_bridge_with_tools_is_the_render_with_tools() -> None:
    history = [ChatMessage(role="system", content="Be brief."), user("What is 2 + 2?")]
    ids = R.render(history, tools=TOOLS) + sampled(R, "Let me compute.")
    # The cached base renders are per tools value: without tools first, then with.
    assert R.bridge(R.render(history) + sampled(R, "Let me compute."), [tool("4")]) is not None
    bridge = R.bridge(ids, [tool("4")], tools=TOOLS)
    assert bridge is not None
    everything = [*history, assistant("Let me compute."), tool("4")]
    assert ids + bridge == R.render(everything, tools=TOOLS)
    assert ids + bridge != R.render(everything)


def test_a_template_that_drops_earlier_reasoning_gives_no_bridge() -> None:
    renderer = HFRenderer(tokenizer(QWEN3))
    history = [user("What is 2 + 2?")]
    turn = "<think>\nAdd them.\n</think>\n\nIt is 4."
    ids = renderer.render(history) + sampled(renderer, turn)
    # A new user message makes the template drop the <think> block sampled above.
    assert renderer.bridge(ids, [user("And 3 + 3?")]) is None
    full = renderer.render([*history, assistant(turn), user("And 3 + 3?")])
    assert "Add them." not in renderer.decode(full)
    # Even when the turn had no <think> block: the template is not append-only.
    plain = renderer.render(history) + sampled(renderer, "It is 4.")
    assert renderer.bridge(plain, [user("And 3 + 3?")]) is None


def test_a_template_that_rewrites_an_earlier_part_gives_no_bridge() -> None:
    renderer = HFRenderer(tokenizer(COUNTING))
    history = [user("Hi.")]
    ids = renderer.render(history) + sampled(renderer, "Hello.")
    assert renderer.decode(ids).startswith("<|im_start|>system\n1 messages<|im_end|>")
    # What follows the turn is the same after both bases, but the render does not extend them.
    assert renderer.bridge(ids, [tool("4")]) is None


def test_a_template_that_keeps_reasoning_through_tool_results_gives_a_bridge() -> None:
    renderer = HFRenderer(tokenizer(QWEN3))
    history = [user("What is 2 + 2?")]
    turn = "<think>\nUse the tool.\n</think>\n\n<tool_call>{}</tool_call>"
    ids = renderer.render(history) + sampled(renderer, turn)
    bridge = renderer.bridge(ids, [tool("4")])
    assert bridge is not None
    assert ids + bridge == renderer.render([*history, assistant(turn), tool("4")])


def test_previous_ids_that_do_not_end_with_the_close_give_no_bridge() -> None:
    ids = R.render([user("What is 2 + 2?")]) + R.encode("It is")  # cut by max_tokens
    assert R.bridge(ids, [user("Go on.")]) is None
    assert R.bridge([], [user("Go on.")]) is None
    assert R.bridge(ids + R.close_ids, [user("Go on.")]) is not None


def test_an_assistant_message_in_a_bridge_is_refused() -> None:
    ids = R.render([user("a")]) + sampled(R, "b")
    with pytest.raises(ValueError, match=r"new_messages\[1\] is an assistant message"):
        R.bridge(ids, [user("c"), assistant("d")])


# --------------------------------------------------------------------------- parse


def test_parse_reads_reasoning_and_tool_calls_without_the_stop_token() -> None:
    text = (
        '<think>add them</think>Let me compute. <tool_call>{"name": "calculator", '
        '"arguments": {"expression": "2+2"}}</tool_call>'
    )
    renderer = HFRenderer(tokenizer(), reasoning_parser="qwen3")
    ids = sampled(renderer, text)
    assert ids[-1] == IM_END
    assert renderer.parse(ids) == AssistantTurn(
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


def test_without_a_reasoning_format_a_think_block_stays_in_the_content() -> None:
    # The template knows no reasoning: it renders a <think> block only as content, so
    # that is where it stays (and the turn re-renders as sampled).
    turn = R.parse(sampled(R, "<think>add them</think>It is 4."))
    assert (turn.reasoning, turn.content) == (None, "<think>add them</think>It is 4.")


def test_a_broken_tool_call_is_kept_raw() -> None:
    text = "It is 4.<tool_call>{'name': 'calculator'}</tool_call><tool_call>{\"name\": \"now\""
    turn = R.parse(sampled(R, text))
    assert turn.content == "It is 4."
    assert [call.raw for call in turn.tool_calls] == ["{'name': 'calculator'}", '{"name": "now"']
    assert all(call.arguments is None for call in turn.tool_calls)
    assert turn.parse_error is not None
    assert "tool call 0: not JSON" in turn.parse_error
    assert "tool call 1: no </tool_call>" in turn.parse_error


def test_parse_keeps_a_turn_cut_without_a_stop_token() -> None:
    turn = R.parse(R.encode("<think>still thinking"))
    assert turn == AssistantTurn(content="<think>still thinking")


def test_encode_and_decode_round_trip_without_special_tokens() -> None:
    text = "Hé, 2 + 2 = 4 😀\n\t<think>"
    ids = R.encode(text)
    assert R.decode(ids) == text
    assert ENDOFTEXT not in ids
    assert R.tokenizer.encode(text)[0] == ENDOFTEXT  # the tokenizer alone would add one
    assert R.encode("<|im_end|>") == [IM_END]  # special tokens written in the text are read


# --------------------------------------------------------------------------- from_pretrained


def test_from_pretrained_reads_a_saved_tokenizer(tmp_path: Path) -> None:
    tokenizer().save_pretrained(tmp_path)
    renderer = HFRenderer.from_pretrained(tmp_path)
    assert (renderer.close_ids, renderer.stop_token_ids) == ([IM_END], [IM_END, ENDOFTEXT])
    messages = [user("What is 2 + 2?")]
    assert renderer.render(messages, tools=TOOLS) == R.render(messages, tools=TOOLS)
    given_close = HFRenderer.from_pretrained(str(tmp_path), close_ids=[EOT], stop_token_ids=[])
    assert (given_close.close_ids, given_close.stop_token_ids) == ([EOT], [])


def test_from_pretrained_without_transformers_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'trio-rollouts\[hf\]'"):
        HFRenderer.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- the proof on the conversation at hand

# Modelled on DeepSeek-R1-distill's: every assistant message loses what precedes
# </think>, last or not, so both fixed bases agree and only the conversation shows it.
STRIPS_ALWAYS = """
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def episode_turn(
    renderer: HFRenderer, history: list[ChatMessage], text: str
) -> tuple[list[int], list[ChatMessage]]:
    """The ids and conversation after one sampled turn, the turn as a structured message."""
    ids = renderer.render(history) + sampled(renderer, text)
    turn = renderer.parse(sampled(renderer, text))
    return ids, [*history, turn.to_message()]


def test_the_proof_on_the_conversation_sees_a_drift_the_fixed_bases_miss() -> None:
    renderer = HFRenderer(tokenizer(STRIPS_ALWAYS))
    history = [user("What is 2 + 2?")]
    text = "<think>Add them.</think>It is 4."
    ids, conversation = episode_turn(renderer, history, text)
    # The fixed bases both lose their reasoning alike: the old proof passes...
    assert renderer.bridge(ids, [tool("4")]) is not None
    # ...but the template would not render what the model sampled: a break, not a drift.
    assert renderer.bridge(ids, [tool("4")], messages=conversation) is None


def test_a_tool_episode_on_a_template_that_keeps_reasoning_in_its_chain_bridges() -> None:
    renderer = HFRenderer(tokenizer(QWEN3), reasoning_parser="qwen3")
    history = [user("What is 2 + 2?")]
    text = (
        "<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    )
    ids, conversation = episode_turn(renderer, history, text)
    turn = renderer.parse(sampled(renderer, text))
    assert turn.reasoning == "Use the tool."
    assert turn.tool_calls[0].arguments == {"expression": "2+2"}
    message = turn.to_message()
    assert message.extra["tool_calls"][0]["function"]["arguments"] == '{"expression": "2+2"}'
    reply = ChatMessage(role="tool", content="4", extra={"tool_call_id": turn.tool_calls[0].id})
    bridge = renderer.bridge(ids, [reply], messages=conversation)
    # QWEN3 above renders the turn as content only (no tool_calls): the call the model
    # wrote is gone from the re-render, a rewrite, so no bridge...
    assert bridge is None


def test_the_proof_gives_the_rest_of_the_templates_render() -> None:
    history = [user("What is 2 + 2?")]
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    ids, conversation = episode_turn(R, history, text)
    call_id = conversation[-1].extra["tool_calls"][0]["id"]
    reply = ChatMessage(role="tool", content="4", extra={"tool_call_id": call_id})
    bridge = R.bridge(ids, [reply], messages=conversation)
    assert bridge is not None
    assert R.decode(bridge) == (
        "\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids + bridge == R.render([*conversation, reply])


def test_a_template_that_refuses_the_conversation_gives_no_bridge() -> None:
    refuses_tools = CHATML.replace(
        "{%- elif message.role == 'tool' %}",
        "{%- elif message.role == 'tool' %}{{ raise_exception('no tools here') }}",
    )
    renderer = HFRenderer(tokenizer(refuses_tools))
    ids, conversation = episode_turn(renderer, [user("Hi.")], "Hello.")
    assert renderer.bridge(ids, [tool("4")], messages=conversation) is None
    with pytest.raises(
        ValueError, match="the chat template refused the conversation: no tools here"
    ):
        renderer.render([*conversation, tool("4")])
