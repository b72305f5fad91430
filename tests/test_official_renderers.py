"""``MistralCommonRenderer`` (mistral-common) and ``HarmonyRenderer`` (openai-harmony):
the official renderings, offline (see ``_official.py`` for the tokenizers).

- a. renders are the official library's own output for requests built by hand;
- b. the libraries' rules, mapped: call ids, prefixes, roles, errors naming the field;
- c. bridges proved on the conversation: ``render(all) == previous ids + bridge`` where
  the rendering is append-only, ``None`` where it rewrites history;
- d. parses read back tool calls, reasoning and content;
- e. ``MultiTurnAgent`` episodes, token-exact, on a scripted token-in model that writes
  each turn as the official renderer writes that message (or not quite: breaks);
- f. the vocabulary fingerprint is the Hugging Face tokenizer's of the same vocabulary;
- g. the comparison with the Hugging Face templates in the same vocabularies: where the id
  sequences differ for the same conversation (``pytest -s`` prints the report;
  ``docs/official-renderers.md`` gives it).
"""

from __future__ import annotations

import datetime
import json
import sys
import types
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from trio_rollouts import (
    AssistantTurn,
    BaseEnvironment,
    ChatMessage,
    EnvironmentStep,
    GenerationArgs,
    GroupedRolloutRequest,
    MultiTurnAgent,
    Problem,
    PromptSource,
    Renderer,
    TokenRollout,
)
from trio_rollouts.episodes import check_vocabulary
from trio_rollouts.inference import (
    CODE_POINTS,
    AcceptsTokens,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
)

pytest.importorskip("transformers", reason="the hf extra is not installed")
import _official

MISTRAL_VERSIONS = ["v3", "v11", "v13"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The expression."}},
                "required": ["expression"],
            },
        },
    }
]
QUESTION = "What is 12 * (3 + 4)?"


@pytest.fixture(scope="module")
def mc() -> Any:
    """mistral-common's modules (skips without the mistral extra)."""
    pytest.importorskip("mistral_common", reason="the mistral extra is not installed")
    import mistral_common.protocol.instruct.chunk as chunk
    import mistral_common.protocol.instruct.messages as messages
    import mistral_common.protocol.instruct.request as request
    import mistral_common.protocol.instruct.tool_calls as tool_calls

    modules = (messages, chunk, request, tool_calls)
    return types.SimpleNamespace(**{k: v for m in modules for k, v in vars(m).items()})


@pytest.fixture(scope="module")
def oh() -> Any:
    """openai-harmony (skips without the harmony extra or a local o200k vocabulary)."""
    module = pytest.importorskip("openai_harmony", reason="the harmony extra is not installed")
    if _official.harmony_vocab_dir() is None:
        pytest.skip("no o200k_base.tiktoken here (TIKTOKEN_ENCODINGS_BASE, tml-renderers)")
    return module


def user(content: str) -> ChatMessage:
    return ChatMessage(role="user", content=content)


def assistant(
    content: str = "",
    calls: Sequence[tuple[str, str]] = (),
    reasoning: str | None = None,
    name: str = "calculator",
) -> ChatMessage:
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps({"expression": expression})},
            }
            for call_id, expression in calls
        ]
    if reasoning is not None:
        extra["reasoning_content"] = reasoning
    return ChatMessage(role="assistant", content=content, extra=extra)


def tool(content: str, call_id: str, name: str | None = "calculator") -> ChatMessage:
    extra = {"tool_call_id": call_id}
    if name is not None:
        extra["name"] = name
    return ChatMessage(role="tool", content=content, extra=extra)


# --------------------------------------------------------------------------- a. renders


@pytest.mark.parametrize("version", MISTRAL_VERSIONS)
def test_mistral_renders_are_mistral_commons_own(mc: Any, version: str) -> None:
    r = _official.mistral(version)
    tools = [mc.Tool(function=mc.Function(**TOOLS[0]["function"]))]
    calls = [
        mc.ToolCall(
            id="a1B2c3D4e",
            function=mc.FunctionCall(name="calculator", arguments='{"expression": "2+2"}'),
        )
    ]
    think = version == "v13"
    answer: Any = [mc.ThinkChunk(thinking="Add.", closed=True), mc.TextChunk(text="It is 4.")]
    cases = [
        ([user("Hi.")], None, [mc.UserMessage(content="Hi.")], None),
        (
            [ChatMessage(role="system", content="Be brief."), user("Hi.")],
            None,
            [mc.SystemMessage(content="Be brief."), mc.UserMessage(content="Hi.")],
            None,
        ),
        (
            [
                user(QUESTION),
                assistant(calls=[("a1B2c3D4e", "2+2")]),
                tool("4", "a1B2c3D4e"),
                assistant("It is 4.", reasoning="Add." if think else None),
                user("And 3 + 3?"),
            ],
            TOOLS,
            [
                mc.UserMessage(content=QUESTION),
                mc.AssistantMessage(tool_calls=calls),
                mc.ToolMessage(content="4", tool_call_id="a1B2c3D4e", name="calculator"),
                mc.AssistantMessage(content=answer if think else "It is 4."),
                mc.UserMessage(content="And 3 + 3?"),
            ],
            tools,
        ),
    ]
    for messages, schemas, expected, expected_tools in cases:
        request = mc.ChatCompletionRequest(messages=expected, tools=expected_tools)
        official = r.tokenizer.encode_chat_completion(request).tokens
        assert r.render(messages, tools=schemas) == official
        assert r.render(messages, tools=schemas, add_generation_prompt=False) == official


