"""The tool-call and reasoning formats by the names vLLM gives its parsers, and which
family a chat template belongs to.

Detection reads the template's text for markers only one family writes; where none or
several families' markers appear it detects nothing, and the renderer asks for the
parser by name.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from trio_rollouts.renderers import (
    deepseek_v3,
    glm45,
    hermes,
    kimi_k2,
    llama3_json,
    mistral,
    openai,
    phi4_mini_json,
    pythonic,
    qwen3_coder,
)
from trio_rollouts.renderers._base import ToolCall
from trio_rollouts.renderers._think import think

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "Family", "detect"]

ToolParser = Callable[[str], tuple[str, list[ToolCall]]]
ReasoningParser = Callable[..., tuple[str | None, str]]

#: Tool-call formats by vLLM's ``--tool-call-parser`` names.
TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": hermes.parse,
    "llama3_json": llama3_json.parse,
    "mistral": mistral.parse,
    "openai": openai.parse,
    "glm45": glm45.parse,
    "kimi_k2": kimi_k2.parse,
    "deepseek_v3": deepseek_v3.parse,
    "deepseek_v31": deepseek_v3.parse_v31,
    "pythonic": pythonic.parse,
    "qwen3_coder": qwen3_coder.parse,
    "phi4_mini_json": phi4_mini_json.parse,
}

#: Reasoning formats by vLLM's ``--reasoning-parser`` names.
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": think,
    "qwen3": think,
    "glm45": think,
    "kimi_k2": think,
    "openai_gptoss": openai.reasoning,
    "mistral": mistral.reasoning,
}

#: Where each reasoning format's block opens (to tell whether a generation prompt
#: opened it).
REASONING_OPENINGS = {
    "deepseek_r1": "<think>",
    "qwen3": "<think>",
    "glm45": "<think>",
    "kimi_k2": "<think>",
    "mistral": "[THINK]",
    "openai_gptoss": "<|channel|>analysis",
}


@attrs.frozen
class Family:
    """What a template's markers say: its tool-call and reasoning formats, and the
    tokens besides the end-of-turn that end a generation."""

    name: str
    tool_parser: str
    reasoning_parser: str | None
    stop_tokens: tuple[str, ...] = ()


#: Families in the order they are tried; the first whose markers are all in the
#: template wins, unless a later one's are too (then nothing is detected).
_FAMILIES: tuple[tuple[tuple[str, ...], Family], ...] = (
    (
        ("<|channel|>", "<|message|>"),
        Family("gpt-oss", "openai", "openai_gptoss", ("<|call|>", "<|return|>")),
    ),
    (("[TOOL_CALLS]",), Family("mistral", "mistral", None, ("</s>",))),
    (("<|tool_calls_section_begin|>",), Family("kimi-k2", "kimi_k2", None, ("<|im_end|>",))),
    (
        ("<｜tool▁sep｜>", "```json"),
        Family("deepseek-v3", "deepseek_v3", None, ("<｜end▁of▁sentence｜>",)),
    ),
    (
        ("<｜tool▁sep｜>",),
        Family("deepseek-v3.1", "deepseek_v31", None, ("<｜end▁of▁sentence｜>",)),
    ),
    (
        ("<arg_key>",),
        Family("glm-4.5", "glm45", "glm45", ("<|user|>", "<|observation|>", "<|endoftext|>")),
    ),
    (
        ("<function=", "<parameter="),
        Family("qwen3-coder", "qwen3_coder", None, ("<|im_end|>", "<|endoftext|>")),
    ),
    (("functools[",), Family("phi-4-mini", "phi4_mini_json", None, ("<|end|>", "<|endoftext|>"))),
    (
        ("<|python_tag|>",),
        Family("llama-3", "llama3_json", None, ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")),
    ),
    (
        ('"parameters"', "<|start_header_id|>"),
        Family("llama-3", "llama3_json", None, ("<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")),
    ),
    (
        ("<tool_call>",),
        Family("hermes", "hermes", None, ("<|im_end|>", "<|endoftext|>", "<|end_of_text|>")),
    ),
)

#: Reasoning markers, looked for apart from the tool format: ``<think>`` in a ChatML
#: template is Qwen3's, elsewhere DeepSeek-R1's (the same format under vLLM's names).
_REASONING: tuple[tuple[tuple[str, ...], str], ...] = (
    (("[THINK]",), "mistral"),
    (("<think>", "<|im_start|>"), "qwen3"),
    (("<think>",), "deepseek_r1"),
)


def detect(template: str) -> Family | None:
    """The family whose markers the template writes, or ``None`` when no family's do or
    the markers are not one family's."""
    found = [family for markers, family in _FAMILIES if all(m in template for m in markers)]
    if not found or not _nested(found):
        return None
    family = found[0]
    if family.reasoning_parser is None:
        for markers, name in _REASONING:
            if all(marker in template for marker in markers):
                family = attrs.evolve(family, reasoning_parser=name)
                break
    return family


def _nested(found: list[Family]) -> bool:
    """Whether the formats found are one family's seen through more general markers
    (GLM and Qwen3-Coder also write ``<tool_call>``; DeepSeek V3 matches V3.1's marker;
    Llama 3's two marker sets)."""
    general = {"hermes", "deepseek_v31", "llama3_json"}
    first = found[0].tool_parser
    return all(family.tool_parser in general or family.tool_parser == first for family in found[1:])
