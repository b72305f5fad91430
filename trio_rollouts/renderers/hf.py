"""``HFRenderer``: a Hugging Face tokenizer's chat template, in its ids."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from trio_rollouts._messages import ChatMessage
from trio_rollouts.renderers._base import (
    AssistantTurn,
    assemble_turn,
    checked_ids,
    declared_roles,
    refuse_assistant_messages,
    remainder,
)
from trio_rollouts.renderers._families import (
    REASONING_OPENINGS,
    REASONING_PARSERS,
    TOOL_PARSERS,
    Family,
    detect,
)

__all__ = ["HFRenderer", "tokenizer_vocabulary"]

#: The base conversations :meth:`HFRenderer.bridge` renders the new messages after when
#: it is not given the conversation at hand (``messages=None``): the bridge is proved
#: only if it is the same after each.
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
#: ``tool_parser=``/``reasoning_parser=``: read the family from the template.
AUTO = "auto"
#: A tool the close is probed with when the template renders nothing without tools
#: (Hermes-3's tool-use template).
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe",
            "description": "A probe.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
#: The call ids Mistral's templates accept.
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
#: Tool-call formats whose templates write a call's arguments as the JSON string they are
#: given (DeepSeek's concatenate them); every other template is given an object.
_STRING_ARGUMENTS = frozenset({"deepseek_v3", "deepseek_v31"})


def tokenizer_vocabulary(tokenizer: Any) -> str | None:
    """The fingerprint of a Hugging Face tokenizer's vocabulary: ``"hf:"`` and 16 hex
    digits of a digest of its token-to-id map (added tokens included), so tokenizers
    whose ids mean the same tokens (two sizes of one model family, one tokenizer loaded
    twice) have the same; ``None`` for a tokenizer without ``get_vocab()``. What
    :attr:`HFRenderer.token_vocabulary` is, and a backend served with that tokenizer
    declares (:class:`~trio_rollouts.testing.VocabularyInference`)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocabulary = get_vocab() if callable(get_vocab) else None
    if not isinstance(vocabulary, Mapping) or not vocabulary:
        return None
    text = json.dumps(sorted(vocabulary.items()), ensure_ascii=False)
    return "hf:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _close_ids(value: Iterable[object]) -> list[int]:
    return checked_ids(value, "close_ids")


def _stop_token_ids(value: Iterable[object]) -> list[int]:
    return checked_ids(value, "stop_token_ids")


def _eos_token_ids(value: Iterable[object]) -> tuple[int, ...]:
    return tuple(checked_ids(value, "eos_token_ids"))


