"""What the official renderers share: the optional import, the bridge proof in ids, the
conversation's tool schemas and calls read with errors that name the field, and the
vocabulary fingerprint a Hugging Face tokenizer of the same vocabulary has.

:class:`~trio_rollouts.renderers.MistralCommonRenderer` and
:class:`~trio_rollouts.renderers.HarmonyRenderer` render in ids (their libraries never
write the conversation as text), so the proof of a bridge is made on ids: the official
render of the whole conversation must start with the episode's ids (the common case, every
id the same), or, where the model wrote a stretch in other ids than the render's, with
ids whose text and special tokens are the same up to a point where both have the
episode's last id. The bridge is the rest of the official render, as it is.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trio_rollouts._messages import ChatMessage
from trio_rollouts.renderers._base import refuse_assistant_messages
from trio_rollouts.renderers.hf import tokenizer_vocabulary

__all__ = [
    "VocabularyMap",
    "byte_level",
    "extension",
    "function_calls",
    "import_extra",
    "tool_functions",
]


#: The distribution each optional extra of the official renderers installs.
_DISTRIBUTIONS = {"mistral": "mistral-common", "harmony": "openai-harmony"}


def import_extra(module: str, extra: str, who: str) -> Any:
    """``module``, imported (typed ``Any``: these libraries are optional, and the type
    checker runs where they may be absent); an ``ImportError`` naming ``who``, the
    library and the extra that installs it otherwise."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        library = _DISTRIBUTIONS.get(extra, module)
        msg = (
            f"{who} needs {library} ({module} could not be imported: {error}): "
            f"pip install 'trio-rollouts[{extra}]'"
        )
        raise ImportError(msg) from error


def proved_bridge(
    render: Callable[..., list[int]],
    previous_ids: Sequence[int],
    new_messages: Sequence[ChatMessage],
    tools: list[dict[str, Any]] | None,
    messages: Sequence[ChatMessage] | None,
    decode: Callable[[Sequence[int]], str],
    is_special: Callable[[int], bool],
) -> list[int] | None:
    """An official renderer's ``bridge``, proved on the conversation at hand:
    ``render(messages + new_messages, tools=tools)`` must extend ``previous_ids`` (see
    :func:`extension`), and the bridge is the rest. ``None`` when it does not, when the
    new messages render to nothing, when the renderer refuses the conversation
    (``ValueError``), or without ``messages``; an assistant message among
    ``new_messages`` is a ``ValueError``."""
    refuse_assistant_messages(new_messages)
    if messages is None:
        return None
    try:
        full = render([*messages, *new_messages], tools=tools)
        if new_messages and render(list(messages), tools=tools) == full:
            return None
    except ValueError:
        return None
    return extension(previous_ids, full, decode, is_special)


def extension(
    previous_ids: Sequence[int],
    full_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    is_special: Callable[[int], bool],
) -> list[int] | None:
    """The ids of ``full_ids`` after ``previous_ids``, or ``None`` when ``full_ids`` does
    not extend them.

    ``full_ids`` extends ``previous_ids`` when it starts with them, or when, from the
    first id where they part, ``full_ids`` runs on to an id equal to the last of
    ``previous_ids`` such that both stretches decode to the same text and hold the same
    special tokens in the same order (the model wrote plain text in other ids than the
    official render's: what it sampled is kept, and the rest is the render's)."""
    previous = list(previous_ids)
    full = list(full_ids)
    same = 0
    for a, b in zip(previous, full, strict=False):
        if a != b:
            break
        same += 1
    if same == len(previous):
        return full[same:]
    if not previous:
        return None
    last = previous[-1]
    tail = previous[same:]
    text = decode(tail)
    specials = [token for token in tail if is_special(token)]
    for end in range(same + 1, len(full) + 1):
        if full[end - 1] != last:
            continue
        stretch = full[same:end]
        if [t for t in stretch if is_special(t)] == specials and decode(stretch) == text:
            return full[end:]
    return None


# --------------------------------------------------------------------------- tools, calls


