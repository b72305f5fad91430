"""Renderers: one model family's chat template, in token ids.

A multi-turn episode is a token stream, not a message list: the ids the model sampled are
kept verbatim, and only what comes between two assistant turns (the environment's
messages and the next generation prompt) is rendered. A :class:`Renderer` renders a
conversation to ids, gives the ids to append after a finished assistant turn
(:meth:`Renderer.bridge`, proved on the conversation at hand), and parses a turn's ids
into an :class:`AssistantTurn` without ever rendering it again.

:class:`PlainRenderer` needs no dependency: its ids are Unicode code points and its layout
is :func:`~trio_rollouts.inference.render_plain_chat`'s, so it matches
:class:`~trio_rollouts.inference.EmbeddedInference`'s tokens exactly. :class:`HFRenderer`
renders with a Hugging Face tokenizer's chat template and reads each family's tool calls
and reasoning (``TOOL_PARSERS``, ``REASONING_PARSERS``: one small module per format,
named as vLLM names its parsers). :class:`MistralCommonRenderer` and :class:`HarmonyRenderer`
are the official renderings of Mistral's models (``mistral-common``, extra ``[mistral]``) and
of gpt-oss (``openai-harmony``, extra ``[harmony]``), what vLLM serves those models with.
"""

from trio_rollouts.renderers._base import AssistantTurn as AssistantTurn
from trio_rollouts.renderers._base import Renderer as Renderer
from trio_rollouts.renderers._base import ToolCall as ToolCall
from trio_rollouts.renderers._families import REASONING_PARSERS as REASONING_PARSERS
from trio_rollouts.renderers._families import TOOL_PARSERS as TOOL_PARSERS
from trio_rollouts.renderers._families import Family as Family
from trio_rollouts.renderers._families import detect as detect_family
from trio_rollouts.renderers.harmony import HarmonyRenderer as HarmonyRenderer
from trio_rollouts.renderers.hf import HFRenderer as HFRenderer
from trio_rollouts.renderers.hf import tokenizer_vocabulary as tokenizer_vocabulary
from trio_rollouts.renderers.mistral_common import MistralCommonRenderer as MistralCommonRenderer
from trio_rollouts.renderers.plain import PlainRenderer as PlainRenderer

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "AssistantTurn",
    "Family",
    "HFRenderer",
    "HarmonyRenderer",
    "MistralCommonRenderer",
    "PlainRenderer",
    "Renderer",
    "ToolCall",
    "detect_family",
    "tokenizer_vocabulary",
]
