"""``HFRenderer`` and ``MultiTurnAgent`` on the real chat templates of
``tests/data/chat_templates`` (one offline tokenizer per family, see ``_families.py``).

- the close and stop ids each template gives, against what is principled;
- random episodes per family on the MockClock, with a token-in model that writes each
  assistant turn as the template itself writes that message (the text cut out of the
  template's render of the conversation with the message), or not quite so (extra
  whitespace, compact JSON: breaks), or cut by ``max_tokens``. Every request's
  ``prompt_ids`` must extend its element exactly or be a full render at a counted break,
  and be the template's render of the structured conversation so far, encoded;
- a per-family summary (``pytest -s`` prints it): close ids, stops, whether a canonical
  tool episode is append-only, where breaks come from, whether native calls and
  reasoning are read back.
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_rollouts import (
    AssistantTurn,
    BaseEnvironment,
    ChatMessage,
    EnvironmentStep,
    GenerationArgs,
    GroupedRolloutRequest,
    HFRenderer,
    MultiTurnAgent,
    Problem,
    PromptSource,
    TokenRollout,
)
from trio_rollouts.inference import (
    AcceptsTokens,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    ReturnsLogProbs,
    ReturnsRaw,
)

pytest.importorskip("transformers", reason="the hf extra is not installed")
import _families

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


# --------------------------------------------------------------------------- families


@attrs.frozen(kw_only=True)
class Spec:
    """How a family's model writes, for these tests."""

    #: The model calls the calculator (tool messages answer it); False: no tool role in
    #: the template (Gemma, Phi-3.5, Phi-4) or a template the tool episode cannot render.
    tools: bool = True
    #: The model writes reasoning in the family's format.
    reasoning: bool = False
    #: The template writes an assistant's content next to its tool calls.
    content_with_call: bool = True
    #: The template writes no tool calls: the model's call text, by hand (kimi, phi4-mini,
    #: smollm3), as ``(expression, call id) -> text``.
    call_text: Any = None
    #: The model writes its call ids (Mistral: nine letters and digits).
    writes_ids: bool = False
    #: The stop a text turn ends with when the template writes none after the last
    #: message (GLM closes a turn with the next message's opening).
    text_stop: str | None = None
    #: HFRenderer arguments the template cannot give.
    renderer: dict[str, Any] = attrs.field(factory=dict)


def _hermes_call(expression: str, call_id: str) -> str:
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


def _kimi_call(expression: str, call_id: str) -> str:
    arguments = json.dumps({"expression": expression})
    return (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0"
        f"<|tool_call_argument_begin|>{arguments}<|tool_call_end|><|tool_calls_section_end|>"
    )


def _phi4_mini_call(expression: str, call_id: str) -> str:
    arguments = json.dumps({"expression": expression})
    return f'functools[{{"name": "calculator", "arguments": {arguments}}}]'


SPECS: dict[str, Spec] = {
    "qwen2.5": Spec(),
    "qwen3": Spec(reasoning=True),
    "qwq": Spec(reasoning=True),
    # The templates concatenate a call's arguments: HFRenderer hands them the JSON string.
    "deepseek-r1-distill": Spec(reasoning=True),
    "deepseek-v3.1": Spec(),
    "llama3.1": Spec(content_with_call=False),
    "llama3.2": Spec(content_with_call=False),
    # Renders nothing without tools: the close is read from a probe with a tool.
    "hermes3-tool-use": Spec(content_with_call=False),
    "mistral-nemo": Spec(content_with_call=False, writes_ids=True),
    "mistral-small-3.2": Spec(content_with_call=False, writes_ids=True),
    "gemma2": Spec(tools=False),
    "gemma3": Spec(tools=False),
    "gpt-oss": Spec(reasoning=True, content_with_call=False),
    "phi3.5": Spec(tools=False),
    "phi4": Spec(tools=False),
    "phi4-mini": Spec(call_text=_phi4_mini_call, renderer={"tool_parser": "phi4_mini_json"}),
    "glm4.5": Spec(reasoning=True, text_stop="<|user|>"),
    "glm4.6": Spec(reasoning=True, text_stop="<|user|>"),
    "kimi-k2": Spec(call_text=_kimi_call, renderer={"tool_parser": "kimi_k2"}),
    "smollm3": Spec(call_text=_hermes_call),
    "qwen3-coder": Spec(),
}
FAMILIES = sorted(_families.manifest())


