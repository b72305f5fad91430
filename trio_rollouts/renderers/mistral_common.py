"""``MistralCommonRenderer``: Mistral's reference tokenization, ``mistral-common``'s
``encode_chat_completion`` (what vLLM's ``--tokenizer-mode mistral`` serves with)."""

from __future__ import annotations

import hashlib
import os
import re
import types
from collections.abc import Sequence
from typing import Any

import attrs

from trio_rollouts._messages import ChatMessage
from trio_rollouts.renderers import mistral
from trio_rollouts.renderers._base import (
    AssistantTurn,
    assemble_turn,
    checked_ids,
)
from trio_rollouts.renderers._official import (
    VocabularyMap,
    byte_level,
    function_calls,
    import_extra,
    proved_bridge,
    tool_functions,
)

__all__ = ["MistralCommonRenderer", "nine_character_id"]

#: The call ids the validators of tokenizers v3 to v11 accept.
_NINE = re.compile(r"[A-Za-z0-9]{9}")
#: The function names mistral-common accepts.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EXTRA = "mistral"
_ROLES = ("system", "user", "assistant", "tool")


def nine_character_id(call_id: str) -> str:
    """A call id as tokenizers v3 to v11 accept it: itself when it is nine letters and
    digits, else nine derived from it (the same for a call and its reply, and the same
    as :class:`~trio_rollouts.HFRenderer` writes for Mistral's templates)."""
    if _NINE.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _checked_tokenizer(value: Any) -> Any:
    """``value`` if it is a MistralTokenizer in test mode (a converter: it runs before the
    fields worked out from the tokenizer)."""
    if not callable(getattr(value, "encode_chat_completion", None)) or not hasattr(
        value, "instruct_tokenizer"
    ):
        msg = (
            "tokenizer must be a mistral-common MistralTokenizer (MistralTokenizer.from_file("
            f"path), .v3(), .v7(); or MistralCommonRenderer.from_file), got "
            f"{type(value).__name__} {value!r:.60}"
        )
        raise TypeError(msg)
    mode = getattr(getattr(value, "mode", None), "value", "test")
    if mode != "test":
        msg = (
            f"tokenizer.mode is {mode!r}; MistralCommonRenderer needs a tokenizer in "
            "mistral-common's 'test' mode (the default of from_file, v3() and v7()): "
            "'serving' asks every request for a model name and answered calls, "
            "'finetuning' for a final assistant message"
        )
        raise ValueError(msg)
    return value


def _api() -> Any:
    """The mistral-common classes the renderer builds requests with."""
    who = "MistralCommonRenderer"
    messages = import_extra("mistral_common.protocol.instruct.messages", _EXTRA, who)
    chunks = import_extra("mistral_common.protocol.instruct.chunk", _EXTRA, who)
    calls = import_extra("mistral_common.protocol.instruct.tool_calls", _EXTRA, who)
    request = import_extra("mistral_common.protocol.instruct.request", _EXTRA, who)
    base = import_extra("mistral_common.tokens.tokenizers.base", _EXTRA, who)
    exceptions = import_extra("mistral_common.exceptions", _EXTRA, who)
    return types.SimpleNamespace(
        SystemMessage=messages.SystemMessage,
        UserMessage=messages.UserMessage,
        AssistantMessage=messages.AssistantMessage,
        ToolMessage=messages.ToolMessage,
        ThinkChunk=chunks.ThinkChunk,
        TextChunk=chunks.TextChunk,
        ToolCall=calls.ToolCall,
        FunctionCall=calls.FunctionCall,
        Tool=calls.Tool,
        Function=calls.Function,
        ChatCompletionRequest=request.ChatCompletionRequest,
        IGNORE=base.SpecialTokenPolicy.IGNORE,
        KEEP=base.SpecialTokenPolicy.KEEP,
        Refused=exceptions.MistralCommonException,
    )


def _tokenizer_class(who: str) -> Any:
    module = import_extra("mistral_common.tokens.tokenizers.mistral", _EXTRA, who)
    return module.MistralTokenizer