@pytest.mark.parametrize("version", MISTRAL_VERSIONS)
def test_a_last_assistant_message_is_rendered_closed_or_as_an_open_prefix(
    mc: Any, version: str
) -> None:
    r = _official.mistral(version)
    prefix = mc.AssistantMessage(content="It is", prefix=True)
    request = mc.ChatCompletionRequest(messages=[mc.UserMessage(content=QUESTION), prefix])
    open_ids = r.tokenizer.encode_chat_completion(request).tokens
    finished = r.render([user(QUESTION), assistant("It is")])
    assert finished == [*open_ids, *r.close_ids]
    assert r.render([user(QUESTION), assistant("It is")], add_generation_prompt=False) == finished
    continued = ChatMessage(role="assistant", content="It is", extra={"prefix": True})
    assert r.render([user(QUESTION), continued]) == open_ids


def test_harmony_renders_are_harmonys_own(oh: Any) -> None:
    r = _official.harmony()
    encoding = r.encoding
    system = oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())
    developer = oh.DeveloperContent.new().with_instructions("Be brief.")
    function = TOOLS[0]["function"]
    developer = developer.with_function_tools(
        [oh.ToolDescription.new(function["name"], function["description"], function["parameters"])]
    )
    expected = [
        system,
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer),
        oh.Message.from_role_and_content(oh.Role.USER, QUESTION),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Use it.").with_channel("analysis"),
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, '{"expression": "2+2"}')
        .with_channel("commentary")
        .with_recipient("functions.calculator")
        .with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(oh.Author.new(oh.Role.TOOL, "functions.calculator"), "4")
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    messages = [
        ChatMessage(role="system", content="Be brief."),
        user(QUESTION),
        assistant(calls=[("call_1_0", "2+2")], reasoning="Use it."),
        tool("4", "call_1_0", name=None),  # the name is the call's
    ]
    conversation = oh.Conversation.from_messages(expected)
    official = encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
    assert r.render(messages, tools=TOOLS) == official
    assert r.decode(official).endswith("<|end|><|start|>assistant")
    # Without a generation prompt: the training render (a last final answer: <|return|>).
    answer = oh.Message.from_role_and_content(oh.Role.ASSISTANT, "84").with_channel("final")
    plain = [system, oh.Message.from_role_and_content(oh.Role.USER, QUESTION), answer]
    training = encoding.render_conversation_for_training(oh.Conversation.from_messages(plain))
    ids = r.render([user(QUESTION), assistant("84")], add_generation_prompt=False)
    assert ids == training
    assert r.decode(ids).endswith("<|channel|>final<|message|>84<|return|>")


def test_harmony_system_settings(oh: Any) -> None:
    r = _official.harmony(
        reasoning_effort="high", conversation_start_date="2025-08-05", model_identity=None
    )
    text = r.decode(r.render([user("Hi.")]))
    assert text.startswith("<|start|>system<|message|>Knowledge cutoff: 2024-06\n")
    assert "Current date: 2025-08-05\n\nReasoning: high\n\n" in text
    assert "ChatGPT" not in text
    # No instructions and no tools: no developer message.
    assert "<|start|>developer" not in text


# --------------------------------------------------------------------------- b. the rules


def test_mistral_call_ids_are_nine_letters_and_digits_until_v13(mc: Any) -> None:
    from trio_rollouts.renderers.mistral_common import nine_character_id

    conversation = [user(QUESTION), assistant(calls=[("call_1_0", "2+2")]), tool("4", "call_1_0")]
    made = nine_character_id("call_1_0")
    assert len(made) == 9
    assert made.isalnum()
    assert nine_character_id(made) == made
    for version in ("v3", "v11"):
        r = _official.mistral(version)
        text = r.decode(r.render(conversation, tools=TOOLS))
        assert text.count(made) == 2
        assert "call_1_0" not in text
        assert r.call_id(2, 1) == nine_character_id("call_2_1")
    v13 = _official.mistral("v13")
    assert v13.call_id(2, 1) == "call_2_1"
    assert "call_1_0" not in v13.decode(v13.render(conversation, tools=TOOLS))  # not written


