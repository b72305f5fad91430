# ruff: noqa: RUF001  (DeepSeek's special tokens are written with fullwidth bars)
"""Every tool-call format of ``TOOL_PARSERS`` and reasoning format of ``REASONING_PARSERS``,
on turns written as each family's model writes them (the formats of the real templates
in ``tests/data/chat_templates`` and of vLLM's ``vllm/tool_parsers``), and
``detect_family`` on every real template.

The tool-call tests go through :meth:`HFRenderer.parse` with the parser named (the turn
text encoded by an offline tokenizer), so a broken call's error is seen as the episode
sees it: on the call (``ToolCall.parse_error``, ``raw`` kept) and on the turn
(``AssistantTurn.parse_error`` naming the call's index).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_rollouts import HFRenderer
from trio_rollouts.renderers import REASONING_PARSERS, TOOL_PARSERS, detect_family

pytest.importorskip("transformers", reason="the hf extra is not installed")
import _families

EXPR = "2 * (3 + 4)"
ARGS = {"expression": EXPR}
#: The arguments as the OpenAI wire form writes them: a JSON string holding the object.
ARGS_STRING = json.dumps(json.dumps(ARGS))
ARGS_OBJECT = json.dumps(ARGS)
#: In an expected id: one the parser made up in Mistral's shape (nine letters and
#: digits, as Mistral's templates require).


def renderer(tool_parser: str) -> HFRenderer:
    """A renderer reading ``tool_parser``'s format (and no reasoning)."""
    return HFRenderer(
        _families.tokenizer("qwen2.5"), tool_parser=tool_parser, reasoning_parser=None
    )


def parse(tool_parser: str, text: str) -> Any:
    r = renderer(tool_parser)
    ids = r.encode(text)
    assert r.decode(ids) == text  # the offline tokenizer keeps every text as written
    return r.parse(ids)


# ----------------------------------------------------------------------- valid calls