def spec(family: str) -> Spec:
    return SPECS.get(family, Spec(tools=False))


@functools.cache
def renderer(family: str) -> HFRenderer:
    tokenizer = _families.tokenizer(family)
    kwargs = dict(spec(family).renderer)
    if "close_ids" in kwargs:
        kwargs["close_ids"] = [tokenizer.convert_tokens_to_ids(t) for t in kwargs["close_ids"]]
    return HFRenderer(tokenizer, **kwargs)


def tokens(family: str, ids: Sequence[int]) -> list[str]:
    return list(_families.tokenizer(family).convert_ids_to_tokens(list(ids)))


#: Families whose templates concatenate a call's arguments: they get the JSON string.
STRING_ARGUMENTS = {"deepseek-r1-distill", "deepseek-v3.1"}


def as_template_message(message: ChatMessage, family: str = "") -> dict[str, Any]:
    """A message as chat templates read it (as vLLM hands it over): arguments as
    objects (the JSON string for DeepSeek's templates, which concatenate it), reasoning
    also under ``reasoning`` and ``thinking``."""
    data: dict[str, Any] = {**message.extra, "role": message.role, "content": message.content}
    if "tool_calls" in data and family not in STRING_ARGUMENTS:
        data["tool_calls"] = [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": _object_or_text(call["function"]["arguments"]),
                },
            }
            for call in data["tool_calls"]
        ]
    if "reasoning_content" in data:
        data.setdefault("reasoning", data["reasoning_content"])
        data.setdefault("thinking", data["reasoning_content"])
    return data