def test_mistral_errors_name_the_field(mc: Any) -> None:
    v3, v11 = _official.mistral("v3"), _official.mistral("v11")
    with pytest.raises(ValueError, match=r"messages\[1\] has content .* tokenizer v3"):
        v3.render([user(QUESTION), assistant("Sure.", calls=[("a1B2c3D4e", "1")])])
    assert v11.render([user(QUESTION), assistant("Sure.", calls=[("a1B2c3D4e", "1")])])
    with pytest.raises(ValueError, match=r"messages\[1\] is an assistant message with no content"):
        v3.render([user(QUESTION), assistant(""), user("Hi.")])
    early = ChatMessage(role="assistant", content="It", extra={"prefix": True})
    with pytest.raises(ValueError, match=r"messages\[1\]\.extra\['prefix'\] is True"):
        v3.render([user(QUESTION), early, user("Hi.")])
    with pytest.raises(ValueError, match=r"messages\[1\]\.extra\['reasoning_content'\].*v11"):
        v11.render([user(QUESTION), assistant("4", reasoning="Add.")])
    with pytest.raises(ValueError, match=r"messages\[2\]\.extra\['tool_call_id'\] is None"):
        v3.render(
            [
                user(QUESTION),
                assistant(calls=[("a1B2c3D4e", "1")]),
                ChatMessage(role="tool", content="1"),
            ]
        )
    with pytest.raises(ValueError, match=r"\['function'\]\['name'\] is 'a b'"):
        v11.render([user(QUESTION), assistant(calls=[("a1B2c3D4e", "1")], name="a b")])
    with pytest.raises(ValueError, match=r"messages\[0\]\.content is empty"):
        v11.render([ChatMessage(role="system", content=""), user(QUESTION)])
    with pytest.raises(ValueError, match=r"tools\[0\]\['type'\] is 'retrieval'"):
        v3.render([user(QUESTION)], tools=[{"type": "retrieval"}])
    with pytest.raises(ValueError, match="messages is empty"):
        v3.render([])
    # What mistral-common itself refuses is quoted.
    with pytest.raises(ValueError, match=r"mistral-common refused the conversation: .*role"):
        v3.render([user(QUESTION), tool("4", "a1B2c3D4e")])


def test_mistral_refuses_other_roles_and_tokenizers(mc: Any) -> None:
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from trio_rollouts.renderers.mistral_common import MistralCommonRenderer

    r = _official.mistral("v3")
    ChatMessage.declare_roles(["ipython"])  # as Llama 3's renderers do
    with pytest.raises(ValueError, match=r"messages\[1\]\.role is 'ipython'"):
        r.render([user(QUESTION), ChatMessage(role="ipython", content="4")])
    with pytest.raises(TypeError, match="tokenizer must be a mistral-common MistralTokenizer"):
        MistralCommonRenderer(object())
    serving = MistralTokenizer.from_file(_official.tekken_path("v3"), mode=ValidationMode.serving)
    with pytest.raises(ValueError, match=r"tokenizer\.mode is 'serving'"):
        MistralCommonRenderer(serving)


def test_mistral_constructors(mc: Any) -> None:
    from trio_rollouts.renderers.mistral_common import MistralCommonRenderer

    nemo = MistralCommonRenderer.from_file(_official.tekken_path("v3"))
    assert nemo.version == "v3"
    assert nemo.stop_token_ids == nemo.close_ids == [2]
    assert isinstance(nemo, Renderer)
    assert nemo.render([user("Hi.")]) == _official.mistral("v3").render([user("Hi.")])
    pytest.importorskip("sentencepiece", reason="SentencePiece tokenizers need sentencepiece")
    v7 = MistralCommonRenderer.v7()
    assert v7.version == "v7"
    ids = v7.render([ChatMessage(role="system", content="Be brief."), user("Hi.")])
    assert v7.decode(ids) == "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi.[/INST]"
    assert MistralCommonRenderer.v3().version == "v3"
    call = v7.encode(
        '[{"name": "calculator", "arguments": {"expression": "1"}, "id": "a1B2c3D4e"}]'
    )
    turn = v7.parse(
        [v7.tokenizer.instruct_tokenizer.tokenizer.get_special_token("[TOOL_CALLS]"), *call, 2]
    )
    assert turn.tool_calls[0].arguments == {"expression": "1"}
    assert str(v7.token_vocabulary).startswith("hf:")


def test_harmony_errors_name_the_field(oh: Any, tmp_path: Any) -> None:
    from trio_rollouts.renderers.harmony import HarmonyRenderer, load_gpt_oss_encoding

    r = _official.harmony()
    with pytest.raises(ValueError, match=r"messages\[1\]\.role is 'system' after the conversation"):
        r.render([user(QUESTION), ChatMessage(role="system", content="Be brief.")])
    with pytest.raises(
        ValueError, match=r"messages\[1\] is a tool message with no extra\['name'\]"
    ):
        r.render([user(QUESTION), tool("4", "call_9", name=None)])
    with pytest.raises(ValueError, match="reasoning_effort must be one of 'low', 'medium', 'high'"):
        HarmonyRenderer(r.encoding, reasoning_effort="max")
    with pytest.raises(TypeError, match="conversation_start_date must be a str or None"):
        HarmonyRenderer(r.encoding, conversation_start_date=20250805)
    with pytest.raises(TypeError, match=r"tools\[0\]\['function'\] must be a dict"):
        r.render([user(QUESTION)], tools=[{"type": "function", "function": None}])
    # A vocabulary that is not o200k's (harmony checks its SHA-256): an OSError saying so.
    (tmp_path / "o200k_base.tiktoken").write_text(_official.tiktoken_line(b"a", 0))
    with pytest.raises(OSError, match=r"could not load gpt-oss's vocabulary .* vocab_dir="):
        load_gpt_oss_encoding(tmp_path)
    loaded = HarmonyRenderer.load(_official.harmony_vocab_dir())
    assert loaded.render([user("Hi.")]) == r.render([user("Hi.")])
    assert isinstance(loaded, Renderer)
    assert loaded.stop_token_ids == [200002, 200012]
    assert loaded.close_ids == [200007]


# --------------------------------------------------------------------------- c. bridges