#: (format, text, content, [(id, name, arguments)]): each format's calls as its models
#: write them, arguments as an object and as a JSON string holding one.
VALID: list[tuple[str, str, str, list[tuple[str, str, dict[str, Any]]]]] = [
    (
        "hermes",
        f'I will compute it.\n<tool_call>\n{{"name": "calculator", "arguments": {ARGS_OBJECT}}}\n</tool_call>',
        "I will compute it.",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "hermes",
        f'<tool_call>\n{{"name": "calculator", "arguments": {ARGS_STRING}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>',
        "",
        [("call_0", "calculator", ARGS), ("call_1", "clock", {})],
    ),
    (
        "llama3_json",
        f'{{"name": "calculator", "parameters": {ARGS_OBJECT}}}',
        "",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "calculator", "arguments": {ARGS_STRING}}}; '
        '{"name": "clock", "parameters": {}}',
        "",
        [("call_0", "calculator", ARGS), ("call_1", "clock", {})],
    ),
    ("llama3_json", "It is 14.", "It is 14.", []),
    # Mistral tokenizer v3 (Mistral-Nemo): a JSON list, the model writes 9-char ids.
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "calculator", "arguments": {ARGS_OBJECT}, "id": "a1B2c3D4e"}}, '
        f'{{"name": "calculator", "arguments": {ARGS_STRING}, "id": "Z9y8X7w6V"}}]',
        "",
        [("a1B2c3D4e", "calculator", ARGS), ("Z9y8X7w6V", "calculator", ARGS)],
    ),
    # v11 (Mistral-Small 3.2): name[ARGS]{...}, with or without [CALL_ID].
    (
        "mistral",
        f"Let me check.[TOOL_CALLS]calculator[ARGS]{ARGS_OBJECT}",
        "Let me check.",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "mistral",
        f"[TOOL_CALLS]calculator[CALL_ID]a1B2c3D4e[ARGS]{ARGS_OBJECT}"
        f"[TOOL_CALLS]calculator[ARGS]{ARGS_STRING}",
        "",
        [("a1B2c3D4e", "calculator", ARGS), ("call_1", "calculator", ARGS)],
    ),
    # gpt-oss harmony, as generated after the prompt's "<|start|>assistant".
    (
        "openai",
        "<|channel|>analysis<|message|>The user wants arithmetic.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
        f"<|message|>{ARGS_OBJECT}<|call|>",
        "",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "openai",
        f"<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{ARGS_STRING}<|call|>",
        "",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is 14.<|return|>",
        "It is 14.",
        [],
    ),
    # GLM-4.5/4.6: values as the template writes them (strings unquoted, others JSON).
    (
        "glm45",
        f"Computing.\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{EXPR}</arg_value>\n</tool_call>",
        "Computing.",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "glm45",
        '<tool_call>lookup\n<arg_key>query</arg_key>\n<arg_value>{"city": "Paris"}</arg_value>\n'
        "<arg_key>limit</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "",
        [("call_0", "lookup", {"query": {"city": "Paris"}, "limit": 3})],
    ),
    # Kimi-K2: the written id is the call's id.
    (
        "kimi_k2",
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
        f"<|tool_call_argument_begin|>{ARGS_OBJECT}<|tool_call_end|>"
        "<|tool_call_begin|>functions.calculator:1"
        f"<|tool_call_argument_begin|>{ARGS_STRING}<|tool_call_end|><|tool_calls_section_end|>",
        "Sure.",
        [
            ("functions.calculator:0", "calculator", ARGS),
            ("functions.calculator:1", "calculator", ARGS),
        ],
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
        f"```json\n{ARGS_OBJECT}\n```<｜tool▁call▁end｜>\n"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
        f"```json\n{ARGS_STRING}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("call_0", "calculator", ARGS), ("call_1", "calculator", ARGS)],
    ),
    (
        "deepseek_v31",
        "Let me compute.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>"
        f"{ARGS_OBJECT}<｜tool▁call▁end｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>"
        f"{ARGS_STRING}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Let me compute.",
        [("call_0", "calculator", ARGS), ("call_1", "calculator", ARGS)],
    ),
    # Pythonic: keyword arguments are the object; the format has no JSON-string form.
    (
        "pythonic",
        f'[calculator(expression="{EXPR}"), clock()]',
        "",
        [("call_0", "calculator", ARGS), ("call_1", "clock", {})],
    ),
    ("pythonic", "[1, 2] is a list.", "[1, 2] is a list.", []),
    # Qwen3-Coder: XML parameters (no JSON-string form either).
    (
        "qwen3_coder",
        f"Computing.\n\n<tool_call>\n<function=calculator>\n<parameter=expression>\n{EXPR}\n"
        "</parameter>\n</function>\n</tool_call>",
        "Computing.",
        [("call_0", "calculator", ARGS)],
    ),
    (
        "phi4_mini_json",
        f'functools[{{"name": "calculator", "arguments": {ARGS_OBJECT}}}, '
        f'{{"name": "calculator", "parameters": {ARGS_STRING}}}]',
        "",
        [("call_0", "calculator", ARGS), ("call_1", "calculator", ARGS)],
    ),
]


def test_every_tool_format_is_covered() -> None:
    assert {case[0] for case in VALID} == set(TOOL_PARSERS)
    assert {case[0] for case in BROKEN} == set(TOOL_PARSERS)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), VALID)
def test_a_valid_call_is_read_with_its_name_arguments_and_id(
    fmt: str, text: str, content: str, calls: list[tuple[str, str, dict[str, Any]]]
) -> None:
    turn = parse(fmt, text)
    assert turn.content == content
    assert turn.parse_error is None
    ids = [c.id for c in turn.tool_calls]
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [c[1:] for c in calls]
    # A call whose format carries no id gets call_<index> (the agent makes it unique in
    # the episode; HFRenderer writes it as Mistral's templates want it).
    assert ids == [want for want, _, _ in calls]
    for call in turn.tool_calls:
        assert call.parse_error is None
        assert call.raw
    message = turn.to_message()
    if calls:
        wire = message.extra["tool_calls"]
        assert [json.loads(c["function"]["arguments"]) for c in wire] == [c[2] for c in calls]
        assert [c["function"]["name"] for c in wire] == [c[1] for c in calls]
    else:
        assert "tool_calls" not in message.extra