def _object_or_text(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def template(
    family: str,
    messages: Sequence[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool = True,
) -> str:
    text = _families.tokenizer(family).apply_chat_template(
        [as_template_message(m, family) for m in messages],
        tools=tools,
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )
    assert isinstance(text, str)
    return text


def reference_ids(family: str, messages: Sequence[ChatMessage], tools: Any) -> list[int]:
    """``encode(apply_chat_template(messages, add_generation_prompt=True))``."""
    tokenizer = _families.tokenizer(family)
    return list(tokenizer.encode(template(family, messages, tools), add_special_tokens=False))


# --------------------------------------------------------------------------- the model


@attrs.frozen(kw_only=True)
class Plan:
    """One assistant turn the model will write."""

    #: "canonical", "spaced" (extra whitespace before the stop), "compact" (JSON
    #: without spaces), "cut" (canonical, stopped by max_tokens before its stop id).
    how: str = "canonical"
    call: bool = False
    content: str = ""
    reasoning: str = ""
    expression: str = "12*(3+4)"
    written_id: str = "a1B2c3D4e"


def assistant_message(family: str, plan: Plan, call_id: str) -> ChatMessage:
    """The structured message the model means to write (what the parse must give back)."""
    s = spec(family)
    extra: dict[str, Any] = {}
    content = plan.content
    if plan.call and s.tools:
        if not s.content_with_call or s.call_text is not None:
            content = ""
        arguments = json.dumps({"expression": plan.expression})
        extra["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "calculator", "arguments": arguments},
            }
        ]
    elif not content:
        content = "It is 84."
    if s.reasoning and plan.reasoning:
        extra["reasoning_content"] = plan.reasoning
    return ChatMessage(role="assistant", content=content, extra=extra)


def written_id(family: str, plan: Plan, turn: int) -> str:
    """The id the episode will know the call by: the model's own where it writes one,
    else the agent's ``call_<turn>_<index>``."""
    if spec(family).writes_ids:
        return plan.written_id
    if family == "kimi-k2":
        return "functions.calculator:0"
    return f"call_{turn}_0"


def tool_reply(call_id: str, content: str = "84") -> ChatMessage:
    return ChatMessage(
        role="tool", content=content, extra={"tool_call_id": call_id, "name": "calculator"}
    )


def canonical_text(
    family: str, conversation: Sequence[ChatMessage], message: ChatMessage, tools: Any
) -> tuple[str, str]:
    """The text the template writes for ``message`` after ``conversation`` (cut out of
    its render), and the stop token that ends it."""
    r = renderer(family)
    s = spec(family)
    calls = message.extra.get("tool_calls") or []
    reasoning = message.extra.get("reasoning_content")
    stops = tokens(family, r.stop_token_ids)
    if calls and s.call_text is not None:
        content = "".join(_think(family, reasoning))
        return content + s.call_text(
            json.loads(calls[0]["function"]["arguments"])["expression"], calls[0]["id"]
        ), tokens(family, r.close_ids)[0]
    prompt = template(family, conversation, tools)
    shown = message
    opened = ""
    if r._reasoning_opened:  # the generation prompt opened the block (QwQ, R1 distills)
        opened = "<think>\n"
        assert prompt.endswith(opened)
        prompt = prompt[: -len(opened)]
        shown = attrs.evolve(
            message, extra={k: v for k, v in message.extra.items() if k != "reasoning_content"}
        )
    follow = [tool_reply(call["id"]) for call in calls]
    full = template(family, [*conversation, shown, *follow], tools, generation_prompt=False)
    assert full.startswith(prompt), (family, prompt[-80:], full[-300:])
    rest = full[len(prompt) :]
    found = [(rest.find(stop), stop) for stop in stops if stop in rest]
    if found:
        at, stop = min(found)
        text = rest[:at]
    else:
        assert s.text_stop is not None, (family, rest)
        text, stop = rest, s.text_stop
    if opened:
        text = f"{reasoning}\n</think>\n\n{text}"
    return text, stop


def _think(family: str, reasoning: str | None) -> list[str]:
    if not reasoning:
        return []
    return [f"<think>\n{reasoning}\n</think>\n\n"]


def written_turn(
    family: str, conversation: Sequence[ChatMessage], plan: Plan, turn: int, tools: Any
) -> tuple[str, str, bool]:
    """What the model writes: the text, its stop token, and whether it is the text the
    template writes."""
    message = assistant_message(family, plan, written_id(family, plan, turn))
    # The message as the template writes it right after a user message: at generation
    # time a turn is always the last message, and templates that rewrite history (gpt-oss
    # drops analysis before a final answer, Hermes-3 writes a last tool message without
    # its newline) rewrite the conversation, not how the message itself is written.
    text, stop = canonical_text(family, conversation[:1], message, tools)
    written = text
    if plan.how == "spaced":
        written = text + "  \n"
    elif plan.how == "no_id":  # Mistral v11 without [CALL_ID]: the parser makes one up
        written = re.sub(r"\[CALL_ID\][A-Za-z0-9]{9}", "", text)
    elif plan.how == "compact":
        written = text.replace('", "', '","').replace('": ', '":').replace(", ", ",")
    canonical = written == text
    if plan.how == "spaced" and not plan.call:
        # A plain answer's content is kept as sampled: the spaces are canonical where
        # the template writes the content as it is.
        spaced = attrs.evolve(message, content=message.content + "  \n")
        canonical = canonical_text(family, conversation[:1], spaced, tools)[0] == written
    return written, stop, canonical


@attrs.define(kw_only=True, eq=False)
class Request:
    prompt_ids: list[int]
    sampled: list[int]
    cut: bool
    canonical: bool


@attrs.define(kw_only=True, eq=False)
class Model(InferenceInterface, ReturnsRaw, ReturnsLogProbs, AcceptsTokens):
    """A token-in model that writes the planned turns of one episode."""

    family: str
    plans: list[Plan]
    requests: list[Request] = attrs.field(factory=list)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.sleep(0.25)
        assert request.prompt_ids is not None
        turn = len(self.requests)
        plan = self.plans[turn]
        r = renderer(self.family)
        text, stop, canonical = written_turn(
            self.family, request.prompt, plan, turn + 1, request.tools
        )
        sampled = r.encode(text)
        cut = plan.how == "cut"
        if not cut:
            sampled += r.encode(stop)
        self.requests.append(
            Request(
                prompt_ids=list(request.prompt_ids), sampled=sampled, cut=cut, canonical=canonical
            )
        )
        logprobs = [-(i % 7 + 1) / 8 for i in range(len(sampled))]
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=text),
            raw_text=r.decode([*request.prompt_ids, *sampled]),
            token_ids=[*request.prompt_ids, *sampled],
            prompt_length=len(request.prompt_ids),
            logprobs=logprobs,
            finish_reason="length" if cut else "stop",
        )


