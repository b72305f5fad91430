"""``HarmonyRenderer``: gpt-oss's reference rendering, OpenAI's ``openai-harmony`` (what
vLLM serves gpt-oss with)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from trio_rollouts._checks import check_optional_str
from trio_rollouts._messages import ChatMessage
from trio_rollouts.renderers import openai
from trio_rollouts.renderers._base import (
    AssistantTurn,
    ToolCall,
    assemble_turn,
    checked_ids,
    declared_roles,
)
from trio_rollouts.renderers._calls import call_from_parts
from trio_rollouts.renderers._official import (
    VocabularyMap,
    byte_level,
    function_calls,
    import_extra,
    proved_bridge,
    tool_functions,
)

__all__ = ["GPT_OSS_VOCAB_SIZE", "HarmonyRenderer", "load_gpt_oss_encoding"]

#: gpt-oss's vocabulary size (its config's ``vocab_size``): the ids
#: :attr:`HarmonyRenderer.token_vocabulary` covers.
GPT_OSS_VOCAB_SIZE = 201088
#: The variable openai-harmony reads the directory of ``o200k_base.tiktoken`` from.
_VOCAB_DIR_VARIABLE = "TIKTOKEN_ENCODINGS_BASE"
_EFFORTS = ("low", "medium", "high")
_INSTRUCTION_ROLES = ("system", "developer")
_ROLES = ("system", "developer", "user", "assistant", "tool")
_DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def _harmony() -> Any:
    return import_extra("openai_harmony", "harmony", "HarmonyRenderer")


def load_gpt_oss_encoding(vocab_dir: str | os.PathLike[str] | None = None) -> Any:
    """openai-harmony's ``HARMONY_GPT_OSS`` encoding (needs the ``harmony`` extra).

    openai-harmony reads the ``o200k_base.tiktoken`` vocabulary from the directory that
    ``TIKTOKEN_ENCODINGS_BASE`` names, else from its cache (``TIKTOKEN_RS_CACHE_DIR``, by
    default ``tiktoken-rs-cache`` in the temporary directory), downloading it there at
    first use; it checks the file's SHA-256 either way. ``vocab_dir`` names that
    directory for this call only (``TIKTOKEN_ENCODINGS_BASE`` is set while the encoding
    loads, then restored). A vocabulary that cannot be had is an ``OSError`` that says
    so."""
    harmony = _harmony()
    previous = os.environ.get(_VOCAB_DIR_VARIABLE)
    if vocab_dir is not None:
        os.environ[_VOCAB_DIR_VARIABLE] = os.fspath(vocab_dir)
    try:
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
    except harmony.HarmonyError as error:
        where = os.environ.get(_VOCAB_DIR_VARIABLE)
        source = (
            f"the directory {_VOCAB_DIR_VARIABLE} names ({where!r})"
            if where is not None
            else "its cache, or a download at first use"
        )
        msg = (
            f"openai-harmony could not load gpt-oss's vocabulary (o200k_base.tiktoken) from "
            f"{source}: {error}. Offline, pass vocab_dir= (or set {_VOCAB_DIR_VARIABLE}) to a "
            "directory holding o200k_base.tiktoken (its SHA-256 is checked)"
        )
        raise OSError(msg) from error
    finally:
        if vocab_dir is not None:
            if previous is None:
                os.environ.pop(_VOCAB_DIR_VARIABLE, None)
            else:
                os.environ[_VOCAB_DIR_VARIABLE] = previous


def _check_effort(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in _EFFORTS:
        msg = f"reasoning_effort must be one of {', '.join(map(repr, _EFFORTS))}, got {value!r:.40}"
        raise ValueError(msg)


@attrs.frozen(eq=False)
class HarmonyRenderer:
    """gpt-oss's reference rendering: OpenAI's ``openai-harmony``.

    ``encoding`` is openai-harmony's ``HARMONY_GPT_OSS`` encoding (by default
    :func:`load_gpt_oss_encoding`'s; :meth:`load` takes a ``vocab_dir`` for offline use).
    vLLM renders gpt-oss's chat requests with this library (``docs/official-renderers.md``
    compares it with the Hugging Face template).

    **The conversation.** A system message (``SystemContent``: ``model_identity``,
    ``knowledge_cutoff``, ``conversation_start_date`` when set, ``reasoning_effort``, the
    three channels) opens it; the leading ``system`` and ``developer`` messages (joined by
    a blank line) become the developer message's ``# Instructions``, with the tools
    (``DeveloperContent.with_function_tools``) when there are any; a ``system`` or
    ``developer`` message later on is a ``ValueError`` (harmony has one developer message,
    at the start). ``user`` messages are user messages. An assistant message becomes its
    ``reasoning_content`` on the ``analysis`` channel, then either each tool call on the
    ``commentary`` channel to ``functions.<name>`` (``<|constrain|>json``, the arguments as
    given), after its content as a ``commentary`` preamble when it has content, or its
    content on the ``final`` channel. A ``tool`` message is the output of
    ``functions.<name>`` to the assistant on ``commentary``: its ``extra["name"]``, else
    the name of the call its ``tool_call_id`` answers, else of the last call (none: a
    ``ValueError``). openai-harmony renders it all, and drops earlier analysis by its own
    rule (before the first final answer, once the last assistant message is one).

    :meth:`render` with ``add_generation_prompt`` is ``render_conversation_for_completion``
    (ending with ``<|start|>assistant``); without, ``render_conversation_for_training`` (a
    last final answer ends with ``<|return|>``). **Bridges** are proved on the
    conversation at hand (``messages=``; without it, ``None``), as
    :class:`~trio_rollouts.renderers.MistralCommonRenderer`'s. **Parsing** is harmony's
    own (``parse_messages_from_completion_tokens``, not strict): ``analysis`` is the
    reasoning, a message with a recipient is a tool call (``functions.`` taken off its
    name), ``final`` and ``commentary`` text the content; ids it cannot parse are read as
    text (``renderers/openai.py``) with the turn's ``parse_error`` saying so.

    ``stop_token_ids`` are harmony's stops for assistant actions (``<|call|>``,
    ``<|return|>``); ``close_ids`` is ``<|end|>`` (what ends a final answer, or a cut
    message, in history). :attr:`token_vocabulary` is the fingerprint a Hugging Face
    tokenizer of the same vocabulary has. ``extra_roles=("developer",)`` lets episodes hold
    ``developer`` messages (rendered as ``system`` ones are; declared process-wide, as
    every renderer's ``extra_roles``: the gateway then keeps the role instead of reading it
    as ``system``).
    """

    encoding: Any = attrs.field(factory=load_gpt_oss_encoding)
    reasoning_effort: str = attrs.field(default="medium", kw_only=True, validator=_check_effort)
    model_identity: str | None = attrs.field(
        default=_DEFAULT_IDENTITY, kw_only=True, validator=check_optional_str
    )
    knowledge_cutoff: str | None = attrs.field(
        default="2024-06", kw_only=True, validator=check_optional_str
    )
    conversation_start_date: str | None = attrs.field(
        default=None, kw_only=True, validator=check_optional_str
    )
    extra_roles: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=declared_roles)
    _harmony: Any = attrs.field(init=False, factory=_harmony, repr=False)
    _close: list[int] = attrs.field(init=False, repr=False)
    _vocabulary: list[str | None] = attrs.field(init=False, factory=list, repr=False)

    @_close.default
    def _end_id(self) -> list[int]:
        return checked_ids(self.encoding.encode("<|end|>", allowed_special={"<|end|>"}), "<|end|>")

    @classmethod
    def load(
        cls, vocab_dir: str | os.PathLike[str] | None = None, **kwargs: Any
    ) -> HarmonyRenderer:
        """The renderer of :func:`load_gpt_oss_encoding(vocab_dir) <load_gpt_oss_encoding>`
        (the directory holding ``o200k_base.tiktoken``, for offline use); the other
        arguments as in the class."""
        return cls(load_gpt_oss_encoding(vocab_dir), **kwargs)

    @property
    def stop_token_ids(self) -> list[int]:
        """harmony's stops for assistant actions (``<|return|>``, ``<|call|>``), sorted
        (harmony gives them as a set)."""
        stops = checked_ids(self.encoding.stop_tokens_for_assistant_actions(), "stop tokens")
        return sorted(stops)

    @property
    def close_ids(self) -> list[int]:
        return list(self._close)

    @property
    def token_vocabulary(self) -> str | None:
        """The fingerprint of gpt-oss's vocabulary (its first :data:`GPT_OSS_VOCAB_SIZE`
        ids) as a Hugging Face tokenizer of it has it (ordinary tokens written byte-level,
        special tokens as themselves; :func:`~trio_rollouts.renderers.tokenizer_vocabulary`),
        worked out once."""
        if not self._vocabulary:
            self._vocabulary.append(self._fingerprint())
        return self._vocabulary[0]

    def _fingerprint(self) -> str | None:
        encoding = self.encoding
        ordinary = []
        named = []
        for token in range(GPT_OSS_VOCAB_SIZE):
            if encoding.is_special_token(token):
                named.append((encoding.decode([token]), token))
            else:
                text = encoding.decode([token], errors="surrogateescape")
                ordinary.append((byte_level(text.encode("utf-8", "surrogateescape")), token))
        return VocabularyMap([*ordinary, *named]).fingerprint()

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """openai-harmony's render of the conversation (see the class docstring)."""
        harmony = self._harmony
        conversation = self.conversation(messages, tools=tools)
        try:
            if add_generation_prompt:
                ids = self.encoding.render_conversation_for_completion(
                    conversation, harmony.Role.ASSISTANT
                )
            else:
                ids = self.encoding.render_conversation_for_training(conversation)
        except harmony.HarmonyError as error:
            msg = f"openai-harmony refused the conversation: {error}"
            raise ValueError(msg) from error
        return checked_ids(ids, "openai-harmony's render")

    def conversation(
        self, messages: Sequence[ChatMessage], *, tools: list[dict[str, Any]] | None = None
    ) -> Any:
        """The harmony ``Conversation`` :meth:`render` renders."""
        harmony = self._harmony
        system = harmony.SystemContent(
            model_identity=self.model_identity,
            reasoning_effort=harmony.ReasoningEffort[self.reasoning_effort.upper()],
            knowledge_cutoff=self.knowledge_cutoff,
            conversation_start_date=self.conversation_start_date,
        )
        rendered = [harmony.Message.from_role_and_content(harmony.Role.SYSTEM, system)]
        start = 0
        while start < len(messages) and messages[start].role in _INSTRUCTION_ROLES:
            start += 1
        instructions = "\n\n".join(message.content for message in messages[:start])
        functions = tool_functions(tools)
        if instructions or functions:
            developer = harmony.DeveloperContent.new()
            if instructions:
                developer = developer.with_instructions(instructions)
            if functions:
                developer = developer.with_function_tools(
                    [
                        harmony.ToolDescription.new(name, text, parameters=parameters or None)
                        for name, text, parameters in functions
                    ]
                )
            rendered.append(
                harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer)
            )
        names: dict[str, str] = {}
        last: list[str] = []
        for i in range(start, len(messages)):
            rendered += self._messages(messages[i], i, names, last)
        return harmony.Conversation.from_messages(rendered)

    def _messages(
        self, message: ChatMessage, i: int, names: dict[str, str], last: list[str]
    ) -> list[Any]:
        """The harmony messages of ``message`` (``messages[i]``); ``names`` (call ids to
        names) and ``last`` (the last call's name) are kept up to date."""
        harmony = self._harmony
        role = message.role
        if role in _INSTRUCTION_ROLES:
            msg = (
                f"messages[{i}].role is {role!r} after the conversation started: harmony "
                "writes instructions only in the developer message at its start (put "
                "system and developer messages first)"
            )
            raise ValueError(msg)
        if role == "user":
            return [harmony.Message.from_role_and_content(harmony.Role.USER, message.content)]
        if role == "tool":
            return [self._tool_output(message, i, names, last)]
        if role != "assistant":
            allowed = ", ".join(map(repr, _ROLES))
            msg = f"messages[{i}].role is {role!r}; HarmonyRenderer renders {allowed}"
            raise ValueError(msg)
        assistant = harmony.Role.ASSISTANT
        rendered = []
        reasoning = message.extra.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                msg = (
                    f"messages[{i}].extra['reasoning_content'] must be a str, got {reasoning!r:.60}"
                )
                raise TypeError(msg)
            analysis = harmony.Message.from_role_and_content(assistant, reasoning)
            rendered.append(analysis.with_channel("analysis"))
        calls = function_calls(message, f"messages[{i}]")
        if not calls:
            final = harmony.Message.from_role_and_content(assistant, message.content)
            return [*rendered, final.with_channel("final")]
        if message.content:
            preamble = harmony.Message.from_role_and_content(assistant, message.content)
            rendered.append(preamble.with_channel("commentary"))
        for call_id, name, arguments in calls:
            call = harmony.Message.from_role_and_content(assistant, arguments)
            call = call.with_channel("commentary").with_recipient(f"functions.{name}")
            rendered.append(call.with_content_type("<|constrain|>json"))
            if call_id is not None:
                names[call_id] = name
            last[:] = [name]
        return rendered

    def _tool_output(
        self, message: ChatMessage, i: int, names: dict[str, str], last: list[str]
    ) -> Any:
        harmony = self._harmony
        name = message.extra.get("name")
        call_id = message.extra.get("tool_call_id")
        if not isinstance(name, str) or not name:
            name = names.get(call_id) if isinstance(call_id, str) else None
        if name is None and last:
            name = last[0]
        if name is None:
            msg = (
                f"messages[{i}] is a tool message with no extra['name'] and no call before it "
                f"(extra['tool_call_id'] is {call_id!r:.40}): harmony addresses a tool's "
                "output from functions.<name>"
            )
            raise ValueError(msg)
        author = harmony.Author.new(harmony.Role.TOOL, f"functions.{name}")
        output = harmony.Message.from_author_and_content(author, message.content)
        return output.with_channel("commentary").with_recipient("assistant")

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
        render's), and the bridge is the rest of it, ending with ``<|start|>assistant``.
        ``None`` when it does not (a final answer's ``<|return|>`` is ``<|end|>`` in
        history, earlier analysis dropped, a call written with its recipient in the
        channel), when the new messages render to nothing, or without ``messages``."""
        return proved_bridge(
            self.render,
            previous_ids,
            new_messages,
            tools,
            messages,
            self.decode,
            self.encoding.is_special_token,
        )

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        harmony = self._harmony
        ids = checked_ids(completion_ids, "completion_ids")
        try:
            parsed = self.encoding.parse_messages_from_completion_tokens(
                ids, harmony.Role.ASSISTANT, strict=False
            )
        except harmony.HarmonyError as error:
            return self._parse_text(ids, str(error))
        content: list[str] = []
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        for message in parsed:
            text = "".join(getattr(part, "text", "") for part in message.content)
            recipient = message.recipient
            if recipient is not None and recipient != "all":
                name = recipient.removeprefix("functions.")
                calls.append(call_from_parts(f"call_{len(calls)}", text, name, text))
            elif message.channel == "analysis":
                thoughts.append(text)
            else:
                content.append(text)
        return assemble_turn("".join(content), calls, "\n".join(thoughts) if thoughts else None)

    def _parse_text(self, ids: list[int], why: str) -> AssistantTurn:
        """A turn harmony could not parse, read from its text (``renderers/openai.py``)."""
        stops = set(self.stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        reasoning, text = openai.reasoning(self.decode(ids), opened=False)
        content, calls = openai.parse(text)
        turn = assemble_turn(content, calls, reasoning)
        error = f"openai-harmony could not parse the turn ({why}); read from its text"
        if turn.parse_error is not None:
            error += f"; {turn.parse_error}"
        return attrs.evolve(turn, parse_error=error)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written as themselves."""
        text = self.encoding.decode(list(ids))
        if not isinstance(text, str):
            msg = f"openai-harmony's decode returned a {type(text).__name__}, not a str"
            raise TypeError(msg)
        return text

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, special-token spellings in it encoded as plain text."""
        return checked_ids(self.encoding.encode(text, disallowed_special=()), "encode(text)")