# ----------------------------------------------------------------------- broken calls

GOOD_HERMES = f'<tool_call>\n{{"name": "calculator", "arguments": {ARGS_OBJECT}}}\n</tool_call>'
GOOD_GLM = f"<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>{EXPR}</arg_value>\n</tool_call>"
GOOD_KIMI = (
    "<|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>"
    f"{ARGS_OBJECT}<|tool_call_end|>"
)
GOOD_V3 = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
    f"```json\n{ARGS_OBJECT}\n```<｜tool▁call▁end｜>"
)
GOOD_V31 = f"<｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{ARGS_OBJECT}<｜tool▁call▁end｜>"
GOOD_CODER = (
    f"<tool_call>\n<function=calculator>\n<parameter=expression>\n{EXPR}\n</parameter>\n"
    "</function>\n</tool_call>"
)

#: (format, text, index of the broken call, its name as read or None, its raw text).
BROKEN: list[tuple[str, str, int, str | None, str]] = [
    (
        "hermes",
        GOOD_HERMES + '<tool_call>{"name": calculator}</tool_call>',
        1,
        None,
        '{"name": calculator}',
    ),
    (
        "hermes",
        GOOD_HERMES + '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
        1,
        "calculator",
        '{"name": "calculator", "arguments": [1]}',
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": "2+2"}</tool_call>',
        0,
        "calculator",
        '{"name": "calculator", "arguments": "2+2"}',
    ),
    (
        "hermes",
        '<tool_call>{"name": "calculator", "arguments": "[1, 2]"}</tool_call>',
        0,
        "calculator",
        '{"name": "calculator", "arguments": "[1, 2]"}',
    ),
    # A turn cut inside its call.
    (
        "hermes",
        GOOD_HERMES + '\n<tool_call>\n{"name": "calculator", "argu',
        1,
        None,
        '\n{"name": "calculator", "argu',
    ),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', 0, None, '{"arguments": {}}'),
    (
        "llama3_json",
        '{"name": "calculator", "parameters": {"expression": "2+',
        0,
        None,
        '{"name": "calculator", "parameters": {"expression": "2+',
    ),
    (
        "llama3_json",
        f'{{"name": "calculator", "parameters": {ARGS_OBJECT}}}; {{"name": 3, "parameters": {{}}}}',
        1,
        None,
        '{"name": 3, "parameters": {}}',
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression"',
        0,
        None,
        '[{"name": "calculator", "arguments": {"expression"',
    ),
    (
        "mistral",
        f'[TOOL_CALLS]calculator[ARGS]{ARGS_OBJECT}[TOOL_CALLS]calculator{{"expression": "1"}}',
        1,
        None,
        'calculator{"expression": "1"}',
    ),
    (
        "mistral",
        '[TOOL_CALLS]calculator[CALL_ID]a1B2c3D4e[ARGS]{"expression": ',
        0,
        "calculator",
        'calculator[CALL_ID]a1B2c3D4e[ARGS]{"expression": ',
    ),
    (
        "openai",
        "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
        '{"expression": 2+2}<|call|>',
        0,
        "calculator",
        '{"expression": 2+2}',
    ),
    (
        "openai",
        f"<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{ARGS_OBJECT}"
        "<|end|><|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
        '<|message|>"2+2"<|call|>',
        1,
        "calculator",
        '"2+2"',
    ),
    (
        "glm45",
        GOOD_GLM + "\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2",
        1,
        "calculator",
        "calculator\n<arg_key>expression</arg_key>\n<arg_value>2",
    ),
    (
        "glm45",
        "<tool_call>\n<arg_key>expression</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        0,
        None,
        "\n<arg_key>expression</arg_key>\n<arg_value>1</arg_value>\n",
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|>" + GOOD_KIMI + "<|tool_call_begin|>functions.calculator:1"
        '<|tool_call_argument_begin|>{"expression": 2+2}<|tool_call_end|><|tool_calls_section_end|>',
        1,
        "calculator",
        "<|tool_call_begin|>functions.calculator:1"
        '<|tool_call_argument_begin|>{"expression": 2+2}<|tool_call_end|>',
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
        '<|tool_call_argument_begin|>{"expression": "2',
        0,
        "calculator",
        '<|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>{"expression": "2',
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜>" + GOOD_V3 + "<｜tool▁call▁begin｜>function calculator\n"
        "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        1,
        None,
        "function calculator\n```json\n{}\n```",
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
        '```json\n{"expression": 2+2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        0,
        "calculator",
        'function<｜tool▁sep｜>calculator\n```json\n{"expression": 2+2}\n```',
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜>" + GOOD_V31 + "<｜tool▁call▁begin｜>calculator<｜tool▁sep｜>"
        '{"expression": "2',
        1,
        "calculator",
        'calculator<｜tool▁sep｜>{"expression": "2',
    ),
    (
        "deepseek_v31",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>[1]"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        0,
        "calculator",
        "calculator<｜tool▁sep｜>[1]",
    ),
    (
        "pythonic",
        f'[calculator(expression="{EXPR}"), calculator("1")]',
        1,
        "calculator",
        'calculator("1")',
    ),
    ("pythonic", "[calculator(expression=x)]", 0, "calculator", "calculator(expression=x)"),
    ("pythonic", '[1, calculator(expression="1")]', 0, None, "1"),
    ("pythonic", '[calculator(expression="1"))]', 0, None, '[calculator(expression="1"))]'),
    (
        "qwen3_coder",
        GOOD_CODER + "\n<tool_call>\n<function=calculator>\n<parameter=expression>\n1",
        1,
        "calculator",
        "\n<function=calculator>\n<parameter=expression>\n1",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<parameter=expression>\n1\n</parameter>\n</tool_call>",
        0,
        None,
        "\n<parameter=expression>\n1\n</parameter>\n",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</tool_call>",
        0,
        "calculator",
        "\n<function=calculator>\n<parameter=expression>\n1\n</parameter>\n",
    ),
    (
        "phi4_mini_json",
        'functools[{"name": "calculator", "arguments": {"expression": "1"',
        0,
        None,
        '[{"name": "calculator", "arguments": {"expression": "1"',
    ),
]