class Env(BaseEnvironment):
    """Asks one question; answers a call with a tool message, any other turn with a user
    message; done after ``turns`` turns. Keeps the structured conversation."""

    def __init__(self, family: str, turns: int) -> None:
        super().__init__()
        self.tools = TOOLS if spec(family).tools else None
        self.turns = turns
        self.conversation: list[ChatMessage] = []
        self.parsed: list[AssistantTurn] = []
        #: The conversation as each request saw it (len of conversation per turn).
        self.seen: list[int] = []

    async def reset(self) -> Sequence[ChatMessage]:
        await trio.lowlevel.checkpoint()
        self.conversation = [ChatMessage(role="user", content=QUESTION)]
        return list(self.conversation)

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        await trio.sleep(0.5)
        self.seen.append(len(self.conversation))
        self.parsed.append(turn)
        self.conversation.append(turn.to_message())
        if len(self.parsed) >= self.turns:
            return EnvironmentStep(done=True, reward=1.0)
        if turn.tool_calls:
            replies = [tool_reply(call.id) for call in turn.tool_calls]
        else:
            # Distinct, or Mistral-Nemo's `message == user_messages[-1]` sees two.
            replies = [ChatMessage(role="user", content=f"Thanks. And 2 + {len(self.parsed)}?")]
        self.conversation.extend(replies)
        return EnvironmentStep(messages=replies)


