"""Renderers: one model family's chat template, in token ids.

A multi-turn episode is a token stream, not a message list: the ids the model sampled are
kept verbatim, and only what comes between two assistant turns (the environment's
messages and the next generation prompt) is rendered. A :class:`Renderer` renders a
conversation to ids, gives the ids to append after a finished assistant turn
(:meth:`Renderer.bridge`), and parses a turn's ids into an :class:`AssistantTurn`
without ever rendering it again.

:class:`PlainRenderer` needs no dependency: its ids are Unicode code points and its layout
is :func:`~trio_rollouts.inference.render_plain_chat`'s, so it matches
:class:`~trio_rollouts.inference.EmbeddedInference`'s tokens exactly. :class:`HFRenderer`
renders with a Hugging Face tokenizer's chat template (``transformers`` is needed only by
:meth:`HFRenderer.from_pretrained`, the ``hf`` extra).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from ._messages import ChatMessage

__all__ = ["AssistantTurn", "HFRenderer", "PlainRenderer", "Renderer", "ToolCall"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)


@attrs.frozen(kw_only=True)
class ToolCall:
    """A tool call the model wrote, as parsed from its ids.

    ``arguments`` is ``None`` when the call is not a JSON object with a string ``name``
    and object ``arguments``; ``name`` is then whatever could be read (or ``None``), and
    ``raw`` is always the text between the tags, as sampled. Nothing is repaired: a
    broken call is an observation for the environment.
    """

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str


@attrs.frozen(kw_only=True)
class AssistantTurn:
    """One assistant turn parsed from its ids: the text outside tool calls and reasoning
    (``content``), the tool calls in order, the reasoning (``<think>`` block) if any, and
    ``parse_error`` naming each call that could not be parsed (``None`` if all could)."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    parse_error: str | None = None


@runtime_checkable
class Renderer(Protocol):
    """One model family's chat template, in ids.

    - ``render(messages, *, tools=None, add_generation_prompt=True)``: the ids of a
      conversation, ending with the generation prompt when asked;
    - ``bridge(previous_ids, new_messages, *, tools=None)``: the ids to append after a
      finished assistant turn so that ``previous_ids + bridge`` is what ``render`` of the
      whole conversation gives, ending with the generation prompt; ``None`` when that
      cannot be proved; an assistant message in ``new_messages`` is a ``ValueError``;
    - ``parse(completion_ids)``: the turn, parsed from the ids;
    - ``decode(ids)`` and ``encode(text)`` (no template, no special tokens);
    - ``stop_token_ids``: the ids that end generation; ``close_ids``: what ends an
      assistant turn (appended after a turn cut by ``max_tokens``).
    """

    @property
    def stop_token_ids(self) -> list[int]: ...

    @property
    def close_ids(self) -> list[int]: ...

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None: ...

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@attrs.frozen
class PlainRenderer:
    """The plain layout in code points, with no dependency.

    A message is ``"<|role|>\\ncontent\\n"``; the generation prompt is
    ``"<|assistant|>\\n"`` (as :func:`~trio_rollouts.inference.render_plain_chat`). Tools,
    when given, come first as one ``"<|tools|>\\n<JSON list>\\n"`` block. The model writes
    tool calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and may open
    its turn with a ``<think>...</think>`` block. No token ends a turn
    (``stop_token_ids == close_ids == []``): the bridge after a turn is ``"\\n"``, the new
    messages, and the generation prompt.
    """

    @property
    def stop_token_ids(self) -> list[int]:
        return []

    @property
    def close_ids(self) -> list[int]:
        return []

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        parts = [f"<|tools|>\n{json.dumps(tools)}\n"] if tools else []
        parts += [_message_text(message) for message in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return self.encode("".join(parts))

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None:
        _refuse_assistant_messages(new_messages)
        text = "\n" + "".join(_message_text(message) for message in new_messages)
        return self.encode(text + "<|assistant|>\n")

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        return _parse_turn(self.decode(completion_ids))

    def decode(self, ids: Sequence[int]) -> str:
        for i, token in enumerate(ids):
            if not 0 <= token <= sys.maxunicode:
                msg = (
                    f"ids[{i}] = {token} is not a PlainRenderer token: its tokens are "
                    f"Unicode code points, 0 to {sys.maxunicode}"
                )
                raise ValueError(msg)
        return "".join(map(chr, ids))

    def encode(self, text: str) -> list[int]:
        return [ord(character) for character in text]


#: The base conversations :meth:`HFRenderer.bridge` renders the new messages after: the
#: bridge is proved only if it is the same after each (an assistant turn with and without a
#: ``<think>`` block), so a template that rewrites earlier turns gives ``None``.
_BRIDGE_BASES = (
    (
        ChatMessage(role="user", content="Hi."),
        ChatMessage(role="assistant", content="Hello."),
    ),
    (
        ChatMessage(role="user", content="Hi."),
        ChatMessage(role="assistant", content="<think>\nA greeting.\n</think>\n\nHello."),
    ),
)
#: The assistant content the end-of-turn ids are read after (see ``close_ids``).
_PROBE_CONTENT = "Probe answer."
#: How many tools values :meth:`HFRenderer.bridge` keeps the base renders of.
_BASE_CACHE_SIZE = 64


def _ids(value: Iterable[object], what: str) -> list[int]:
    ids: list[int] = []
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool):
            msg = f"{what}[{i}] = {token!r} is not a token id (an int)"
            raise TypeError(msg)
        ids.append(token)
    return ids