@pytest.mark.parametrize(("fmt", "text", "index", "name", "raw"), BROKEN)
def test_a_broken_call_keeps_its_raw_text_and_is_named_on_the_turn(
    fmt: str, text: str, index: int, name: str | None, raw: str
) -> None:
    turn = parse(fmt, text)
    call = turn.tool_calls[index]
    assert call.arguments is None
    assert call.parse_error
    assert call.name == name
    assert call.raw == raw
    assert turn.parse_error is not None
    assert f"tool call {index}: {call.parse_error}" in turn.parse_error
    others = [i for i, c in enumerate(turn.tool_calls) if i != index]
    for i in others:
        assert turn.tool_calls[i].parse_error is None
        assert f"tool call {i}" not in turn.parse_error
    # The structured message carries the raw text as the broken call's arguments.
    wire = turn.to_message().extra["tool_calls"][index]
    assert wire["function"]["arguments"] == raw
    assert wire["function"]["name"] == (name or "")


def test_a_turn_with_several_broken_calls_names_each() -> None:
    text = (
        '<tool_call>{"name": 1}</tool_call>'
        + GOOD_HERMES
        + '<tool_call>{"name": "calculator", "arguments": 3}</tool_call>'
    )
    turn = parse("hermes", text)
    assert turn.parse_error == (
        f"tool call 0: {turn.tool_calls[0].parse_error}; tool call 2: {turn.tool_calls[2].parse_error}"
    )
    assert turn.tool_calls[1].arguments == ARGS


@pytest.mark.parametrize(
    ("fmt", "text", "raw"),
    [
        (
            "mistral",
            '[TOOL_CALLS][{"name":"calculator","arguments":[1],"id":"a1B2c3D4e"}]',
            '{"name":"calculator","arguments":[1],"id":"a1B2c3D4e"}',
        ),
        (
            "phi4_mini_json",
            'functools[{"name":"calculator","arguments":[1]}]',
            '{"name":"calculator","arguments":[1]}',
        ),
    ],
)
def test_a_list_formats_broken_item_keeps_the_text_as_sampled(
    fmt: str, text: str, raw: str
) -> None:
    call = parse(fmt, text).tool_calls[0]
    assert call.parse_error is not None
    assert call.raw == raw