def family(name: str) -> Any:
    return _official.harmony() if name == "harmony" else _official.mistral(name)


FAMILIES = [*MISTRAL_VERSIONS, "harmony"]


def turn_ids(r: Any, message: ChatMessage, tools: Any) -> list[int]:
    """The ids the model writes for ``message`` (stop id included): what the official
    renderer writes for it right after a user message."""
    context = [user(QUESTION)]
    prompt = r.render(context, tools=tools)
    if hasattr(r, "conversation"):  # harmony: the turn's messages, analysis kept
        import openai_harmony as oh

        conversation = r.conversation([*context, message], tools=tools)
        config = oh.RenderConversationConfig(auto_drop_analysis=False)
        full = r.encoding.render_conversation(conversation, config)
        ids = list(full[len(prompt) :])
        if not message.extra.get("tool_calls"):
            ids[-1] = 200002  # a final answer ends with <|return|>
    else:
        full = r.render([*context, message], tools=tools)
        ids = full[len(prompt) :]
    assert full[: len(prompt)] == prompt
    return ids


def written_id(name: str) -> str:
    return "a1B2c3D4e" if name in ("v3", "v11") else "call_1_0"


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tool_chain_is_append_only(name: str, request: Any) -> None:
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    r = family(name)
    reasoning = "Use the tool." if name in ("v13", "harmony") else None
    conversation = [user(QUESTION)]
    ids = r.render(conversation, tools=TOOLS)
    for turn in range(2):
        call_id = written_id(name) if name in ("v3", "v11") else f"call_{turn + 1}_0"
        message = assistant(calls=[(call_id, f"{turn}+1")], reasoning=reasoning)
        ids += turn_ids(r, message, TOOLS)
        parsed = r.parse(turn_ids(r, message, TOOLS))
        if name not in ("v3", "v11"):  # the agent numbers calls the model wrote no id for
            parsed = attrs.evolve(
                parsed, tool_calls=(attrs.evolve(parsed.tool_calls[0], id=call_id),)
            )
        conversation.append(parsed.to_message())
        reply = [tool(str(turn + 1), call_id)]
        bridge = r.bridge(ids, reply, tools=TOOLS, messages=conversation)
        conversation += reply
        assert bridge is not None, (name, turn)
        ids += bridge
        assert ids == r.render(conversation, tools=TOOLS)
    assert r.bridge(ids, [], tools=TOOLS) is None  # proved only on the conversation
    with pytest.raises(ValueError, match=r"new_messages\[0\] is an assistant message"):
        r.bridge(ids, [assistant("x")], tools=TOOLS, messages=conversation)


@pytest.mark.parametrize(
    ("name", "append_only"), [("v3", False), ("v11", False), ("v13", True), ("harmony", False)]
)
def test_a_new_user_message_after_an_answer(name: str, append_only: bool, request: Any) -> None:
    """Tools listed before the last user message (v3, v11) move; v13 lists them before the
    first; harmony's history ends an answer with <|end|>, not the <|return|> sampled."""
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    r = family(name)
    conversation = [user(QUESTION)]
    answer = assistant("It is 84.", reasoning="Multiply." if name in ("v13", "harmony") else None)
    ids = r.render(conversation, tools=TOOLS) + turn_ids(r, answer, TOOLS)
    conversation.append(r.parse(turn_ids(r, answer, TOOLS)).to_message())
    bridge = r.bridge(ids, [user("And 2 + 2?")], tools=TOOLS, messages=conversation)
    if append_only:
        assert bridge is not None
        assert ids + bridge == r.render([*conversation, user("And 2 + 2?")], tools=TOOLS)
    else:
        assert bridge is None


def test_a_bridge_keeps_the_ids_the_model_sampled(mc: Any) -> None:
    """The model wrote a stretch in other ids than the render's: the proof reads its
    text and special tokens, and the bridge is the render's rest."""
    r = _official.mistral("v11")
    conversation = [user(QUESTION)]
    message = assistant("It is 84.")
    canonical = turn_ids(r, message, None)
    text_ids = canonical[:-1]
    split = [token for piece in r.decode(text_ids) for token in r.encode(piece)]
    assert split != text_ids
    assert r.decode(split) == r.decode(text_ids)
    ids = r.render(conversation) + split + [2]
    conversation.append(message)
    bridge = r.bridge(ids, [user("Thanks.")], messages=conversation)
    full = r.render([*conversation, user("Thanks.")])
    assert bridge is not None
    assert bridge == full[len(full) - len(bridge) :]
    assert r.decode(ids + bridge) == r.decode(full)


# --------------------------------------------------------------------------- d. parsing


