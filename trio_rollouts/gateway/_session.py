"""One gateway session: the calls of one agent run, made into one token stream.

A session keeps what an episode keeps (:class:`~trio_rollouts.episodes.Element`, the
token-stream element: ids, mask, logprobs, epochs, the sampling record) and the
conversation the current element holds, as the session saw it: the messages the agent
sent and the replies the session gave. Each call's message list is matched against that
conversation:

- it *extends* it when every message the session knows is there unchanged (an assistant
  message matches the reply given at its place when its content, ``None`` equal to ``""``,
  and its tool calls, ids, names and arguments compared as parsed JSON, are the same),
  the tools are the same, and what follows holds no assistant message: then only the
  bridge to the new messages is rendered (after the close ids of a turn that did not end
  on its stop id), proved on the conversation as an episode's is;
- anything else (a rewritten or shortened history, an assistant message the session did
  not write, a changed tool set, a renderer that cannot prove the bridge) starts a new
  element from a full render: a *break*, counted (or :class:`TemplateBreakError` with
  ``on_break="raise"``). The first call of a session is not a break.

Generation is token-in where the backend :func:`~trio_rollouts.inference.accepts_tokens`;
otherwise the chat is sent and the turn is ``"server_tokens"`` or ``"retokenized"``, as
in episodes. Calls run one at a time in arrival order (a FIFO lock). A call is committed
when the backend returns: its ids are appended before anything else can run, whether or
not the client is still there.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping
from typing import Any

import attrs

from trio_rollouts._messages import ChatMessage, GenerationArgs
from trio_rollouts.episodes import (
    RANK,
    Element,
    TemplateBreakError,
    TokenFidelityError,
    backend_fidelity,
    bridge_ids,
    call_start_epoch_or,
    close_ids,
    fidelity_error,
    numbered,
    read_turn,
    start_element,
    takes_messages,
    token_rollout,
    turn_record,
    what_lacked,
)
from trio_rollouts.inference import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    Pausable,
)
from trio_rollouts.inference._sampling import derive_seed
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._rollouts import TokenRollout
from trio_rollouts.pipeline._sampling import seeded
from trio_rollouts.renderers import AssistantTurn, Renderer

__all__ = ["GatewayError", "SessionState"]

#: Roles a message sent to the gateway may have.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Keys of a message kept beside role and content (what templates read).
_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
#: Generation fields a request body may set, and the GenerationArgs field each fills.
_BODY_ARGS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "seed": "seed",
}


class GatewayError(Exception):
    """A call the gateway refuses, answered in the OpenAI error shape: ``status`` (400,
    401, 404, 405, 409, 413, 500), ``type`` and the message."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "code": self.status}}


# --------------------------------------------------------------------------- the body