def run_episode(family: str, plans: list[Plan]) -> tuple[TokenRollout, Model, Env]:
    model = Model(family=family, plans=plans)
    envs: list[Env] = []

    def make(problem: Problem) -> Env:
        envs.append(Env(family, len(plans)))
        return envs[-1]

    agent = MultiTurnAgent(
        environment=make,
        renderer=renderer(family),
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

    group = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    (rollout,) = group
    assert isinstance(rollout, TokenRollout), rollout
    return rollout, model, envs[0]


def check_episode(family: str, rollout: TokenRollout, model: Model, env: Env) -> list[bool]:
    """The properties of one episode; returns, per turn after the first, whether a
    break started a new element before it."""
    r = renderer(family)
    tools = env.tools
    breaks: list[bool] = []
    previous: Request | None = None
    elements: list[list[Request]] = [[]]
    for index, request in enumerate(model.requests):
        so_far = env.conversation[: env.seen[index]] if index < len(env.seen) else env.conversation
        # The prompt is the template's render of the structured conversation, encoded.
        assert request.prompt_ids == reference_ids(family, so_far, tools), (family, index)
        if previous is not None:
            held = previous.prompt_ids + previous.sampled + (r.close_ids if previous.cut else [])
            extends = request.prompt_ids[: len(held)] == held and len(request.prompt_ids) > len(
                held
            )
            breaks.append(not extends)
            if extends:
                elements[-1].append(request)
            else:
                assert request.prompt_ids == r.render(so_far, tools=tools)
                elements.append([request])
        else:
            assert request.prompt_ids == r.render(so_far, tools=tools)
            elements[-1].append(request)
        previous = request
    episode = rollout.extra["episode"]
    assert episode["breaks"] == sum(breaks) == len(rollout.trajectory) - 1
    assert episode["turns"] == len(model.requests)
    assert rollout.logprobs is not None
    assert rollout.generation_mask is not None
    for ids, mask, logprobs, requests in zip(
        rollout.trajectory, rollout.generation_mask, rollout.logprobs, elements, strict=True
    ):
        last = requests[-1]
        assert ids == last.prompt_ids + last.sampled
        expected_mask = [False] * len(ids)
        expected_logprobs: list[float] = []
        for request in requests:
            start = len(request.prompt_ids)
            expected_mask[start : start + len(request.sampled)] = [True] * len(request.sampled)
            expected_logprobs += [-(i % 7 + 1) / 8 for i in range(len(request.sampled))]
        assert mask == expected_mask
        assert logprobs == expected_logprobs
        assert sum(mask) == len(logprobs)
    # A turn not written as the template writes it is a break, never a drift.
    for index, request in enumerate(model.requests[:-1]):
        if not request.canonical:
            assert breaks[index], (family, index)
    return breaks


# --------------------------------------------------------------------------- a. ends


#: DeepSeek's EOS (written with fullwidth bars and a block space).
DS_EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
#: family: (close tokens, stop tokens) as observed.
ENDS: dict[str, tuple[list[str], list[str]]] = {
    "qwen2.5": (["<|im_end|>"], ["<|im_end|>", "<|endoftext|>"]),
    "qwen3": (["<|im_end|>"], ["<|im_end|>", "<|endoftext|>"]),
    "qwq": (["<|im_end|>"], ["<|im_end|>", "<|endoftext|>"]),
    "qwen3-coder": (["<|im_end|>"], ["<|im_end|>", "<|endoftext|>"]),
    "smollm3": (["<|im_end|>"], ["<|im_end|>"]),
    "hermes3-tool-use": (["<|im_end|>"], ["<|im_end|>", "<|end_of_text|>"]),
    # The distills and V3.1 write EOS after every assistant turn: it is the close.
    "deepseek-r1-distill": ([DS_EOS], [DS_EOS]),
    "deepseek-v3.1": ([DS_EOS], [DS_EOS]),
    "llama3.1": (["<|eot_id|>"], ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]),
    "llama3.2": (["<|eot_id|>"], ["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"]),
    "mistral-nemo": (["</s>"], ["</s>"]),
    "mistral-small-3.2": (["</s>"], ["</s>"]),
    "gemma2": (["<end_of_turn>"], ["<end_of_turn>", "<eos>"]),
    "gemma3": (["<end_of_turn>"], ["<end_of_turn>", "<eos>"]),
    # <|return|> after the last message, <|end|> when another follows: no common close.
    "gpt-oss": ([], ["<|return|>", "<|call|>"]),
    # No family detected: only close + eos. The manifest's <|assistant|> stop (Phi-3.5's
    # generation config) comes through from_pretrained's eos_token_ids, not here.
    "phi3.5": (["<|end|>"], ["<|end|>", "<|endoftext|>"]),
    "phi4": (["<|im_end|>"], ["<|im_end|>"]),
    # <|endoftext|> is written after the LAST message only: a stop, never the close.
    "phi4-mini": (["<|end|>"], ["<|end|>", "<|endoftext|>"]),
    # GLM closes a turn with the next message's opening.
    "glm4.5": ([], ["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "glm4.6": ([], ["<|endoftext|>", "<|user|>", "<|observation|>"]),
    "kimi-k2": (["<|im_end|>"], ["<|im_end|>", "[EOS]"]),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_close_and_stop_ids(family: str) -> None:
    r = renderer(family)
    close, stops = tokens(family, r.close_ids), tokens(family, r.stop_token_ids)
    assert (close, stops) == ENDS[family]
    entry = _families.manifest()[family]
    # The close is what ends every assistant turn: never an EOS written after the last
    # message only, and always among the stops.
    last_only = template(
        family,
        [ChatMessage(role="user", content="Hi."), ChatMessage(role="assistant", content="Yo.")],
        TOOLS if family == "hermes3-tool-use" else None,
        generation_prompt=False,
    )
    for token in close:
        assert token in stops
        assert last_only.count(token) >= 1
    assert set(close) <= set(stops)
    # Every stop of the family that the template writes itself is a stop (the manifest's
    # stop tokens come from generation configs: the ones missing here are listed).
    missing = sorted(set(entry["stop_tokens"]) - set(stops))
    assert missing == MISSING_STOPS.get(family, [])


#: The manifest's stops that the renderer does not have unless given (they come from the
#: model's generation_config.json, which from_pretrained reads as eos_token_ids).
MISSING_STOPS = {
    "phi3.5": ["<|assistant|>"],  # no family detected
}


# --------------------------------------------------------------------------- b. episodes

WORDS = ["Sure", "the", "answer", "is", "84", "Let", "me", "check", "first", "ok"]


@st.composite
def plans(draw: Any, family: str) -> list[Plan]:
    s = spec(family)
    count = draw(st.integers(1, 4))
    result = []
    for _ in range(count):
        call = s.tools and draw(st.booleans())
        hows = ["canonical", "canonical", "spaced", "compact", "cut"]
        how = draw(st.sampled_from([*hows, "no_id"] if s.writes_ids else hows))
        result.append(
            Plan(
                how=how,
                call=call,
                content=" ".join(draw(st.lists(st.sampled_from(WORDS), max_size=4))),
                reasoning=" ".join(draw(st.lists(st.sampled_from(WORDS), max_size=3)))
                if s.reasoning
                else "",
                expression=draw(st.sampled_from(["12*(3+4)", "2 + 2", "7-1", "3 / 4"])),
                written_id="".join(
                    draw(
                        st.lists(
                            st.sampled_from(string.ascii_letters + string.digits),
                            min_size=9,
                            max_size=9,
                        )
                    )
                ),
            )
        )
    return result


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_episodes_are_token_exact(family: str, data: Any) -> None:
    drawn = data.draw(plans(family))
    if spec(family).reasoning and renderer(family)._reasoning_opened:
        # The prompt opened <think>: the model always writes a block.
        drawn = [attrs.evolve(p, reasoning=p.reasoning or "Hmm") for p in drawn]
    rollout, model, env = run_episode(family, drawn)
    check_episode(family, rollout, model, env)


# --------------------------------------------------------------------------- c. summary


def summary_row(family: str) -> dict[str, Any]:
    s = spec(family)
    r = renderer(family)
    reasoning = "Add them." if s.reasoning else ""
    row: dict[str, Any] = {
        "family": family,
        "close": tokens(family, r.close_ids),
        "stops": tokens(family, r.stop_token_ids),
    }
    if s.tools:
        plans = [
            Plan(call=True, reasoning=reasoning, content="Let me check"),
            Plan(call=True, reasoning=reasoning, expression="2 + 2", written_id="Z9y8X7w6V"),
            Plan(content="It is 84", reasoning=reasoning),
        ]
        rollout, model, env = run_episode(family, plans)
        check_episode(family, rollout, model, env)
        row["tool_breaks"] = rollout.extra["episode"]["breaks"]
        first = env.parsed[0].tool_calls
        row["calls_parsed"] = bool(first) and (first[0].name, first[0].arguments) == (
            "calculator",
            {"expression": "12*(3+4)"},
        )
    else:
        row["tool_breaks"] = None
        row["calls_parsed"] = None
    plans = [Plan(content=f"Answer {i}", reasoning=reasoning) for i in range(3)]
    rollout, model, env = run_episode(family, plans)
    check_episode(family, rollout, model, env)
    row["user_breaks"] = rollout.extra["episode"]["breaks"]
    row["reasoning_split"] = env.parsed[0].reasoning == reasoning if s.reasoning else None
    return row


#: family: (breaks in a canonical 3-turn tool episode [call, call, answer], breaks in a
#: 3-turn episode answered by user messages, the canonical call read back with its name
#: and arguments, the reasoning read back); None: not applicable (no tool role in the
#: template, or no reasoning format).
SUMMARY: dict[str, tuple[int | None, int, bool | None, bool | None]] = {
    "qwen2.5": (0, 0, True, None),
    # Keeps reasoning after the last user message: append-only through a tool chain, a
    # break at each new user message (the earlier turn loses its <think> block).
    "qwen3": (0, 2, True, True),
    # The prompt opens <think>\n and history drops reasoning: every bridge breaks.
    "qwq": (2, 2, True, True),
    "deepseek-r1-distill": (2, 2, True, True),  # drops reasoning, as QwQ
    "deepseek-v3.1": (0, 0, True, None),  # thinking off (prompt ends with </think>)
    "qwen3-coder": (0, 0, True, None),
    "llama3.1": (0, 0, True, None),
    "llama3.2": (0, 0, True, None),
    # The template writes the last tool message without the newline it writes before
    # <|im_end|> once an assistant message follows: the second bridge breaks.
    "hermes3-tool-use": (1, 0, True, None),
    # [AVAILABLE_TOOLS] is written before the last user message: each new user message
    # moves it. Tool episodes are append-only (the model writes its 9-char ids).
    "mistral-nemo": (0, 2, True, None),
    "mistral-small-3.2": (0, 2, True, None),
    "gemma2": (None, 0, None, None),
    "gemma3": (None, 0, None, None),
    # Tool chains are append-only; answers: <|return|> becomes <|end|> in history and
    # the analysis is dropped, so a user message after an answer is a break.
    "gpt-oss": (0, 2, True, True),
    "phi3.5": (None, 0, None, None),
    "phi4": (None, 0, None, None),
    # These templates write no assistant tool calls at all (Kimi-K2's early template,
    # Phi-4-mini's, SmolLM3's): every tool turn is rewritten, a break.
    "phi4-mini": (2, 0, True, None),
    "kimi-k2": (2, 0, True, None),
    "smollm3": (2, 0, True, None),
    # Reasoning kept after the last user message (as Qwen3); <think></think> before it.
    "glm4.5": (0, 2, True, True),
    "glm4.6": (0, 2, True, True),
}


def test_per_family_summary() -> None:
    rows = [summary_row(family) for family in FAMILIES]
    header = (
        f"{'family':20} {'close':24} {'tool-ep breaks':>14} {'user-ep breaks':>14} "
        f"{'calls':>6} {'reasoning':>9}  stops"
    )
    lines = ["", header]
    for row in rows:
        lines.append(
            f"{row['family']:20} {' '.join(row['close']) or '-':24} {row['tool_breaks']!s:>14} "
            f"{row['user_breaks']!s:>14} {row['calls_parsed']!s:>6} "
            f"{row['reasoning_split']!s:>9}  {' '.join(row['stops'])}"
        )
    print("\n".join(lines))
    observed = {
        row["family"]: (
            row["tool_breaks"],
            row["user_breaks"],
            row["calls_parsed"],
            row["reasoning_split"],
        )
        for row in rows
    }
    assert observed == {family: SUMMARY[family] for family in FAMILIES}


def test_a_gpt_oss_tool_episode_is_append_only() -> None:
    plans = [Plan(call=True, reasoning="Use it."), Plan(call=True, expression="2 + 2"), Plan()]
    rollout, model, env = run_episode("gpt-oss", plans)
    check_episode("gpt-oss", rollout, model, env)
    assert env.parsed[0].tool_calls[0].name == "calculator"
    assert rollout.extra["episode"]["breaks"] == 0


@pytest.mark.parametrize("family", ["deepseek-r1-distill", "deepseek-v3.1"])
def test_deepseek_templates_are_given_the_arguments_as_written(family: str) -> None:
    # The templates concatenate tool_call.function.arguments: HFRenderer hands them the
    # JSON string (an object, as other templates get, is a TypeError in the template).
    r = renderer(family)
    conversation = [ChatMessage(role="user", content=QUESTION)]
    call = {
        "id": "call_1_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'},
    }
    message = ChatMessage(role="assistant", content="", extra={"tool_calls": [call]})
    text = r.decode(r.render([*conversation, message], tools=TOOLS))
    assert '{"expression": "1+2"}' in text


def test_made_up_mistral_ids_are_unique_within_an_episode() -> None:
    plans = [Plan(call=True, how="no_id"), Plan(call=True, how="no_id"), Plan()]
    rollout, model, env = run_episode("mistral-small-3.2", plans)
    check_episode("mistral-small-3.2", rollout, model, env)
    first, second = env.parsed[0].tool_calls[0], env.parsed[1].tool_calls[0]
    assert first.arguments == second.arguments
    assert first.id != second.id