@pytest.mark.parametrize("name", FAMILIES)
def test_parse_reads_back_calls_reasoning_and_content(name: str, request: Any) -> None:
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    r = family(name)
    thinks = name in ("v13", "harmony")
    call_id = written_id(name)
    message = assistant(calls=[(call_id, "12*(3+4)")], reasoning="Use it." if thinks else None)
    turn = r.parse(turn_ids(r, message, TOOLS))
    (call,) = turn.tool_calls
    assert (call.name, call.arguments, turn.parse_error) == (
        "calculator",
        {"expression": "12*(3+4)"},
        None,
    )
    assert call.id == (call_id if name in ("v3", "v11") else "call_0")
    assert turn.reasoning == ("Use it." if thinks else None)
    answer = assistant("It is 84.", reasoning="Easy." if thinks else None)
    turn = r.parse(turn_ids(r, answer, None))
    assert (turn.content, turn.tool_calls, turn.reasoning) == (
        "It is 84.",
        (),
        "Easy." if thinks else None,
    )
    # Two calls in one turn (harmony: two messages; v13 and later: no ids).
    pair = assistant(calls=[(call_id, "1"), ("b1B2c3D4e" if name != "harmony" else "x", "2")])
    turn = r.parse(turn_ids(r, pair, TOOLS))
    assert [c.arguments for c in turn.tool_calls] == [{"expression": "1"}, {"expression": "2"}]


def test_harmony_parse_of_a_recipient_in_the_channel_and_of_broken_ids(oh: Any) -> None:
    r = _official.harmony()
    encoding = r.encoding
    written = (
        "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.calculator <|constrain|>json<|message|>{"expression":"1"}<|call|>'
    )
    turn = r.parse(encoding.encode(written, allowed_special="all"))
    assert turn.reasoning == "Need it."
    assert turn.tool_calls[0].name == "calculator"
    assert turn.tool_calls[0].raw == '{"expression":"1"}'
    broken = r.parse(
        encoding.encode('<|channel|>final<|message|>{"a"<|call|>', allowed_special="all")
    )
    assert broken.parse_error is None
    assert broken.content == '{"a"'
    call = r.parse(
        encoding.encode(
            "<|channel|>commentary to=functions.calculator<|message|>{nope<|call|>",
            allowed_special="all",
        )
    )
    assert call.tool_calls[0].arguments is None
    assert "tool call 0" in str(call.parse_error)
    cut = r.parse(encoding.encode("<|channel|>analysis<|message|>It is", allowed_special="all"))
    assert (cut.reasoning, cut.content) == ("It is", "")


def test_mistral_parse_of_a_cut_turn_and_a_made_up_id(mc: Any) -> None:
    r = _official.mistral("v11")
    calls_token = r.tokenizer.instruct_tokenizer.tokenizer.get_special_token("[TOOL_CALLS]")
    args_token = r.tokenizer.instruct_tokenizer.tokenizer.get_special_token("[ARGS]")
    ids = [calls_token, *r.encode("calculator"), args_token, *r.encode('{"expression": "1"}'), 2]
    (call,) = r.parse(ids).tool_calls
    assert (call.id, call.arguments) == ("call_0", {"expression": "1"})
    cut = r.parse(r.encode("It is"))
    assert (cut.content, cut.tool_calls) == ("It is", ())


# --------------------------------------------------------------------------- e. episodes


@attrs.frozen(kw_only=True)
class Plan:
    call: bool = False
    content: str = ""
    reasoning: str | None = None
    expression: str = "12*(3+4)"
    #: harmony only: the model writes the recipient in the channel (its usual way).
    recipient_in_channel: bool = False


@attrs.define(kw_only=True, eq=False)
class Model(InferenceInterface, ReturnsRaw, ReturnsLogProbs, AcceptsTokens):
    """A token-in model that writes each planned turn as the official renderer writes that
    message; it declares the renderer's vocabulary (an agent checks it)."""

    name: str
    plans: list[Plan]
    requests: list[tuple[list[int], list[int]]] = attrs.field(factory=list)

    @property
    def token_vocabulary(self) -> str | None:
        return str(family(self.name).token_vocabulary)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.sleep(0.25)
        assert request.prompt_ids is not None
        r = family(self.name)
        plan = self.plans[len(self.requests)]
        call_id = written_id(self.name)
        message = (
            assistant(calls=[(call_id, plan.expression)], reasoning=plan.reasoning)
            if plan.call
            else assistant(plan.content or "It is 84.", reasoning=plan.reasoning)
        )
        sampled = turn_ids(r, message, request.tools)
        if plan.recipient_in_channel:
            text = r.decode(sampled).replace(
                "<|start|>assistant to=functions.calculator<|channel|>commentary ",
                "<|start|>assistant<|channel|>commentary to=functions.calculator ",
            )
            if text.startswith(" to=functions.calculator<|channel|>commentary "):
                text = text.replace(
                    " to=functions.calculator<|channel|>commentary ",
                    "<|channel|>commentary to=functions.calculator ",
                    1,
                )
            sampled = r.encoding.encode(text, allowed_special="all")
        self.requests.append((list(request.prompt_ids), sampled))
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=r.decode(sampled)),
            raw_text=r.decode([*request.prompt_ids, *sampled]),
            token_ids=[*request.prompt_ids, *sampled],
            prompt_length=len(request.prompt_ids),
            logprobs=[-0.5] * len(sampled),
            finish_reason="stop",
        )


class Env(BaseEnvironment):
    """Answers a call with a tool message, any other turn with a user message."""

    def __init__(self, turns: int) -> None:
        super().__init__()
        self.tools = TOOLS
        self.turns = turns
        self.conversation: list[ChatMessage] = []
        self.parsed: list[AssistantTurn] = []
        self.seen: list[int] = []

    async def reset(self) -> Sequence[ChatMessage]:
        await trio.lowlevel.checkpoint()
        self.conversation = [user(QUESTION)]
        return list(self.conversation)

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        await trio.sleep(0.5)
        self.seen.append(len(self.conversation))
        self.parsed.append(turn)
        self.conversation.append(turn.to_message())
        if len(self.parsed) >= self.turns:
            return EnvironmentStep(done=True, reward=1.0)
        if turn.tool_calls:
            replies = [tool("84", call.id) for call in turn.tool_calls]
        else:
            replies = [user(f"And 2 + {len(self.parsed)}?")]
        self.conversation.extend(replies)
        return EnvironmentStep(messages=replies)