@attrs.frozen(eq=False)
class MistralCommonRenderer:
    """Mistral's reference tokenization: ``mistral-common``'s ``encode_chat_completion``.

    ``tokenizer`` is a ``mistral_common`` ``MistralTokenizer`` in its ``test`` validation
    mode (what :meth:`from_file`, :meth:`v3`, :meth:`v7` and :meth:`tekken` load; the
    ``mistral`` extra installs ``mistral-common``). This is the tokenization vLLM serves
    Mistral's models with under ``--tokenizer-mode mistral`` (``docs/official-renderers.md``
    compares it with the Hugging Face chat templates).

    **Messages.** ``system``, ``user``, ``assistant`` and ``tool`` messages become
    ``SystemMessage``, ``UserMessage``, ``AssistantMessage`` (``tool_calls`` as
    ``ToolCall``/``FunctionCall``, ``reasoning_content`` as a closed ``ThinkChunk`` before
    the content) and ``ToolMessage`` (``tool_call_id``, ``name``); tools become
    ``Tool``/``Function``. mistral-common's own rules then apply: it merges consecutive
    messages of a role, writes the tools (and, before v7, the system prompt) at the last
    user message (v13: the first), re-serialises call arguments (and, v3, JSON tool results)
    with ``json.dumps``. Where the request would break a rule, the error names the field:

    - call ids: tokenizers v3 to v11 take only nine letters and digits; any other id (in a
      call and in its reply alike) goes as :func:`nine_character_id` derives it, as
      :class:`~trio_rollouts.HFRenderer` does; a call or reply without an id is a
      ``ValueError`` (v3 and later);
    - before v7 an assistant message is content or tool calls, not both; no tokenizer
      renders one with neither (``ValueError``); reasoning needs v13 and ``[THINK]``;
    - Mistral's format has no generation prompt: the model answers right after ``[/INST]``
      or ``[/TOOL_RESULTS]``, so ``add_generation_prompt`` changes nothing. A conversation
      that ends with an assistant message is rendered finished (closed with ``</s>``, as
      mistral-common's finetuning mode renders it), unless that message has
      ``extra["prefix"] = True``: then it is open, for the model to continue (a prefix
      message anywhere but last is a ``ValueError``);
    - anything else mistral-common refuses (the order of roles, say) is a ``ValueError``
      that quotes it.

    **Bridges** are proved on the conversation at hand (``messages=``): the render of the
    whole conversation must extend the episode's ids (:meth:`bridge`); without the
    conversation, no bridge is proved (``None``). **Parsing** decodes the ids (special
    tokens kept) and reads ``[THINK]...[/THINK]`` (when the vocabulary has those tokens)
    and ``[TOOL_CALLS]`` in either of Mistral's formats (``renderers/mistral.py``).
    ``stop_token_ids == close_ids == [</s>]``. :attr:`token_vocabulary` is the
    fingerprint a Hugging Face tokenizer of the same vocabulary has
    (:func:`~trio_rollouts.renderers.tokenizer_vocabulary`).
    """

    tokenizer: Any = attrs.field(converter=_checked_tokenizer)
    _api: Any = attrs.field(init=False, factory=_api, repr=False)
    _special: frozenset[int] = attrs.field(init=False, repr=False)
    _reads_think: bool = attrs.field(init=False, repr=False)
    _vocabulary: list[str | None] = attrs.field(init=False, factory=list, repr=False)

    @_special.default
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self._text.special_ids)

    @_reads_think.default
    def _has_think(self) -> bool:
        return all(self._text.is_special(token) for token in ("[THINK]", "[/THINK]"))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MistralCommonRenderer:
        """The renderer of ``MistralTokenizer.from_file(path)`` (a ``tekken.json`` or a
        SentencePiece ``.model`` file; the latter needs the ``sentencepiece`` package)."""
        tokenizer_class = _tokenizer_class("MistralCommonRenderer.from_file")
        return cls(tokenizer_class.from_file(os.fspath(path)))

    @classmethod
    def from_hf_hub(cls, repo_id: str, **kwargs: Any) -> MistralCommonRenderer:
        """The renderer of ``MistralTokenizer.from_hf_hub(repo_id, **kwargs)``: the
        model's own tokenizer file, downloaded (or read from the local Hugging Face
        cache with ``local_files_only=True``)."""
        tokenizer_class = _tokenizer_class("MistralCommonRenderer.from_hf_hub")
        return cls(tokenizer_class.from_hf_hub(repo_id, **kwargs))

    @classmethod
    def v3(cls, *, is_tekken: bool = False) -> MistralCommonRenderer:
        """mistral-common's bundled v3 tokenizer: SentencePiece (Mistral 7B v0.3, Mixtral
        8x22B) or, ``is_tekken=True``, tekken (Mistral-Nemo's)."""
        return cls(_tokenizer_class("MistralCommonRenderer.v3").v3(is_tekken=is_tekken))

    @classmethod
    def v7(cls) -> MistralCommonRenderer:
        """mistral-common's bundled v7 SentencePiece tokenizer (Mistral Large 2411)."""
        return cls(_tokenizer_class("MistralCommonRenderer.v7").v7())

    @classmethod
    def tekken(cls) -> MistralCommonRenderer:
        """Mistral-Nemo's tekken tokenizer, bundled with mistral-common
        (``MistralTokenizer.v3(is_tekken=True)``)."""
        return cls.v3(is_tekken=True)

    @property
    def _text(self) -> Any:
        """The text tokenizer (``Tekkenizer`` or ``SentencePieceTokenizer``)."""
        return self.tokenizer.instruct_tokenizer.tokenizer

    @property
    def version(self) -> str:
        """The tokenizer's version (``"v3"``, ``"v7"``, ``"v11"``, ``"v13"``, ...)."""
        return str(self._text.version.value)

    @property
    def _version_number(self) -> int:
        return int(self.version[1:])

    @property
    def stop_token_ids(self) -> list[int]:
        return [int(self._text.eos_id)]

    @property
    def close_ids(self) -> list[int]:
        return [int(self._text.eos_id)]

    @property
    def token_vocabulary(self) -> str | None:
        """The fingerprint of this vocabulary as a Hugging Face tokenizer of it has it
        (:func:`~trio_rollouts.renderers.tokenizer_vocabulary`: tekken's tokens written
        byte-level, as ``transformers`` converts ``tekken.json``; SentencePiece's pieces),
        worked out once."""
        if not self._vocabulary:
            self._vocabulary.append(self._fingerprint())
        return self._vocabulary[0]

    def _fingerprint(self) -> str | None:
        text = self._text
        size = int(text.n_words)
        if not callable(getattr(text, "id_to_byte_piece", None)):
            return VocabularyMap((str(text.id_to_piece(i)), i) for i in range(size)).fingerprint()
        specials = int(text.num_special_tokens)
        ordinary = ((byte_level(text.id_to_byte_piece(i)), i) for i in range(specials, size))
        named = ((str(text.id_to_piece(i)), i) for i in range(specials))
        return VocabularyMap([*ordinary, *named]).fingerprint()

    def call_id(self, turn: int, index: int) -> str:
        """The id of a call the model wrote without one: ``call_<turn>_<index>``, as nine
        letters and digits for tokenizers v3 to v11 (:func:`nine_character_id`)."""
        call_id = f"call_{turn}_{index}"
        return nine_character_id(call_id) if self._nine_ids else call_id

    @property
    def _nine_ids(self) -> bool:
        return 3 <= self._version_number < 13

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``encode_chat_completion`` of the conversation (see the class docstring for
        the mapping and its errors); ``add_generation_prompt`` changes nothing (Mistral's
        format has no generation prompt)."""
        request, closed = self._request(messages, tools)
        try:
            tokens = self.tokenizer.encode_chat_completion(request).tokens
        except (self._api.Refused, ValueError, AssertionError) as error:
            msg = f"mistral-common refused the conversation: {error}"
            raise ValueError(msg) from error
        ids = checked_ids(tokens, "encode_chat_completion(...).tokens")
        return ids + self.close_ids if closed else ids

    def request(
        self, messages: Sequence[ChatMessage], *, tools: list[dict[str, Any]] | None = None
    ) -> Any:
        """The ``ChatCompletionRequest`` :meth:`render` encodes (a last assistant message
        as a prefix, whose ``</s>`` :meth:`render` appends unless it is an open prefix)."""
        return self._request(messages, tools)[0]

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        messages: Sequence[ChatMessage] | None = None,
    ) -> list[int] | None:
        """The ids after a finished turn, proved on the conversation at hand: the render of
        ``messages`` and ``new_messages`` must extend ``previous_ids`` (start with them,
        or with the same text and special tokens where the model wrote other ids than the
        render's), and the bridge is the rest of it. ``None`` when it does not
        (mistral-common moved the tools or the system prompt to a new last user message,
        re-serialised a call, refused the conversation), when the new messages render to
        nothing, or without ``messages``."""
        return proved_bridge(
            self.render,
            previous_ids,
            new_messages,
            tools,
            messages,
            self.decode,
            self._special.__contains__,
        )

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        ids = checked_ids(completion_ids, "completion_ids")
        stops = set(self.stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        text = self.decode(ids)
        reasoning: str | None = None
        if self._reads_think:
            reasoning, text = mistral.reasoning(text, opened=False)
        content, calls = mistral.parse(text)
        return assemble_turn(content, calls, reasoning)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written as themselves."""
        parts: list[str] = []
        run: list[int] = []
        for token in ids:
            if token in self._special:
                if run:
                    parts.append(self._text.decode(run, special_token_policy=self._api.IGNORE))
                    run = []
                parts.append(self._text.decode([token], special_token_policy=self._api.KEEP))
            else:
                run.append(token)
        if run:
            parts.append(self._text.decode(run, special_token_policy=self._api.IGNORE))
        return "".join(parts)

    def encode(self, text: str) -> list[int]:
        return checked_ids(self._text.encode(text, bos=False, eos=False), "encode(text)")

    # ----------------------------------------------------------------------- the request

    def _request(
        self, messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None
    ) -> tuple[Any, bool]:
        """The request, and whether the render is closed with ``</s>`` after it (a last
        assistant message that is not an open prefix)."""
        if not messages:
            msg = "messages is empty: mistral-common renders a conversation of one or more"
            raise ValueError(msg)
        converted = []
        closed = False
        last = len(messages) - 1
        for i, message in enumerate(messages):
            if message.role not in _ROLES:
                allowed = ", ".join(map(repr, _ROLES))
                msg = f"messages[{i}].role is {message.role!r}; mistral-common renders {allowed}"
                raise ValueError(msg)
            prefix = message.extra.get("prefix", False)
            if not isinstance(prefix, bool):
                msg = f"messages[{i}].extra['prefix'] must be a bool, got {prefix!r:.40}"
                raise TypeError(msg)
            if prefix and (message.role != "assistant" or i != last):
                msg = (
                    f"messages[{i}].extra['prefix'] is {prefix!r}: only the last message, an "
                    "assistant message, may be a prefix (mistral-common's rule)"
                )
                raise ValueError(msg)
            if message.role == "assistant" and i == last:
                closed = not prefix
                converted.append(self._assistant(message, i, prefix=True))
            else:
                converted.append(self._message(message, i))
        try:
            schemas = [
                self._api.Tool(
                    function=self._api.Function(name=name, description=text, parameters=params)
                )
                for name, text, params in tool_functions(tools)
            ]
        except ValueError as error:  # pydantic's ValidationError is one
            msg = f"tools: mistral-common refused the schemas: {error}"
            raise ValueError(msg) from error
        request = self._api.ChatCompletionRequest(messages=converted, tools=schemas or None)
        return request, closed

    def _message(self, message: ChatMessage, i: int) -> Any:
        api = self._api
        if message.role == "assistant":
            return self._assistant(message, i, prefix=False)
        if message.role == "system":
            if not message.content:
                msg = (
                    f"messages[{i}].content is empty: mistral-common refuses an empty system prompt"
                )
                raise ValueError(msg)
            return api.SystemMessage(content=message.content)
        if message.role == "user":
            return api.UserMessage(content=message.content)
        call_id = message.extra.get("tool_call_id")
        if self._version_number >= 3 and (not isinstance(call_id, str) or not call_id):
            msg = (
                f"messages[{i}].extra['tool_call_id'] is {call_id!r:.40}: tokenizer "
                f"{self.version} answers a call by its id (a non-empty str)"
            )
            raise ValueError(msg)
        name = message.extra.get("name")
        return api.ToolMessage(
            content=message.content,
            tool_call_id=self._call_id(call_id) if isinstance(call_id, str) else None,
            name=name if isinstance(name, str) else None,
        )

    def _assistant(self, message: ChatMessage, i: int, *, prefix: bool) -> Any:
        api = self._api
        calls = []
        for j, (call_id, name, arguments) in enumerate(function_calls(message, f"messages[{i}]")):
            field = f"messages[{i}].extra['tool_calls'][{j}]"
            if not _FUNCTION_NAME.fullmatch(name):
                msg = (
                    f"{field}['function']['name'] is {name!r:.80}: mistral-common takes "
                    "1 to 64 letters, digits, '_' and '-'"
                )
                raise ValueError(msg)
            if call_id is None and self._version_number >= 3:
                msg = f"{field}['id'] is missing: tokenizer {self.version} writes a call's id"
                raise ValueError(msg)
            function = api.FunctionCall(name=name, arguments=arguments)
            calls.append(api.ToolCall(id=self._call_id(call_id or "null"), function=function))
        reasoning = message.extra.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            msg = f"messages[{i}].extra['reasoning_content'] must be a str, got {reasoning!r:.60}"
            raise TypeError(msg)
        if reasoning is not None and not (self._reads_think and self._version_number >= 13):
            msg = (
                f"messages[{i}].extra['reasoning_content'] is set, but tokenizer "
                f"{self.version} renders no reasoning (that needs v13 or later with [THINK] "
                "and [/THINK])"
            )
            raise ValueError(msg)
        if calls and message.content and self._version_number < 7:
            msg = (
                f"messages[{i}] has content ({message.content!r:.40}) and tool calls: tokenizer "
                f"{self.version} writes an assistant message as one or the other (v7 and "
                "later write both)"
            )
            raise ValueError(msg)
        if not calls and not message.content and reasoning is None:
            msg = (
                f"messages[{i}] is an assistant message with no content and no tool calls: "
                "mistral-common cannot render it"
            )
            raise ValueError(msg)
        content: Any = message.content or None
        if reasoning is not None:
            content = [api.ThinkChunk(thinking=reasoning, closed=True)]
            if message.content:
                content.append(api.TextChunk(text=message.content))
        return api.AssistantMessage(content=content, tool_calls=calls or None, prefix=prefix)

    def _call_id(self, call_id: str) -> str:
        return nine_character_id(call_id) if self._nine_ids else call_id