def tool_functions(tools: Sequence[object] | None) -> list[tuple[str, str, dict[str, Any]]]:
    """Each OpenAI tool schema's ``(name, description, parameters)``: a ``TypeError`` or
    ``ValueError`` naming ``tools[i]`` for one that is not ``{"type": "function",
    "function": {"name": str, "description": str, "parameters": dict}}`` (description and
    parameters may be left out)."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        msg = f"tools must be a list of OpenAI tool schemas or None, got {tools!r:.80}"
        raise TypeError(msg)
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            msg = f"tools[{i}] must be a dict (an OpenAI tool schema), got {tool!r:.80}"
            raise TypeError(msg)
        if tool.get("type", "function") != "function":
            msg = f"tools[{i}]['type'] is {tool.get('type')!r:.40}; only 'function' is allowed"
            raise ValueError(msg)
        function = tool.get("function")
        if not isinstance(function, Mapping):
            msg = f"tools[{i}]['function'] must be a dict, got {function!r:.80}"
            raise TypeError(msg)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            msg = f"tools[{i}]['function']['name'] must be a non-empty str, got {name!r:.60}"
            raise ValueError(msg)
        description = function.get("description", "")
        if not isinstance(description, str):
            msg = f"tools[{i}]['function']['description'] must be a str, got {description!r:.60}"
            raise TypeError(msg)
        parameters = function.get("parameters", {})
        if not isinstance(parameters, Mapping):
            msg = f"tools[{i}]['function']['parameters'] must be a dict, got {parameters!r:.80}"
            raise TypeError(msg)
        functions.append((name, description, dict(parameters)))
    return functions


def function_calls(message: ChatMessage, where: str) -> list[tuple[str | None, str, str]]:
    """An assistant message's ``tool_calls`` (OpenAI's shape, as
    :meth:`AssistantTurn.to_message <trio_rollouts.AssistantTurn.to_message>` writes them)
    as ``(id, name, arguments)``, the arguments as the JSON text they are given as (an
    object is written with ``json.dumps``); a ``TypeError`` or ``ValueError`` naming
    ``where.extra['tool_calls'][j]`` for a call of another shape."""
    calls = message.extra.get("tool_calls")
    if calls is None:
        return []
    field = f"{where}.extra['tool_calls']"
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        msg = f"{field} must be a list of tool calls, got {calls!r:.80}"
        raise TypeError(msg)
    read = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            msg = (
                f"{field}[{j}] must be a dict with a 'function' dict ({{'id', 'type', "
                f"'function': {{'name', 'arguments'}}}}), got {call!r:.80}"
            )
            raise TypeError(msg)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            msg = f"{field}[{j}]['function']['name'] must be a non-empty str, got {name!r:.60}"
            raise ValueError(msg)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            msg = (
                f"{field}[{j}]['function']['arguments'] must be a JSON str or a dict, got "
                f"{arguments!r:.60}"
            )
            raise TypeError(msg)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            msg = f"{field}[{j}]['id'] must be a str, got {call_id!r:.60}"
            raise TypeError(msg)
        read.append((call_id, name, arguments))
    return read


# --------------------------------------------------------------------------- vocabulary


def byte_level(piece: bytes) -> str:
    """A token's bytes as a byte-level BPE vocabulary (GPT-2's, as Hugging Face's
    converters write tiktoken and tekken vocabularies) spells it."""
    return "".join(_BYTE_CHARACTERS[byte] for byte in piece)


def _byte_characters() -> list[str]:
    printable = [
        *range(0x21, 0x7F),
        *range(0xA1, 0xAD),
        *range(0xAE, 0x100),
    ]
    characters: dict[int, str] = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in characters:
            characters[byte] = chr(256 + shifted)
            shifted += 1
    return [characters[byte] for byte in range(256)]


_BYTE_CHARACTERS = _byte_characters()


class VocabularyMap:
    """A token-to-id map with the ``get_vocab()`` a Hugging Face tokenizer has, so that
    :func:`~trio_rollouts.renderers.tokenizer_vocabulary` gives it the fingerprint such a
    tokenizer of the same vocabulary would have. Built from ``(token, id)`` pairs in the
    order a converter writes them (a later pair wins, as the special tokens do over
    ordinary tokens of the same spelling)."""

    def __init__(self, pairs: Iterable[tuple[str, int]]) -> None:
        self.vocabulary = dict(pairs)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocabulary)

    def fingerprint(self) -> str | None:
        """:func:`~trio_rollouts.renderers.tokenizer_vocabulary` of this map."""
        return tokenizer_vocabulary(self)