def run_episode(name: str, plans: list[Plan]) -> tuple[TokenRollout, Model, Env]:
    model = Model(name=name, plans=plans)
    envs: list[Env] = []

    def make(problem: Problem) -> Env:
        envs.append(Env(len(plans)))
        return envs[-1]

    agent = MultiTurnAgent(
        environment=make,
        renderer=family(name),
        prompts=PromptSource([Problem(problem_id="p0", prompt=QUESTION)], seed=0),
        max_turns=len(plans),
    )
    request = GroupedRolloutRequest(
        num_groups=1,
        rollouts_per_group=1,
        inference_interface=model,
        generation_args=GenerationArgs(max_tokens=512),
    )

    async def main() -> list[Any]:
        async with agent.get_grouped_rollouts(request) as stream:
            return list(await stream.receive())

    (rollout,) = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert isinstance(rollout, TokenRollout)
    return rollout, model, envs[0]


def check_episode(name: str, rollout: TokenRollout, model: Model, env: Env) -> int:
    """Every prompt is the official render of the conversation so far; every element is
    its last prompt plus its last turn; mask 1 exactly on sampled ids. The breaks."""
    r = family(name)
    breaks = 0
    previous: tuple[list[int], list[int]] | None = None
    for index, (prompt, sampled) in enumerate(model.requests):
        so_far = env.conversation[: env.seen[index]]
        assert prompt == r.render(so_far, tools=TOOLS), (name, index)
        if previous is not None:
            held = previous[0] + previous[1]
            breaks += prompt[: len(held)] != held
        previous = (prompt, sampled)
    assert rollout.extra["episode"]["breaks"] == breaks == len(rollout.trajectory) - 1
    last_prompt, last_sampled = model.requests[-1]
    assert rollout.trajectory[-1] == last_prompt + last_sampled
    assert rollout.generation_mask is not None
    sampled_total = sum(len(s) for _, s in model.requests)
    assert sum(sum(mask) for mask in rollout.generation_mask) == sampled_total
    assert rollout.fidelity == "exact"
    return breaks


@pytest.mark.parametrize("name", FAMILIES)
def test_a_multi_turn_tool_episode_is_token_exact(name: str, request: Any) -> None:
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    reasoning = "Use the tool." if name in ("v13", "harmony") else None
    plans = [
        Plan(call=True, reasoning=reasoning),
        Plan(call=True, expression="2 + 2", reasoning=reasoning),
        Plan(content="It is 84.", reasoning=reasoning),
    ]
    rollout, model, env = run_episode(name, plans)
    assert check_episode(name, rollout, model, env) == 0
    assert len(rollout.trajectory) == 1
    assert [t.tool_calls[0].arguments for t in env.parsed[:2]] == [
        {"expression": "12*(3+4)"},
        {"expression": "2 + 2"},
    ]
    assert env.parsed[2].content == "It is 84."
    assert env.parsed[0].reasoning == reasoning


#: Breaks in a 3-turn episode answered by user messages (with tools), per family.
USER_BREAKS = {"v3": 2, "v11": 2, "v13": 0, "harmony": 2}


@pytest.mark.parametrize("name", FAMILIES)
def test_an_episode_answered_by_user_messages(name: str, request: Any) -> None:
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    reasoning = "Think." if name in ("v13", "harmony") else None
    plans = [Plan(content=f"Answer {i}.", reasoning=reasoning) for i in range(3)]
    rollout, model, env = run_episode(name, plans)
    assert check_episode(name, rollout, model, env) == USER_BREAKS[name]


def test_gpt_oss_writing_the_recipient_in_the_channel_breaks_every_call(oh: Any) -> None:
    """harmony re-renders a call with its recipient after the role (``assistant
    to=functions.x<|channel|>commentary``): a model that wrote it in the channel
    (``<|channel|>commentary to=functions.x``) is rewritten, a break per call."""
    plans = [Plan(call=True, recipient_in_channel=True), Plan(call=True), Plan()]
    rollout, model, env = run_episode("harmony", plans)
    assert check_episode("harmony", rollout, model, env) == 1
    assert env.parsed[0].tool_calls[0].arguments == {"expression": "12*(3+4)"}


# --------------------------------------------------------------------------- f. vocabulary


@pytest.mark.parametrize("name", FAMILIES)
def test_the_vocabulary_is_the_hugging_face_tokenizers(name: str, request: Any) -> None:
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    r = family(name)
    hf = (
        _official.hf_gpt_oss()
        if name == "harmony"
        else _official.hf_mistral("v11" if name == "v13" else name)
    )
    if name == "v13":  # the same ids as v11's file: the same vocabulary
        assert r.token_vocabulary == _official.mistral("v11").token_vocabulary
    assert r.token_vocabulary == hf.token_vocabulary
    assert str(r.token_vocabulary).startswith("hf:")

    class Backend(ReturnsLogProbs):
        def __init__(self, vocabulary: str | None) -> None:
            self.vocabulary = vocabulary

        @property
        def token_vocabulary(self) -> str | None:
            return self.vocabulary

    check_vocabulary(r, Backend(hf.token_vocabulary), "MultiTurnAgent")
    with pytest.raises(TypeError, match=f"the renderer {type(r).__name__} writes"):
        check_vocabulary(r, Backend(CODE_POINTS), "MultiTurnAgent")