def _close_ids(value: Iterable[object]) -> list[int]:
    ids = _ids(value, "close_ids")
    if not ids:
        msg = "close_ids must not be empty: the bridge is cut after them"
        raise ValueError(msg)
    return ids


def _stop_token_ids(value: Iterable[object]) -> list[int]:
    return _ids(value, "stop_token_ids")


@attrs.frozen(eq=False)
class HFRenderer:
    """A Hugging Face tokenizer's chat template, in its ids.

    ``tokenizer`` is anything with ``apply_chat_template``, ``encode`` and ``decode`` (a
    ``transformers`` ``PreTrainedTokenizerFast``, say); this class never imports
    ``transformers`` (only :meth:`from_pretrained` does). A :class:`ChatMessage` goes to the
    template as ``{"role": ..., "content": ..., **extra}``, so ``tool_calls``, ``name`` or
    ``tool_call_id`` kept in :attr:`ChatMessage.extra` reach it.

    ``close_ids`` (what ends an assistant turn) is, unless given, derived from the
    template: a probe conversation (a user message, then an assistant answer) is rendered
    without a generation prompt, and the close is the special tokens that come right
    after the answer (``[<|im_end|>]`` for ChatML, ``[<|eot_id|>]`` for Llama 3). When
    none do (or the probe cannot be rendered) the constructor raises ``ValueError``: pass
    ``close_ids=`` then (not empty: the bridge is cut after them). ``stop_token_ids`` is,
    unless given, ``close_ids`` and the tokenizer's ``eos_token_id`` if it is another id.

    :meth:`parse` decodes the ids without their trailing stop ids and reads them as
    :class:`PlainRenderer` does: an opening ``<think>...</think>`` block and
    ``<tool_call>{JSON}</tool_call>`` calls.

    The tokenizer (and its template) must not change once the renderer is made: the
    close and the bridge's base renders are computed once.
    """

    tokenizer: Any
    _close_ids: list[int] = attrs.field(kw_only=True, converter=_close_ids, alias="close_ids")
    _stop_token_ids: list[int] = attrs.field(
        kw_only=True, converter=_stop_token_ids, alias="stop_token_ids"
    )
    _bases: dict[str, tuple[tuple[int, ...], ...]] = attrs.field(
        init=False, factory=dict, repr=False
    )

    @_close_ids.default
    def _derive_close_ids(self) -> list[int]:
        probe = [
            {"role": "user", "content": "Probe question."},
            {"role": "assistant", "content": _PROBE_CONTENT},
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                probe, tokenize=False, add_generation_prompt=False
            )
        except ImportError:
            raise  # a missing install (jinja2), which close_ids= would not cure
        except Exception as error:
            msg = (
                "HFRenderer could not derive close_ids: the chat template does not render "
                f"a user message and an assistant answer ({error!r}); pass close_ids="
            )
            raise ValueError(msg) from error
        if not isinstance(text, str) or _PROBE_CONTENT not in text:
            msg = (
                "HFRenderer could not derive close_ids: the chat template does not write an "
                "assistant message's content verbatim; pass close_ids="
            )
            raise ValueError(msg)
        after = text[text.rindex(_PROBE_CONTENT) + len(_PROBE_CONTENT) :]
        special = self._special_ids()
        close: list[int] = []
        for token in self.encode(after):
            if token not in special:
                break
            close.append(token)
        if not close:
            msg = (
                "HFRenderer could not derive close_ids: the chat template writes "
                f"{after!r} after an assistant message, which does not start with a special "
                "token; pass close_ids= (the ids that end an assistant turn)"
            )
            raise ValueError(msg)
        return close

    @_stop_token_ids.default
    def _derive_stop_token_ids(self) -> list[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in self._close_ids:
            return [*self._close_ids, eos]
        return list(self._close_ids)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        close_ids: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> HFRenderer:
        """The renderer of ``transformers.AutoTokenizer.from_pretrained(path, **kwargs)``
        (needs the ``hf`` extra); ``close_ids`` and ``stop_token_ids`` as in the class."""
        try:
            import transformers  # the optional hf extra: imported only here
        except ImportError as error:
            msg = "HFRenderer.from_pretrained needs transformers: pip install 'trio-rollouts[hf]'"
            raise ImportError(msg) from error
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
        overrides: dict[str, list[int]] = {}
        if close_ids is not None:
            overrides["close_ids"] = list(close_ids)
        if stop_token_ids is not None:
            overrides["stop_token_ids"] = list(stop_token_ids)
        return cls(tokenizer, **overrides)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_token_ids)

    @property
    def close_ids(self) -> list[int]:
        return list(self._close_ids)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The template's text for ``messages``, encoded (the text's special tokens are
        read as such; nothing is added)."""
        conversation = [
            {**message.extra, "role": message.role, "content": message.content}
            for message in messages
        ]
        text = self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        if not isinstance(text, str):
            msg = (
                "the tokenizer's apply_chat_template(..., tokenize=False) returned a "
                f"{type(text).__name__}, not a str"
            )
            raise TypeError(msg)
        return self.encode(text)

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int] | None:
        """The ids after a finished turn, or ``None`` when they cannot be proved.

        The new messages are rendered after two fixed base conversations (whose assistant
        turn holds a ``<think>`` block in one and not in the other), with the generation
        prompt. Each base, rendered alone and cut just after its assistant turn's
        ``close_ids``, must be a prefix of that render, and what follows it (the bridge)
        must be the same after both; ``previous_ids`` must end with ``close_ids``. Any of
        these failing gives ``None`` (a template that is not append-only, such as one that
        drops earlier reasoning once a user message follows). What a ChatML template writes
        after ``<|im_end|>`` (its ``"\\n"``, which the engine stops before) starts the
        bridge.
        """
        _refuse_assistant_messages(new_messages)
        close = self._close_ids
        if list(previous_ids[max(len(previous_ids) - len(close), 0) :]) != close:
            return None
        bridges = []
        for base, cut in zip(_BRIDGE_BASES, self._base_cuts(tools), strict=True):
            if not cut:
                return None
            full = self.render([*base, *new_messages], tools=tools)
            if tuple(full[: len(cut)]) != cut:
                return None
            bridges.append(full[len(cut) :])
        if any(bridge != bridges[0] for bridge in bridges):
            return None
        return bridges[0]

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        ids = list(completion_ids)
        stops = set(self._stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        return _parse_turn(self.decode(ids))

    def decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if not isinstance(text, str):
            msg = f"the tokenizer's decode returned a {type(text).__name__}, not a str"
            raise TypeError(msg)
        return text

    def encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer.encode(text, add_special_tokens=False), "encode(text)")

    def _special_ids(self) -> set[int]:
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        special.update(
            token for token, added_token in added.items() if getattr(added_token, "special", False)
        )
        return special

    def _base_cuts(self, tools: list[dict[str, Any]] | None) -> tuple[tuple[int, ...], ...]:
        """Each base's render (no generation prompt) cut just after its last ``close_ids``
        (empty if they are not there), kept per tools value."""
        try:
            key: str | None = json.dumps(tools, sort_keys=True)
        except (TypeError, ValueError):
            key = None  # not JSON: computed every time
        if key is not None and key in self._bases:
            return self._bases[key]
        cuts = tuple(
            _cut_after_last(
                self.render(base, tools=tools, add_generation_prompt=False), self._close_ids
            )
            for base in _BRIDGE_BASES
        )
        if key is not None:
            if len(self._bases) >= _BASE_CACHE_SIZE:
                self._bases.clear()
            self._bases[key] = cuts
        return cuts


def _cut_after_last(ids: list[int], close: list[int]) -> tuple[int, ...]:
    """``ids`` up to the end of the last occurrence of ``close`` (empty if none)."""
    for end in range(len(ids), len(close) - 1, -1):
        if ids[end - len(close) : end] == close:
            return tuple(ids[:end])
    return ()


def _parse_turn(text: str) -> AssistantTurn:
    """An assistant turn parsed from its text: an opening ``<think>...</think>`` block is the
    reasoning, each ``<tool_call>{JSON}</tool_call>`` a :class:`ToolCall` (an unclosed one
    runs to the end), and what is left, stripped, the content."""
    reasoning = None
    thought = _THINK.match(text)
    if thought is not None:
        reasoning = thought.group(1)
        text = text[thought.end() :]
    calls: list[ToolCall] = []
    errors: list[str] = []
    for number, found in enumerate(_TOOL_CALL.finditer(text)):
        raw, closed = found.group(1), bool(found.group(2))
        call, error = _tool_call(f"call_{number}", raw, closed)
        calls.append(call)
        if error is not None:
            errors.append(f"tool call {number}: {error}")
    content = _TOOL_CALL.sub("", text).strip()
    return AssistantTurn(
        content=content,
        tool_calls=tuple(calls),
        reasoning=reasoning,
        parse_error="; ".join(errors) or None,
    )


def _refuse_assistant_messages(new_messages: Sequence[ChatMessage]) -> None:
    """A bridge holds what comes between assistant turns: an assistant message in it is a
    ``ValueError`` naming its index."""
    for i, message in enumerate(new_messages):
        if message.role == "assistant":
            msg = (
                f"new_messages[{i}] is an assistant message: a bridge holds what comes "
                "between assistant turns (the turns themselves are the sampled ids)"
            )
            raise ValueError(msg)


def _message_text(message: ChatMessage) -> str:
    return f"<|{message.role}|>\n{message.content}\n"


def _tool_call(call_id: str, raw: str, closed: bool) -> tuple[ToolCall, str | None]:
    """The call written between the tags, and why it is broken (``None`` if it is not)."""
    if not closed:
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), "no </tool_call>"
    try:
        data = json.loads(raw)
    except ValueError as error:
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), f"not JSON ({error})"
    if not isinstance(data, dict):
        kind = type(data).__name__
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), f"a {kind}, not an object"
    name = data.get("name")
    arguments = data.get("arguments", {})
    readable = name if isinstance(name, str) else None
    if readable is None:
        why = f"'name' is {name!r}, not a string"
        return ToolCall(id=call_id, name=None, arguments=None, raw=raw), why
    if not isinstance(arguments, dict):
        why = f"'arguments' is a {type(arguments).__name__}, not an object"
        return ToolCall(id=call_id, name=readable, arguments=None, raw=raw), why
    return ToolCall(id=call_id, name=readable, arguments=arguments, raw=raw), None