def test_a_pythonic_call_with_an_unhashable_literal_is_a_broken_call() -> None:
    turn = parse("pythonic", "[calculator(expression={[1]: 2})]")
    assert turn.tool_calls[0].parse_error is not None


def test_a_harmony_call_addressed_in_the_role_part_of_the_header() -> None:
    text = (
        "<|channel|>analysis<|message|>Need the tool.<|end|>"
        f"<|start|>assistant to=functions.calculator<|channel|>commentary json<|message|>{ARGS_OBJECT}<|call|>"
    )
    turn = parse("openai", text)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("calculator", ARGS)]


def test_a_glm_value_that_reads_as_json_is_not_a_string() -> None:
    # The template writes strings unquoted, so a string argument "12" comes back as the
    # number 12 (the parser has no schema to tell): a known limit of the format.
    turn = parse(
        "glm45",
        "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>12</arg_value>\n</tool_call>",
    )
    assert turn.tool_calls[0].arguments == {"expression": 12}


# ----------------------------------------------------------------------- reasoning

THINK_FORMATS = ["deepseek_r1", "qwen3", "glm45", "kimi_k2"]

#: (format, text, opened, reasoning, rest).
REASONING: list[tuple[str, str, bool, str | None, str]] = [
    *[
        case
        for fmt in THINK_FORMATS
        for case in [
            (
                fmt,
                "<think>\nAdd 3 and 4.\n</think>\n\nIt is 14.",
                False,
                "Add 3 and 4.",
                "It is 14.",  # the newlines around the block are the template's
            ),
            (fmt, "Add 3 and 4.\n</think>\n\nIt is 14.", True, "Add 3 and 4.", "It is 14."),
            (fmt, "It is 14.", False, None, "It is 14."),
            # Cut inside the block: it runs to the end, nothing is content.
            (fmt, "<think>\nAdd 3 and", False, "Add 3 and", ""),
            (fmt, "Add 3 and", True, "Add 3 and", ""),
            # A block after the content is not the turn's reasoning.
            (fmt, "It is 14. <think>x</think>", False, None, "It is 14. <think>x</think>"),
        ]
    ],
    ("mistral", "[THINK]Add 3 and 4.[/THINK]It is 14.", False, "Add 3 and 4.", "It is 14."),
    ("mistral", "Add 3 and 4.[/THINK]It is 14.", True, "Add 3 and 4.", "It is 14."),
    ("mistral", "It is 14.", False, None, "It is 14."),
    ("mistral", "[THINK]Add 3", False, "Add 3", ""),
    (
        "openai_gptoss",
        "<|channel|>analysis<|message|>Add 3 and 4.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is 14.<|return|>",
        False,
        "Add 3 and 4.",
        "<|start|>assistant<|channel|>final<|message|>It is 14.<|return|>",
    ),
    (
        "openai_gptoss",
        "<|channel|>final<|message|>It is 14.<|return|>",
        False,
        None,
        "<|channel|>final<|message|>It is 14.<|return|>",
    ),
    ("openai_gptoss", "<|channel|>analysis<|message|>Add 3 and", False, "Add 3 and", ""),
]


def test_every_reasoning_format_is_covered() -> None:
    assert {case[0] for case in REASONING} == set(REASONING_PARSERS)


@pytest.mark.parametrize(("fmt", "text", "opened", "reasoning", "rest"), REASONING)
def test_reasoning_is_split_off(
    fmt: str, text: str, opened: bool, reasoning: str | None, rest: str
) -> None:
    assert REASONING_PARSERS[fmt](text, opened=opened) == (reasoning, rest)