# --------------------------------------------------------------------------- g. vs HF


def first_difference(r: Any, official: list[int], hf: list[int]) -> str | None:
    """Where two id sequences part, with the text around it in each; ``None`` if equal."""
    if official == hf:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(official, hf, strict=False)) if a != b),
        min(len(official), len(hf)),
    )
    return (
        f"at id {at}: official …{r.decode(official[max(0, at - 6) : at + 14])!r}… "
        f"HF …{r.decode(hf[max(0, at - 6) : at + 14])!r}…"
    )


QUOTED = [
    {
        "type": "function",
        "function": {
            **TOOLS[0]["function"],
            "description": 'Evaluate an "arithmetic" expression.\nReturns a number.',
        },
    }
]
SYSTEM = ChatMessage(role="system", content="Be brief.")
CALL = assistant(calls=[("a1B2c3D4e", "2+2")])
#: name: (conversation, tools) compared in each family's vocabulary.
CONVERSATIONS: dict[str, tuple[list[ChatMessage], Any]] = {
    "plain": ([user(QUESTION)], None),
    "system": ([SYSTEM, user(QUESTION)], None),
    "system + tools": ([SYSTEM, user(QUESTION)], TOOLS),
    "tool call, number result": ([user(QUESTION), CALL, tool("84", "a1B2c3D4e")], TOOLS),
    "tool call, text result": ([user(QUESTION), CALL, tool("eighty-four", "a1B2c3D4e")], TOOLS),
    "tool call, JSON result": ([user(QUESTION), CALL, tool('{"value":84}', "a1B2c3D4e")], TOOLS),
    "system + tool call": ([SYSTEM, user(QUESTION), CALL, tool("84", "a1B2c3D4e")], TOOLS),
    "tool chain, answer, user": (
        [
            user(QUESTION),
            CALL,
            tool("84", "a1B2c3D4e"),
            assistant("It is 84."),
            user("And 2 + 2?"),
        ],
        TOOLS,
    ),
    "quoted tool description": ([user(QUESTION)], QUOTED),
    "reasoning, answer, user": (
        [user(QUESTION), assistant("It is 84.", reasoning="Multiply."), user("And 2 + 2?")],
        None,
    ),
    "system + content beside a call": (
        [SYSTEM, user(QUESTION), assistant("Let me check.", calls=[("a1B2c3D4e", "2+2")])],
        TOOLS,
    ),
}

#: The long default system prompt Mistral-Small 3.2's template writes when there is none.
DEFAULT_PROMPT = "[SYSTEM_PROMPT]You are Mistral Small 3"
#: family: {conversation: the measured difference (a substring of first_difference), or
#: None when the ids are the same, or "official refuses" / "HF refuses"}.
MEASURED: dict[str, dict[str, str | None]] = {
    # Mistral-Nemo (tokenizer v3) against its own template.
    "v3": {
        "plain": None,
        "system": None,
        "system + tools": None,
        "tool call, number result": None,
        # mistral-common writes a text result as a JSON string; the template unquoted.
        "tool call, text result": '"content": "eighty-four"',
        # mistral-common re-serialises a JSON result with json.dumps.
        "tool call, JSON result": '"content": {"value": 84}',
        # The template writes the system prompt only while the last user message is the
        # last message: once the model answered, it is gone. mistral-common keeps it.
        "system + tool call": "Be brief.\\n\\nWhat is",
        "tool chain, answer, user": None,
        # The template writes descriptions unescaped (invalid JSON).
        "quoted tool description": 'Evaluate an \\\\"arithmetic',
        "reasoning, answer, user": "official refuses",  # v3 has no [THINK]
        "system + content beside a call": "official refuses",  # v3: content or calls
    },
    # Mistral-Small-3.2 (tokenizer v11) against its own template: the template writes a
    # long default system prompt (with today's date) when the conversation has none,
    # mistral-common none.
    "v11": {
        "plain": DEFAULT_PROMPT,
        "system": None,
        "system + tools": None,
        "tool call, number result": DEFAULT_PROMPT,
        "tool call, text result": DEFAULT_PROMPT,
        "tool call, JSON result": DEFAULT_PROMPT,
        "system + tool call": None,
        "tool chain, answer, user": DEFAULT_PROMPT,
        "quoted tool description": DEFAULT_PROMPT,
        "reasoning, answer, user": "official refuses",  # v11 renders no reasoning
        # v11 writes the content beside the calls; the template drops it.
        "system + content beside a call": "[/INST]Let me check.[TOOL_CALLS]",
    },
    # gpt-oss against its template, the date set alike (the template always writes
    # today's date; harmony only a conversation_start_date).
    "harmony": {
        "plain": None,
        # The template ends the instructions with a blank line before <|end|> (when there
        # are no tools).
        "system": "Be brief.\\n\\n<|end|>",
        "system + tools": None,
        # The template writes a call's format as " json", harmony as " <|constrain|>json".
        "tool call, number result": "commentary <|constrain|>json",
        "tool call, text result": "commentary <|constrain|>json",
        "tool call, JSON result": "commentary <|constrain|>json",
        "system + tool call": "commentary <|constrain|>json",
        "tool chain, answer, user": "commentary <|constrain|>json",
        # harmony comments out every line of a description; the template the first only.
        "quoted tool description": "expression.\\n// Returns a number.",
        "reasoning, answer, user": None,
        # The template writes content beside a call on the analysis channel; here it is
        # a commentary preamble.
        "system + content beside a call": "<|channel|>commentary<|message|>Let me check.",
    },
}