def _check_tool_parser(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value != AUTO and value not in TOOL_PARSERS:
        names = ", ".join(sorted(TOOL_PARSERS))
        msg = f"tool_parser must be 'auto' or one of {names}; got {value!r:.40}"
        raise ValueError(msg)


def _check_reasoning_parser(
    instance: object, attribute: attrs.Attribute[Any], value: object
) -> None:
    if value is not None and value != AUTO and value not in REASONING_PARSERS:
        names = ", ".join(sorted(REASONING_PARSERS))
        msg = f"reasoning_parser must be 'auto', None or one of {names}; got {value!r:.40}"
        raise ValueError(msg)


@attrs.frozen(eq=False)
class HFRenderer:
    """A Hugging Face tokenizer's chat template, in its ids.

    ``tokenizer`` is anything with ``apply_chat_template``, ``encode`` and ``decode`` (a
    ``transformers`` ``PreTrainedTokenizerFast``, say); this class never imports
    ``transformers`` (only :meth:`from_pretrained` does). A :class:`ChatMessage` goes to the
    template as ``{"role": ..., "content": ..., **extra}``; an assistant message's
    ``tool_calls`` arguments given as a JSON string go as the object it holds (as vLLM
    hands them to templates; DeepSeek's templates, which concatenate the string, get it
    as is), ``reasoning_content`` also as ``reasoning`` and ``thinking`` (the names
    other templates read), and for Mistral's templates call ids that are not nine letters
    and digits go as nine derived from them (in calls and replies alike).

    **Families.** ``tool_parser`` and ``reasoning_parser`` name the model's formats as
    vLLM names its parsers (``hermes``, ``llama3_json``, ``mistral``, ``openai``,
    ``glm45``, ``kimi_k2``, ``deepseek_v3``, ``deepseek_v31``, ``pythonic``,
    ``qwen3_coder``, ``phi4_mini_json``; reasoning ``deepseek_r1``, ``qwen3``, ``glm45``,
    ``kimi_k2``, ``openai_gptoss``, ``mistral``). ``"auto"`` (the default) reads them from the
    template where its markers are one family's, and is a ``ValueError`` naming the
    choices where they are not; a template with no tool-call markers reads ``hermes``.
    ``family`` says what was read.

    **Ends of turns.** ``close_ids`` (what ends an assistant turn) is, unless given, read
    from the template: the special tokens it writes right after an assistant message's
    content both when the message is the last and when a user message follows (never
    the EOS some templates write after the last message only). It may be empty when
    the template closes a turn with the next message's opening (GLM's ``<|user|>``,
    ``<|observation|>``); a template that writes no special token after a turn in
    either case is a ``ValueError``: pass ``close_ids=`` then. ``stop_token_ids`` is,
    unless given, ``close_ids``, the tokenizer's ``eos_token_id``, ``eos_token_ids``
    (:meth:`from_pretrained` reads them from the model's ``generation_config.json``) and
    the family's own stops that the vocabulary has (Llama 3's ``<|eom_id|>``, gpt-oss's
    ``<|call|>``, GLM's ``<|observation|>``, ...).

    :meth:`parse` decodes the ids without their trailing stop ids, splits the reasoning
    off (also when the generation prompt opened it, as QwQ's and DeepSeek-R1's do) and
    reads the tool calls in the family's format.

    **Roles.** ``extra_roles``: the roles the template renders besides ``system``,
    ``user``, ``assistant`` and ``tool`` (Llama 3's ``"ipython"``, gpt-oss's
    ``"developer"``), declared to :class:`~trio_rollouts.ChatMessage` when the renderer
    is made; an episode refuses a message of any other role. A bridge whose new messages
    the template renders as nothing at all (Phi-3.5's has no tool role) is ``None``.

    **Vocabulary.** :attr:`token_vocabulary` is the tokenizer's
    (:func:`tokenizer_vocabulary`): a backend whose ids are others (the embedded one's
    code points) is refused with this renderer.

    The tokenizer (and its template) must not change once the renderer is made.
    """

    tokenizer: Any
    tool_parser: str = attrs.field(default=AUTO, kw_only=True, validator=_check_tool_parser)
    reasoning_parser: str | None = attrs.field(
        default=AUTO, kw_only=True, validator=_check_reasoning_parser
    )
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), kw_only=True, converter=_eos_token_ids)
    extra_roles: tuple[str, ...] = attrs.field(default=(), kw_only=True, converter=declared_roles)
    family: Family | None = attrs.field(init=False)
    _close_ids: list[int] = attrs.field(kw_only=True, converter=_close_ids, alias="close_ids")
    _stop_token_ids: list[int] = attrs.field(
        kw_only=True, converter=_stop_token_ids, alias="stop_token_ids"
    )
    _tools_format: str = attrs.field(init=False, repr=False)
    _reasoning_format: str | None = attrs.field(init=False, repr=False)
    _reasoning_opened: bool = attrs.field(init=False, repr=False)
    _bases: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = attrs.field(
        init=False, factory=dict, repr=False
    )
    # The tokenizer's vocabulary fingerprint, once worked out (a digest of the whole map).
    _vocabulary: list[str | None] = attrs.field(init=False, factory=list, repr=False)

    @family.default
    def _detect_family(self) -> Family | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return detect(template) if isinstance(template, str) else None

    @_tools_format.default
    def _choose_tool_parser(self) -> str:
        if self.tool_parser != AUTO:
            return self.tool_parser
        if self.family is not None:
            return self.family.tool_parser
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, str) and _looks_like_tools(template):
            names = ", ".join(sorted(TOOL_PARSERS))
            msg = (
                "HFRenderer could not tell the tool-call format from the chat template "
                f"(its markers are no single family's); pass tool_parser= one of {names}"
            )
            raise ValueError(msg)
        return "hermes"

    @_reasoning_format.default
    def _choose_reasoning_parser(self) -> str | None:
        if self.reasoning_parser != AUTO:
            return self.reasoning_parser
        return self.family.reasoning_parser if self.family is not None else None

    @_reasoning_opened.default
    def _generation_prompt_opens_reasoning(self) -> bool:
        if self._reasoning_format is None:
            return False
        opening = REASONING_OPENINGS[self._reasoning_format]
        try:
            prompt = self._template([{"role": "user", "content": "Probe question."}], None, True)
        except Exception:
            return False
        return prompt.rstrip().endswith(opening)

    @_close_ids.default
    def _derive_close_ids(self) -> list[int]:
        last = self._specials_after_answer(followed=False)
        followed = self._specials_after_answer(followed=True)
        close: list[int] = []
        for a, b in zip(last, followed, strict=False):
            if a != b:
                break
            close.append(a)
        if not close and not followed and not last:
            msg = (
                "HFRenderer could not derive close_ids: the chat template writes no special "
                "token after an assistant message; pass close_ids= (the ids that end an "
                "assistant turn)"
            )
            raise ValueError(msg)
        return close

    @_stop_token_ids.default
    def _derive_stop_token_ids(self) -> list[int]:
        stops = list(self._close_ids)
        candidates: list[object] = [getattr(self.tokenizer, "eos_token_id", None)]
        candidates += self.eos_token_ids
        if self.family is not None:
            candidates += [self._token_id(token) for token in self.family.stop_tokens]
        for token in candidates:
            if isinstance(token, int) and not isinstance(token, bool) and token not in stops:
                stops.append(token)
        return stops

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        close_ids: Sequence[int] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        tool_parser: str = AUTO,
        reasoning_parser: str | None = AUTO,
        extra_roles: Sequence[str] = (),
        **kwargs: Any,
    ) -> HFRenderer:
        """The renderer of ``transformers.AutoTokenizer.from_pretrained(path, **kwargs)``
        (needs the ``hf`` extra), with the EOS ids of the model's generation config
        (``generation_config.json``, when there is one) among its stops; the other
        arguments as in the class."""
        try:
            import transformers  # the optional hf extra: imported only here
        except ImportError as error:
            msg = "HFRenderer.from_pretrained needs transformers: pip install 'trio-rollouts[hf]'"
            raise ImportError(msg) from error
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, **kwargs)
        overrides: dict[str, Any] = {}
        if close_ids is not None:
            overrides["close_ids"] = list(close_ids)
        if stop_token_ids is not None:
            overrides["stop_token_ids"] = list(stop_token_ids)
        return cls(
            tokenizer,
            tool_parser=tool_parser,
            reasoning_parser=reasoning_parser,
            eos_token_ids=_generation_eos_ids(transformers, path, kwargs),
            extra_roles=tuple(extra_roles),
            **overrides,
        )

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_token_ids)

    @property
    def token_vocabulary(self) -> str | None:
        """The tokenizer's vocabulary (:func:`tokenizer_vocabulary`), worked out once."""
        if not self._vocabulary:
            self._vocabulary.append(tokenizer_vocabulary(self.tokenizer))
        return self._vocabulary[0]

    def call_id(self, turn: int, index: int) -> str:
        """The id of a call the model wrote without one: ``call_<turn>_<index>``, or for
        Mistral's templates (which refuse any id but nine letters and digits) nine
        derived from it."""
        call_id = f"call_{turn}_{index}"
        return _mistral_id(call_id) if self._tools_format == "mistral" else call_id

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
        read as such; nothing is added). A template that refuses the conversation (its
        ``raise_exception``) is a ``ValueError`` naming what it said."""
        conversation = [self._template_message(message) for message in messages]
        return self.encode(self._template(conversation, tools, add_generation_prompt))

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        messages: Sequence[ChatMessage] | None = None,
    ) -> list[int] | None:
        """The ids after a finished turn, or ``None`` when they cannot be proved.

        With ``messages`` (the conversation ``previous_ids`` holds, assistant turns as
        structured messages), the proof is made on it: the template's render of
        ``messages`` and ``new_messages`` with the generation prompt must start with the
        text of ``previous_ids``, and the bridge is the rest, encoded; or, with a
        tokenizer that normalizes text before it splits it (Qwen's NFC), start with text
        that normalizes as it does, up to the same ``close_ids``, since a message encoded
        earlier decodes normalized. A template that rewrites history (drops earlier
        reasoning, writes a call otherwise than the model did, moves the system prompt,
        refuses the conversation) gives ``None``.

        Without ``messages``, the new messages are rendered after two fixed base
        conversations, and the bridge is returned only if it is the same after both and
        ``previous_ids`` ends with ``close_ids``: a weaker proof, which cannot see what the
        template does to the conversation at hand.
        """
        refuse_assistant_messages(new_messages)
        if messages is not None:
            before = [self._template_message(m) for m in messages]
            conversation = before + [self._template_message(m) for m in new_messages]
            try:
                full = self._template(conversation, tools, True)
            except ValueError:
                return None
            text = self.decode(previous_ids)
            rest = remainder(text, full)
            if rest is None:
                rest = self._normalized_remainder(text, full)
            if rest is None or (new_messages and self._drops(before, tools, full)):
                return None
            return self.encode(rest)
        close = self._close_ids
        if not close or list(previous_ids[max(len(previous_ids) - len(close), 0) :]) != close:
            return None
        bridges = []
        renders = self._base_renders(tools)
        for base, (cut, _) in zip(_BRIDGE_BASES, renders, strict=True):
            if not cut:
                return None
            full_ids = self.render([*base, *new_messages], tools=tools)
            if tuple(full_ids[: len(cut)]) != cut:
                return None
            bridges.append(full_ids[len(cut) :])
        if any(bridge != bridges[0] for bridge in bridges):
            return None
        if new_messages and tuple(bridges[0]) == renders[0][1]:
            return None  # the new messages render to nothing: no more than the prompt
        return bridges[0]

    def _normalized_remainder(self, prefix: str, full: str) -> str | None:
        """What ``full`` has after ``prefix`` where the two differ only as the tokenizer's
        normalizer makes them the same (Qwen's NFC: a message the template writes
        decomposed, an ``e`` and a combining accent, was encoded, so ``prefix``, a
        decode, holds it composed): ``prefix`` ends with the text of ``close_ids`` and
        ``full`` up to the same occurrence of it normalizes as ``prefix`` does. The rest
        is cut from ``full`` after that special token, so the bridge encodes as a full
        render would; ``None`` without a normalizer or a close. Tried only when the plain
        proof fails."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        normalize = getattr(getattr(backend, "normalizer", None), "normalize_str", None)
        close = self.decode(self._close_ids) if self._close_ids else ""
        if not callable(normalize) or not close or not prefix.endswith(close):
            return None
        end = 0
        for _ in range(prefix.count(close)):
            found = full.find(close, end)
            if found < 0:
                return None
            end = found + len(close)
        if normalize(full[:end]) != normalize(prefix):
            return None
        return full[end:]

    def _drops(
        self, before: list[dict[str, Any]], tools: list[dict[str, Any]] | None, full: str
    ) -> bool:
        """Whether new messages after ``before`` rendered to no text: ``full`` (the
        render with them) is the render without them. One more template render per
        bridge (``benchmarks/bridge.py``, Qwen2.5's template, 8 turns from 2,048 ids:
        about 160 of 860 µs per turn; the decode of the episode's ids costs more)."""
        try:
            return self._template(before, tools, True) == full
        except ValueError:
            return False  # refused without them: they rendered something

    def parse(self, completion_ids: Sequence[int]) -> AssistantTurn:
        ids = list(completion_ids)
        stops = set(self._stop_token_ids)
        while ids and ids[-1] in stops:
            ids.pop()
        text = self.decode(ids)
        reasoning: str | None = None
        if self._reasoning_format is not None:
            split = REASONING_PARSERS[self._reasoning_format]
            reasoning, text = split(text, opened=self._reasoning_opened)
        content, calls = TOOL_PARSERS[self._tools_format](text)
        return assemble_turn(content, calls, reasoning)

    def decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if not isinstance(text, str):
            msg = f"the tokenizer's decode returned a {type(text).__name__}, not a str"
            raise TypeError(msg)
        return text

    def encode(self, text: str) -> list[int]:
        return checked_ids(self.tokenizer.encode(text, add_special_tokens=False), "encode(text)")

    def _template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except ImportError:
            raise  # a missing install (jinja2)
        except Exception as error:
            # raise_exception's TemplateError, or the template failing on the messages
            # (DeepSeek's concatenating an object): either way it cannot render them.
            msg = f"the chat template refused the conversation: {error}"
            raise ValueError(msg) from error
        if not isinstance(text, str):
            msg = (
                "the tokenizer's apply_chat_template(..., tokenize=False) returned a "
                f"{type(text).__name__}, not a str"
            )
            raise TypeError(msg)
        return text

    def _token_id(self, token: str) -> int | None:
        """The id of a token the vocabulary has as one token, else ``None``."""
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and self.decode(ids) == token else None

    def _special_ids(self) -> set[int]:
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        special.update(
            token for token, added_token in added.items() if getattr(added_token, "special", False)
        )
        return special

    def _specials_after_answer(self, *, followed: bool) -> list[int]:
        """The special tokens the template writes right after an assistant message's
        content, when it is the last message or when a user message follows."""
        probe = [
            {"role": "user", "content": "Probe question."},
            {"role": "assistant", "content": _PROBE_CONTENT},
        ]
        if followed:
            probe.append({"role": "user", "content": "Next question."})
        try:
            try:
                text = self._template(probe, None, False)
            except ValueError:
                text = self._template(probe, _PROBE_TOOLS, False)
        except ImportError:
            raise
        except Exception as error:
            msg = (
                "HFRenderer could not derive close_ids: the chat template does not render "
                f"a user message and an assistant answer ({error!r}); pass close_ids="
            )
            raise ValueError(msg) from error
        if _PROBE_CONTENT not in text:
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
        return close

    def _base_renders(
        self, tools: list[dict[str, Any]] | None
    ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """Per base: its render (no generation prompt) cut just after its last
        ``close_ids`` (empty if they are not there), and the bridge of no message after
        that cut (the rest of its render with the generation prompt; empty if that does
        not extend the cut); kept per tools value."""
        try:
            key: str | None = json.dumps(tools, sort_keys=True)
        except (TypeError, ValueError):
            key = None  # not JSON: computed every time
        if key is not None and key in self._bases:
            return self._bases[key]
        renders: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        try:
            for base in _BRIDGE_BASES:
                cut = _cut_after_last(
                    self.render(base, tools=tools, add_generation_prompt=False), self._close_ids
                )
                prompted = self.render(base, tools=tools)
                extends = bool(cut) and tuple(prompted[: len(cut)]) == cut
                renders.append((cut, tuple(prompted[len(cut) :]) if extends else ()))
        except ValueError:
            renders = [((), ()), ((), ())]
        result = tuple(renders)
        if key is not None:
            if len(self._bases) >= _BASE_CACHE_SIZE:
                self._bases.clear()
            self._bases[key] = result
        return result

    def _template_message(self, message: ChatMessage) -> dict[str, Any]:
        """A message as this family's template reads it (see the class docstring)."""
        data: dict[str, Any] = {
            **message.extra,
            "role": message.role,
            "content": message.content,
        }
        mistral = self._tools_format == "mistral"
        calls = data.get("tool_calls")
        if isinstance(calls, list):
            decode = self._tools_format not in _STRING_ARGUMENTS
            data["tool_calls"] = [_template_call(call, decode, mistral) for call in calls]
        if mistral and isinstance(data.get("tool_call_id"), str):
            data["tool_call_id"] = _mistral_id(data["tool_call_id"])
        reasoning = data.get("reasoning_content")
        if isinstance(reasoning, str):
            data.setdefault("reasoning", reasoning)
            data.setdefault("thinking", reasoning)
        return data


def _mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates accept it: itself when it is nine letters and
    digits, else nine derived from it (the same for the call and its reply)."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _template_call(call: object, decode: bool, mistral: bool) -> object:
    if not isinstance(call, dict):
        return call
    if mistral and isinstance(call.get("id"), str):
        call = {**call, "id": _mistral_id(call["id"])}
    if not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if decode and isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            function["arguments"] = decoded
    return {**call, "function": function}


def _looks_like_tools(template: str) -> bool:
    return "tool_calls" in template or "tools" in template


def _generation_eos_ids(transformers: Any, path: object, kwargs: dict[str, Any]) -> list[int]:
    """The EOS ids of the model's generation config (none when it has none)."""
    try:
        config = transformers.GenerationConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError):
        return []
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [token for token in eos if isinstance(token, int)]
    return []


def _cut_after_last(ids: list[int], close: list[int]) -> tuple[int, ...]:
    """``ids`` up to the end of the last occurrence of ``close`` (empty if none)."""
    for end in range(len(ids), len(close) - 1, -1):
        if ids[end - len(close) : end] == close:
            return tuple(ids[:end])
    return ()