@pytest.mark.parametrize(
    ("reasoning_parser", "tool_parser", "text", "reasoning", "content", "name"),
    [
        (
            "qwen3",
            "hermes",
            f"<think>\nUse the tool.\n</think>\n\n{GOOD_HERMES}",
            "Use the tool.",
            "",
            "calculator",
        ),
        (
            "glm45",
            "glm45",
            f"\n<think>Use the tool.</think>\n{GOOD_GLM}",
            "Use the tool.",
            "",
            "calculator",
        ),
        (
            "mistral",
            "mistral",
            f"[THINK]Use the tool.[/THINK]Sure.[TOOL_CALLS]calculator[ARGS]{ARGS_OBJECT}",
            "Use the tool.",
            "Sure.",
            "calculator",
        ),
        (
            "openai_gptoss",
            "openai",
            "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>"
            f"commentary to=functions.calculator <|constrain|>json<|message|>{ARGS_OBJECT}<|call|>",
            "Use the tool.",
            "",
            "calculator",
        ),
        # A call inside the reasoning is thought, not a call.
        (
            "qwen3",
            "hermes",
            f"<think>\n{GOOD_HERMES}\n</think>\n\nNo call.",
            GOOD_HERMES,
            "No call.",
            None,
        ),
    ],
)
def test_the_renderer_splits_reasoning_before_reading_calls(
    reasoning_parser: str,
    tool_parser: str,
    text: str,
    reasoning: str,
    content: str,
    name: str | None,
) -> None:
    r = HFRenderer(
        _families.tokenizer("qwen2.5"), tool_parser=tool_parser, reasoning_parser=reasoning_parser
    )
    turn = r.parse(r.encode(text) + r.close_ids)
    assert turn.reasoning == reasoning
    assert turn.content == content
    assert [c.name for c in turn.tool_calls] == ([name] if name else [])
    assert turn.to_message().extra["reasoning_content"] == reasoning


# ----------------------------------------------------------------------- detection

#: Where detect_family differs from the manifest's vLLM parser names, and why. Every
#: entry is checked, so the table stays what the code does.
DETECTION_DIFFERENCES: dict[str, dict[str, tuple[str | None, str | None]]] = {
    # {family: {field: (detected, manifest)}}
    "deepseek-r1-distill": {"tool_parser": ("deepseek_v3", None)},  # vLLM has none for it
    # <think> in a ChatML template reads as qwen3; QwQ's and SmolLM3's generation prompt
    # opens the block, which vLLM reads with deepseek_r1: the same function here.
    "qwq": {"reasoning_parser": ("qwen3", "deepseek_r1")},
    "smollm3": {"reasoning_parser": ("qwen3", "deepseek_r1")},
    # vLLM's deepseek_v3 reasoning parser is no name the library has.
    "deepseek-v3.1": {"reasoning_parser": ("deepseek_r1", "deepseek_v3")},
    # This (early) Kimi-K2 template writes no tool-call markers at all.
    "kimi-k2": {"tool_parser": (None, "kimi_k2")},
    # Phi-4-mini's template writes no functools marker.
    "phi4-mini": {"tool_parser": (None, "phi4_mini_json")},
}


def _manifest_families() -> list[str]:
    return sorted(_families.manifest())


@pytest.mark.parametrize("family", _manifest_families())
def test_detect_family_on_the_real_templates(family: str) -> None:
    entry = _families.manifest()[family]
    detected = detect_family(_families.template_text(family))
    got = {
        "tool_parser": detected.tool_parser if detected else None,
        "reasoning_parser": detected.reasoning_parser if detected else None,
    }
    want = {
        "tool_parser": entry["vllm_tool_parser"],
        "reasoning_parser": entry["vllm_reasoning_parser"],
    }
    differences = {field: (got[field], want[field]) for field in got if got[field] != want[field]}
    assert differences == DETECTION_DIFFERENCES.get(family, {})
    # Every difference is a name the library lacks or a template without the markers.
    for field, (_, manifest_name) in differences.items():
        names = TOOL_PARSERS if field == "tool_parser" else REASONING_PARSERS
        if manifest_name in names and got[field] is not None:
            # Same format under another name: the two must parse alike.
            assert REASONING_PARSERS[got[field]] is REASONING_PARSERS[manifest_name]


def test_the_manifest_is_there() -> None:
    assert len(_families.manifest()) >= 10