def _text(content: object, where: str) -> str:
    """A message's content as text: a string, ``None`` (empty), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "text":
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                    continue
            msg = (
                f"{where}.content[{i}] must be a text part ({{'type': 'text', 'text': ...}}): "
                f"the gateway renders text only, got {part!r:.80}"
            )
            raise GatewayError(400, msg)
        return "".join(parts)
    msg = f"{where}.content must be a string, null or a list of text parts, got {content!r:.80}"
    raise GatewayError(400, msg)


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        msg = f"{where}.tool_calls must be a list, got {value!r:.80}"
        raise GatewayError(400, msg)
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            msg = f"{where}.tool_calls[{i}] must have function.name, got {call!r:.80}"
            raise GatewayError(400, msg)
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def parse_messages(value: object) -> list[ChatMessage]:
    """The body's ``messages`` as :class:`ChatMessage` objects (400 naming the message
    and the field otherwise)."""
    if not isinstance(value, list) or not value:
        msg = f"messages must be a non-empty list of message objects, got {value!r:.80}"
        raise GatewayError(400, msg)
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            msg = f"{where} must be an object, got {message!r:.80}"
            raise GatewayError(400, msg)
        role = message.get("role")
        if role not in _ROLES and role not in ChatMessage.allowed_roles():
            msg = f"{where}.role must be one of {sorted(_ROLES)}, got {role!r:.40}"
            raise GatewayError(400, msg)
        if role == "developer" and role not in ChatMessage.allowed_roles():
            # OpenAI's newer name for the system message (the SDKs send it for some
            # models): a template without a developer role renders it as system (most
            # drop an unknown role without a word); a renderer that renders "developer"
            # declares it (extra_roles) and gets it as it is.
            role = "system"
        extra: dict[str, Any] = {}
        for key in _MESSAGE_KEYS:
            item = message.get(key)
            if item is None:
                continue
            if key == "tool_calls":
                if item:
                    extra[key] = _tool_calls(item, where)
            else:
                extra[key] = item
        messages.append(
            ChatMessage(role=str(role), content=_text(message.get("content"), where), extra=extra)
        )
    return messages


def parse_tools(value: object) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, Mapping) for tool in value):
        msg = f"tools must be a list of tool objects, got {value!r:.80}"
        raise GatewayError(400, msg)
    return [dict(tool) for tool in value]


def body_args(body: Mapping[str, Any], base: GenerationArgs) -> GenerationArgs:
    """``base`` (the gateway's: the trainer's sampling), with the fields it leaves unset
    taken from the request body (400 naming a field whose value is not allowed)."""
    if not _BODY_ARGS.keys() & body.keys():
        return base  # the body sets no sampling field (most agents)
    given: dict[str, Any] = {}
    for key, field in _BODY_ARGS.items():
        value = body.get(key)
        if value is not None and getattr(base, field) is None and field not in given:
            given[field] = value
    try:
        return base.add(GenerationArgs(**given))
    except (TypeError, ValueError) as exc:
        raise GatewayError(400, str(exc)) from None


# --------------------------------------------------------------------------- matching


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _same_calls(sent: object, given: object) -> bool:
    a = sent if isinstance(sent, list) else []
    b = given if isinstance(given, list) else []
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        fx, fy = x.get("function", {}), y.get("function", {})
        if x.get("id") != y.get("id") or fx.get("name") != fy.get("name"):
            return False
        if _arguments(fx.get("arguments", "")) != _arguments(fy.get("arguments", "")):
            return False
    return True


def matches(sent: ChatMessage, known: ChatMessage) -> bool:
    """Whether a message the agent sent is the one the session knows at its place: for a
    reply, its content and tool calls; otherwise role, content and the keys templates
    read."""
    if sent.role != known.role or sent.content != known.content:
        return False
    if known.role == "assistant":
        return _same_calls(sent.extra.get("tool_calls"), known.extra.get("tool_calls"))
    return all(sent.extra.get(key) == known.extra.get(key) for key in _MESSAGE_KEYS)


# --------------------------------------------------------------------------- the session


@attrs.define(eq=False)
class SessionState:
    """What one session has built: its elements and the conversation of the last one;
    :meth:`call` makes one model call, :meth:`rollout` the session's rollout."""

    inference: InferenceInterface
    renderer: Renderer
    generation_args: GenerationArgs
    on_break: str
    model: str
    start_epoch: int = 0
    fidelity: str = "exact"
    promised: str = "exact"
    elements: list[Element] = attrs.field(factory=list)
    #: The current element's conversation: what the agent sent and the replies given.
    conversation: list[ChatMessage] = attrs.field(factory=list)
    tools: list[dict[str, Any]] | None = None
    #: The last turn: its sampled ids, and whether it may lack its stop id.
    last_sampled: list[int] = attrs.field(factory=list)
    last_open: bool = False
    calls: int = 0
    breaks: int = 0
    parse_errors: int = 0
    truncated_turns: int = 0
    tool_calls: int = 0
    per_turn: list[dict[str, Any]] = attrs.field(factory=list)
    takes_messages: bool = False
    #: The session's seed: call ``k`` gets ``derive_seed(seed, k)`` (``None``: no seed).
    seed: int | None = None

    @classmethod
    def open(
        cls,
        inference: InferenceInterface,
        renderer: Renderer,
        generation_args: GenerationArgs,
        on_break: str,
        model: str,
        *,
        takes: bool | None = None,
        seed: int | None = None,
    ) -> SessionState:
        """A new session's state (``takes``: whether the renderer's bridge takes
        ``messages=``, when the caller knows already; ``seed``: the session's seed)."""
        epoch = call_start_epoch_or(None)
        if epoch is None:
            epoch = inference.policy_epoch if isinstance(inference, Pausable) else 0
        promised = backend_fidelity(inference)
        return cls(
            inference=inference,
            renderer=renderer,
            generation_args=generation_args,
            on_break=on_break,
            model=model,
            start_epoch=epoch,
            fidelity=promised,
            promised=promised,
            takes_messages=takes_messages(renderer) if takes is None else takes,
            seed=seed,
        )

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation of the current element: the last call's messages and reply."""
        return list(self.conversation)

    # ------------------------------------------------------------------- a call

    def prepare(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> None:
        """Make the current element end where the model is to generate for ``messages``:
        extend it by a bridge, or start a new one (a break). Not a checkpoint."""
        renderer = self.renderer
        known = self.conversation
        why: str | None = None
        if not self.elements:
            self.start(messages, tools, broke=None)
            return
        if tools != self.tools:
            why = "the tools changed"
        elif len(messages) <= len(known) or not all(
            matches(sent, have) for sent, have in zip(messages, known, strict=False)
        ):
            why = "the messages do not extend the session's conversation (history rewritten)"
        new = messages[len(known) :]
        if why is None and any(message.role == "assistant" for message in new):
            why = "an assistant message the session did not write"
        if why is None:
            element = self.elements[-1]
            close = close_ids(renderer, self.last_sampled, self.last_open)
            bridge = bridge_ids(
                renderer,
                element.ids + close,
                new,
                tools=tools,
                conversation=known,
                with_messages=self.takes_messages,
            )
            if bridge is not None:
                element.extend(close)
                element.extend(bridge)
                self.truncated_turns += bool(close)
                self.conversation.extend(new)
                return
            why = "the renderer could not prove a bridge (the template rewrites history)"
        self.start(messages, tools, broke=why)

    def start(
        self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, broke: str | None
    ) -> None:
        """A new element from a full render of ``messages`` (a break unless the first)."""
        if broke is not None:
            if self.on_break == "raise":
                msg = f"call {self.calls + 1} of the session: {broke}"
                raise TemplateBreakError(msg)
            self.breaks += 1
        # An element with nothing sampled is replaced.
        start_element(self.elements, self.renderer.render(messages, tools=tools))
        self.conversation = list(messages)
        self.tools = tools
        self.last_sampled, self.last_open = [], False

    async def generate(
        self, messages: list[ChatMessage], args: GenerationArgs
    ) -> tuple[InferenceResponse, list[int], str, int]:
        """Generate after the current element; return the response, the sampled ids, the
        turn's fidelity and the element position of the first sampled id. The ids are
        appended (committed) when the backend returns, with no checkpoint in between.

        Cancellation: cancels the model call; nothing is appended."""
        element = self.elements[-1]
        kind = self.promised
        if self.seed is not None:
            args = seeded(args, derive_seed("gateway", self.seed, self.calls))
        request = InferenceRequest(
            prompt=list(messages),
            tools=self.tools,
            generation_args=args,
            prompt_ids=list(element.ids) if kind == "exact" else None,
        )
        response = await self.inference.agenerate(request)
        # From here to the return: no checkpoint, so the call commits as a whole.
        kind, sampled, logprobs, server_prompt = read_turn(
            self.inference, self.renderer, element.ids, response, kind
        )
        if server_prompt is not None:
            self.server_break(server_prompt)
            element = self.elements[-1]
        if kind != "exact":
            self.fidelity = min(self.fidelity, kind, key=RANK.__getitem__)
        offset = element.take(sampled, logprobs, response, args, self.start_epoch)
        self.last_sampled = list(sampled)
        self.last_open = response.finish_reason == "length" or kind == "retokenized"
        return response, sampled, kind, offset

    def server_break(self, server_prompt: list[int]) -> None:
        """The server rendered another prompt than the session's ids: a break (or
        :class:`TemplateBreakError`); the new element starts from what the model saw."""
        if self.on_break == "raise":
            msg = (
                f"call {self.calls + 1} of the session: the server rendered a prompt that "
                "differs from the session's ids"
            )
            raise TemplateBreakError(msg)
        self.breaks += 1
        start_element(self.elements, server_prompt)

    def reply(
        self, response: InferenceResponse, sampled: list[int], start: int, model: str
    ) -> dict[str, Any]:
        """The call's ``chat.completion`` object; the reply joins the conversation."""
        self.calls += 1
        turn = numbered(self.renderer, self.renderer.parse(sampled), self.calls)
        self.parse_errors += turn.parse_error is not None
        self.tool_calls += len(turn.tool_calls)
        message = turn.to_message()
        self.conversation.append(message)
        self.record(turn, response, start)
        body: dict[str, Any] = {"role": "assistant", "content": message.content or None}
        if turn.tool_calls:
            body["tool_calls"] = message.extra["tool_calls"]
        if turn.reasoning is not None:
            body["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            finish = "tool_calls"
        elif response.finish_reason == "length":
            finish = "length"
        else:
            finish = "stop"
        prompt_tokens = start
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": body, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(sampled),
                "total_tokens": prompt_tokens + len(sampled),
            },
        }

    def record(self, turn: AssistantTurn, response: InferenceResponse, start: int) -> None:
        end = len(self.elements[-1].ids)
        self.per_turn.append(turn_record(turn, response, len(self.elements) - 1, start, end))

    def check_fidelity(self, minimum: str) -> None:
        if RANK[self.promised] < RANK[minimum]:
            message = fidelity_error(
                self.inference, self.promised, minimum, what_lacked(self.promised)
            )
            raise TokenFidelityError(message)

    # ------------------------------------------------------------------- the rollout

    def rollout(
        self, reward: float, env_id: str, problem: Problem | None, session: str
    ) -> TokenRollout:
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            msg = f"reward must be a finite number, got {reward!r:.40}"
            raise TypeError(msg)
        if not math.isfinite(reward):
            msg = f"reward must be a finite number, got {reward!r}"
            raise ValueError(msg)
        elements = [element for element in self.elements if any(element.mask)]
        if not elements:
            msg = (
                f"session {session!r} committed no model call: there is no rollout to make "
                "(did the agent call the gateway's base_url?)"
            )
            raise RuntimeError(msg)
        return token_rollout(
            elements,
            start_epoch=self.start_epoch,
            reward=float(reward),
            fidelity=self.fidelity,
            env_id=env_id,
            problem_id=None if problem is None else problem.problem_id,
            extra={
                "gateway": {
                    "session": session,
                    "calls": self.calls,
                    "breaks": self.breaks,
                    "tool_calls": self.tool_calls,
                    "parse_errors": self.parse_errors,
                    "truncated_turns": self.truncated_turns,
                    "per_turn": self.per_turn,
                }
            },
        )