def compare(name: str) -> dict[str, str | None]:
    if name == "harmony":
        today = datetime.datetime.now().strftime("%Y-%m-%d")  # the template's date
        r, hf = _official.harmony(conversation_start_date=today), _official.hf_gpt_oss()
    else:
        r, hf = _official.mistral(name), _official.hf_mistral(name)
    found: dict[str, str | None] = {}
    for label, (messages, tools) in CONVERSATIONS.items():
        try:
            official = r.render(messages, tools=tools)
        except ValueError:
            found[label] = "official refuses"
            continue
        try:
            theirs = hf.render(messages, tools=tools)
        except ValueError:
            found[label] = "HF refuses"
            continue
        found[label] = first_difference(r, official, theirs)
    return found


@pytest.mark.parametrize("name", ["v3", "v11", "harmony"])
def test_where_the_official_renders_differ_from_the_hf_templates(name: str, request: Any) -> None:
    request.getfixturevalue("oh" if name == "harmony" else "mc")
    found = compare(name)
    print(f"\n{name}: official renderer vs Hugging Face template, same vocabulary")
    for label, difference in found.items():
        print(f"  {label:28} {difference or 'same ids'}")
    for label, expected in MEASURED[name].items():
        difference = found[label]
        if expected is None or expected.endswith("refuses"):
            assert difference == expected, (name, label, difference)
        else:
            assert expected in str(difference), (name, label, difference)


def test_the_hf_templates_tool_output_differs_for_gpt_oss(oh: Any) -> None:
    """The template writes a tool's output as a JSON string (quoted); harmony as given."""
    r, hf = _official.harmony(), _official.hf_gpt_oss()
    conversation = [user(QUESTION), CALL, tool("84", "a1B2c3D4e")]
    assert "<|channel|>commentary<|message|>84<|end|>" in r.decode(
        r.render(conversation, tools=TOOLS)
    )
    assert '<|channel|>commentary<|message|>"84"<|end|>' in hf.decode(
        hf.render(conversation, tools=TOOLS)
    )


def test_a_missing_extra_is_an_import_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from trio_rollouts.renderers import HarmonyRenderer, MistralCommonRenderer

    monkeypatch.setitem(sys.modules, "openai_harmony", None)
    monkeypatch.setitem(sys.modules, "mistral_common.tokens.tokenizers.mistral", None)
    with pytest.raises(ImportError, match=r"HarmonyRenderer needs openai-harmony .*\[harmony\]"):
        HarmonyRenderer()
    with pytest.raises(ImportError, match=r"needs mistral-common .*trio-rollouts\[mistral\]"):
        MistralCommonRenderer.from_file("tekken.json")


def test_the_nemo_template_loses_the_system_prompt_once_the_model_answered(mc: Any) -> None:
    """A tool episode with a system prompt: append-only with mistral-common, a break at the
    first bridge with the template (it writes the system prompt only while the last user
    message is the last message). The templates drop content written beside calls."""
    official, template = _official.mistral("v3"), _official.hf_mistral("v3")
    start = [SYSTEM, user(QUESTION)]
    reply = [tool("84", "a1B2c3D4e")]
    for r, proved in ((official, True), (template, False)):
        ids = r.render(start, tools=TOOLS) + turn_ids(official, CALL, TOOLS)
        bridge = r.bridge(ids, reply, tools=TOOLS, messages=[*start, CALL])
        assert (bridge is not None) == proved, type(r).__name__
    beside = [*start, assistant("Let me check.", calls=[("a1B2c3D4e", "2+2")])]
    for version in ("v3", "v11"):
        hf = _official.hf_mistral(version)
        assert "Let me check." not in hf.decode(hf.render(beside, tools=TOOLS))
    v11 = _official.mistral("v11")
    assert "Let me check.[TOOL_CALLS]" in v11.decode(v11.render(beside, tools=TOOLS))


def test_with_a_system_message_small_3_2_matches_its_template(mc: Any) -> None:
    """Every conversation, a system message first: mistral-common's v11 and the
    Mistral-Small 3.2 template agree but where the template drops content beside calls."""
    r, hf = _official.mistral("v11"), _official.hf_mistral("v11")
    differ = []
    for label, (messages, tools) in CONVERSATIONS.items():
        if label.startswith("reasoning"):
            continue  # v11 renders no reasoning
        if messages[0].role != "system":
            messages = [SYSTEM, *messages]
        if r.render(messages, tools=tools) != hf.render(messages, tools=tools):
            differ.append(label)
    assert differ == ["system + content beside a call"]
