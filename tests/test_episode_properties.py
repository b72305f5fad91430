"""Properties of MultiTurnAgent episodes over random scenarios, on Trio's MockClock.

Each example draws a scenario: per-environment scripts (what the policy writes each turn:
plain text, tool calls, broken tool calls, long text that ``max_tokens`` cuts; what the
environment answers: tool messages, a message the renderer cannot bridge, a new tool set,
``done``, a step that sleeps past ``step_timeout`` or raises), the agent's limits
(``max_turns``, ``max_episode_tokens``, the request's ``max_tokens``, ``close_ids``,
``on_break``, ``step_timeout``, ``environment_concurrency``), a ``FailurePolicy`` or none,
and a consumer (takes, weight updates of every mode landing between and inside turns on an
``EmbeddedInference`` with per-token latency, then a way out: break, an exception, or an
outer cancel scope). Every example runs in its own ``trio.run`` with virtual time;
observations are recorded as the run goes and judged afterwards against DESIGN.md,
"Multi-turn episodes, token-exact":

- every delivered episode is what the contract predicts from its script (a reference
  model, :func:`expected_episode`): its elements' ids and masks, finish, reward and
  ``extra["episode"]`` counters; a turn bridges only when its text is the plain layout's
  re-render of its own parse (:func:`assistant_text`), any other turn is a counted break;
- the extension property: every request's ``prompt_ids`` (recorded by the backend) is the
  prefix of its element up to the ids sampled for it, which are exactly those sampled;
  ``max_tokens`` of each request is what the budget leaves;
- masks and logprobs line up; ``policy_epoch`` boundaries are well-formed, follow the
  backend's stamps, and name only the initial epoch and committed updates' epochs;
- nothing runs after exit (no reset, step, aclose or model call); every environment made
  is closed exactly once; ``environment_concurrency`` holds; a ``drain`` update's body
  sees no episode running;
- the ledger is at 0 after exit, and the ``PromptSource`` hands out every problem exactly
  once across delivered groups (nothing lost or duplicated).
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import math
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import trio_rollouts as tr
from trio_rollouts import ChatMessage, PlainRenderer, PromptSource
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
    WeightUpdateMode,
)

pytestmark = pytest.mark.filterwarnings("ignore:the first 32 groups:RuntimeWarning")

HANG_AFTER = 10_000.0
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PLAIN = PlainRenderer()
TOOLSETS: tuple[list[dict[str, Any]] | None, ...] = (
    None,
    [{"type": "function", "function": {"name": "calc"}}],
    [{"type": "function", "function": {"name": "search"}}],
)
#: What the policy may write in a turn (never empty, so each turn is one run of mask 1).
COMPLETIONS = (
    "Hello there.",
    '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>',
    'a <tool_call>{"name": "calc"}</tool_call> b <tool_call>{"name": "f", "arguments": {}}'
    "</tool_call>",
    '<tool_call>{"name": calc}</tool_call>',
    'ok <tool_call>{"name": "calc", "arg',
    "<think>hmm</think>The answer is 4.",
    "x" * 30,
)
N_PROBLEMS = 60


#: The completions written as the plain layout re-renders their parse, so they bridge
#: (a turn with a call that could not be read is written back as it was sampled); the
#: others (content around calls, a call without "arguments") are breaks. Drawn more
#: often, so that the extension property is exercised across bridges, not only breaks.
CANONICAL = (0, 1, 3, 4, 5, 6)


class Boom(Exception):
    """A step that raises."""


class ConsumerError(Exception):
    """The consumer leaves by raising."""


# --------------------------------------------------------------------------- scenarios


@attrs.frozen(kw_only=True)
class Turn:
    completion: int
    replies: int
    #: The environment adds a message the renderer cannot bridge.
    brk: bool
    #: The tool set after this step (index into TOOLSETS); None: unchanged.
    tools_after: int | None
    done: bool
    reward: float
    sleep: float
    raises: bool


@attrs.frozen(kw_only=True)
class Script:
    tools0: int
    turns: tuple[Turn, ...]
    final: float

    def turn(self, t: int) -> Turn:
        return self.turns[min(t, len(self.turns) - 1)]


@attrs.frozen(kw_only=True)
class Take:
    pass


@attrs.frozen(kw_only=True)
class Update:
    mode: WeightUpdateMode
    delay: float
    body: float


@attrs.frozen(kw_only=True)
class Scenario:
    scripts: tuple[Script, ...]
    num_groups: int
    outstanding: int
    rollouts_per_group: int
    buffer_size: int
    max_turns: int
    max_episode_tokens: int | None
    gen_max_tokens: int | None
    close: str
    on_break: Literal["split", "raise"]
    step_timeout: float | None
    environment_concurrency: int | None
    first_token: float
    per_token: float
    policy: tuple[int, Literal["raise", "skip"], int] | None
    actions: tuple[Take | Update, ...]
    finish: Literal["break", "raise"]
    cancel_after: float | None

    def can_fail(self) -> bool:
        if self.max_episode_tokens is not None and self.max_episode_tokens <= first_render_max():
            return True  # a budget at or below a first render is a ValueError
        for script in self.scripts:
            for turn in script.turns:
                if turn.raises:
                    return True
                if self.step_timeout is not None and turn.sleep > self.step_timeout:
                    return True
                changes = turn.tools_after is not None and turn.tools_after != script.tools0
                if self.on_break == "raise" and (turn.brk or changes or turn.tools_after):
                    return True
                if self.on_break == "raise" and self.may_rewrite(turn):
                    return True
        return False

    def may_rewrite(self, turn: Turn) -> bool:
        """Whether the turn's text, or a cut of it, may fail to bridge: it is not the
        canonical re-render of its parse (or a cut turn gets ``close`` appended)."""
        completion = COMPLETIONS[turn.completion]
        cuts = self.gen_max_tokens is not None or self.max_episode_tokens is not None
        texts = [completion[:k] for k in range(1, len(completion))] if cuts else []
        return not bridges(completion, "", []) or any(
            not bridges(text, self.close, []) for text in texts
        )


@st.composite
def turns(draw: st.DrawFn, failures: bool) -> Turn:
    return Turn(
        completion=draw(
            st.one_of(st.integers(0, len(COMPLETIONS) - 1), st.sampled_from(CANONICAL))
        ),
        replies=draw(st.integers(0, 2)),
        brk=draw(st.sampled_from([False, False, False, True])),
        tools_after=draw(st.sampled_from([None, None, None, None, 0, 1, 2])),
        done=draw(st.sampled_from([False, False, False, True])),
        reward=draw(st.sampled_from([0.0, 0.5, 1.0])),
        sleep=draw(st.sampled_from([0.0, 0.25, 0.25, 2.5] if failures else [0.0, 0.25])),
        raises=draw(st.sampled_from([False] * 12 + [True])) if failures else False,
    )


@st.composite
def scenarios(
    draw: st.DrawFn, *, failures: bool = True, cancel: bool = True, updates: bool = False
) -> Scenario:
    """Random scenarios; ``updates``: keep/abort updates soon and often, so that they land
    inside turns (the backend generates a token every 0.05-0.2 s)."""
    scripts = tuple(
        Script(
            tools0=draw(st.sampled_from([0, 0, 1])),
            turns=tuple(draw(st.lists(turns(failures), min_size=1, max_size=5))),
            final=draw(st.sampled_from([0.0, 0.25, 1.0])),
        )
        for _ in range(draw(st.integers(1, 4)))
    )
    actions = draw(
        st.lists(
            st.one_of(
                st.just(Take()),
                st.builds(
                    Update,
                    mode=st.sampled_from(["keep", "abort", "keep", "abort", "drain", "restart"]),
                    delay=st.sampled_from([0.0, 0.3, 1.0, 2.5, 6.0]),
                    body=st.sampled_from([0.0, 0.5, 2.0]),
                ),
            ),
            min_size=1,
            max_size=6,
        )
    )
    if updates:
        update = st.builds(
            Update,
            mode=st.sampled_from(["keep", "abort"]),
            delay=st.sampled_from([0.1, 0.3, 0.7, 1.5]),
            body=st.sampled_from([0.0, 0.5]),
        )
        actions = [
            *draw(st.lists(update, min_size=1, max_size=4)),
            Take(),
            *draw(st.lists(st.one_of(st.just(Take()), update), max_size=4)),
        ]
    policy = None
    if failures and draw(st.booleans()):
        policy = (
            draw(st.integers(1, 3)),
            draw(st.sampled_from(["raise", "skip"])),
            draw(st.integers(0, 3)),
        )
    return Scenario(
        scripts=scripts,
        num_groups=draw(st.integers(1, 2)),
        outstanding=draw(st.integers(1, 2)),
        rollouts_per_group=draw(st.integers(1, 3)),
        buffer_size=draw(st.integers(0, 2)),
        max_turns=draw(st.integers(1, 5)),
        max_episode_tokens=draw(
            st.one_of(st.none(), st.integers(30 if failures else first_render_max() + 1, 320))
        ),
        gen_max_tokens=draw(st.one_of(st.none(), st.integers(1, 40))),
        close=draw(st.sampled_from(["", "<|end|>"])),
        on_break=draw(st.sampled_from(["split", "split", "raise"])) if failures else "split",
        step_timeout=draw(st.sampled_from([None, 1.0])),
        environment_concurrency=draw(st.sampled_from([None, 1, 2])),
        first_token=draw(st.sampled_from([0.0, 0.2, 0.5])),
        per_token=draw(st.sampled_from([0.05, 0.1, 0.2] if updates else [0.0, 0.05, 0.1])),
        policy=policy,
        actions=tuple(actions),
        finish=draw(st.sampled_from(["break", "raise"])),
        cancel_after=draw(st.sampled_from([None, None, None, 0.0, 0.7, 3.0, 9.0, 20.0]))
        if cancel
        else None,
    )


# --------------------------------------------------------------------------- the world


def step_messages(t: int, spec: Turn) -> list[ChatMessage]:
    messages = [ChatMessage(role="tool", content=f"result {t}.{i}") for i in range(spec.replies)]
    if spec.brk:
        messages.append(ChatMessage(role="user", content="BREAK"))
    return messages


def reset_messages(n: int, problem: tr.Problem) -> list[ChatMessage]:
    assert isinstance(problem.prompt, str)
    return [
        ChatMessage(role="system", content=f"ep{n}"),
        ChatMessage(role="user", content=problem.prompt),
    ]


@functools.cache
def first_render_max() -> int:
    """The longest first render a scenario can have (up to 10**4 environments made): a
    max_episode_tokens at or below it may be a ValueError."""
    return max(
        len(plain_text(reset_messages(9999, problem), tools))
        for problem in problems()
        for tools in TOOLSETS
    )


@attrs.define(eq=False)
class World:
    """What one run observed."""

    sc: Scenario
    made: list[int] = attrs.Factory(list)
    closed: Counter[int] = attrs.Factory(Counter)
    #: reset/step calls in progress, and the most there ever were.
    live_ops: int = 0
    max_live_ops: int = 0
    live_aclose: int = 0
    steps: Counter[int] = attrs.Factory(Counter)
    resets: Counter[int] = attrs.Factory(Counter)
    finals: Counter[int] = attrs.Factory(Counter)
    #: Episodes whose environment exists and is not yet closed.
    live_episodes: int = 0
    violations: list[str] = attrs.Factory(list)

    def script(self, n: int) -> Script:
        return self.sc.scripts[n % len(self.sc.scripts)]


class ScriptedEnv(tr.BaseEnvironment):
    def __init__(self, world: World, problem: tr.Problem) -> None:
        super().__init__()
        self.world = world
        self.problem = problem
        self.n = len(world.made)
        world.made.append(self.n)
        world.live_episodes += 1
        self.script = world.script(self.n)
        self.t = 0
        self._tools = TOOLSETS[self.script.tools0]

    @property  # type: ignore[override]
    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools

    async def _op(self, seconds: float) -> None:
        world = self.world
        world.live_ops += 1
        world.max_live_ops = max(world.max_live_ops, world.live_ops)
        try:
            await trio.sleep(seconds)
        finally:
            world.live_ops -= 1

    async def reset(self) -> Sequence[ChatMessage]:
        self.world.resets[self.n] += 1
        await self._op(0.1)
        return reset_messages(self.n, self.problem)

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        self.world.steps[self.n] += 1
        spec = self.script.turn(self.t)
        t = self.t
        self.t += 1
        await self._op(spec.sleep)
        if spec.raises:
            msg = f"step {t} of env {self.n}"
            raise Boom(msg)
        if spec.tools_after is not None:
            self._tools = TOOLSETS[spec.tools_after]
        return tr.EnvironmentStep(
            messages=step_messages(t, spec),
            done=spec.done,
            reward=spec.reward if spec.done else None,
        )

    async def final_reward(self) -> float:
        self.world.finals[self.n] += 1
        await trio.sleep(0.05)
        return self.script.final

    async def aclose(self) -> None:
        world = self.world
        world.live_aclose += 1
        try:
            await trio.sleep(0.2)
        finally:
            world.live_aclose -= 1
            world.closed[self.n] += 1
            world.live_episodes -= 1


@attrs.frozen
class BreakingRenderer(tr.PlainRenderer):
    """PlainRenderer with optional ``close_ids``, whose bridge cannot be proved when the
    new messages hold ``BREAK``."""

    close: str = ""

    @property
    def close_ids(self) -> list[int]:
        return self.encode(self.close)

    def bridge(
        self,
        previous_ids: Sequence[int],
        new_messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None = None,
        messages: Sequence[ChatMessage] | None = None,
    ) -> list[int] | None:
        if any("BREAK" in m.content for m in new_messages):
            return None
        # messages=: the agent proves the bridge on the conversation at hand.
        return super().bridge(previous_ids, new_messages, tools=tools, messages=messages)


@attrs.frozen
class Generation:
    prompt_ids: list[int]
    sampled: list[int]
    logprobs: list[float] | None
    policy_epoch: list[tuple[int, int]]
    max_tokens: int | None


_TAG = re.compile(r"^ep(\d+)$")


@attrs.define(kw_only=True, eq=False)
class RecordingInference(EmbeddedInference):
    """EmbeddedInference that records every completed request, by episode."""

    log: dict[int, list[Generation]] = attrs.field(factory=dict, init=False)
    in_flight: int = attrs.field(default=0, init=False)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.in_flight += 1
        try:
            response = await super().base_generate(request)
        finally:
            self.in_flight -= 1
        found = _TAG.match(request.prompt[0].content)
        assert found is not None
        assert request.prompt_ids is not None
        assert response.token_ids is not None
        assert response.prompt_length is not None
        self.log.setdefault(int(found.group(1)), []).append(
            Generation(
                prompt_ids=list(request.prompt_ids),
                sampled=response.token_ids[response.prompt_length :],
                logprobs=response.logprobs,
                policy_epoch=list(response.policy_epoch),
                max_tokens=request.generation_args.max_tokens,
            )
        )
        return response


def make_policy(world: World) -> Any:
    def policy(messages: list[ChatMessage]) -> tuple[Sequence[str], list[float]]:
        found = _TAG.match(messages[0].content)
        assert found is not None
        t = sum(m.role == "assistant" for m in messages)
        return [COMPLETIONS[world.script(int(found.group(1))).turn(t).completion]], [1.0]

    return policy


# --------------------------------------------------------------------------- the reference model


def message_text(message: ChatMessage) -> str:
    """A message in the plain layout, written here from the layout PlainRenderer documents
    (not from its code): ``"<|role|>\\ncontent\\n"``; an assistant message with
    ``tool_calls`` or ``reasoning_content`` is ``"<|assistant|>\\n"``,
    ``<think>reasoning</think>``, the content, each call as
    ``<tool_call>`` + ``json.dumps({"name", "arguments"})`` + ``</tool_call>`` (arguments
    that are not JSON written as they are), then ``"\\n"``."""
    extra = message.extra
    if message.role != "assistant" or not ("tool_calls" in extra or "reasoning_content" in extra):
        return f"<|{message.role}|>\n{message.content}\n"
    text = "<|assistant|>\n"
    if "reasoning_content" in extra:
        text += f"<think>{extra['reasoning_content']}</think>"
    text += message.content
    for call in extra.get("tool_calls", []):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        try:
            decoded = json.loads(arguments)
        except ValueError:
            text += f"<tool_call>{arguments}</tool_call>"
            continue
        body = json.dumps({"name": name, "arguments": decoded}, ensure_ascii=False)
        text += f"<tool_call>{body}</tool_call>"
    return text + "\n"


def plain_text(messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None) -> str:
    """A conversation in the plain layout, with the generation prompt."""
    head = f"<|tools|>\n{json.dumps(tools)}\n" if tools else ""
    return head + "".join(map(message_text, messages)) + "<|assistant|>\n"


def turn_message(text: str) -> ChatMessage:
    """A turn the model wrote as ``text``, as the agent keeps it in the conversation: its
    parse as a structured message, or, when a call could not be read, the text itself
    (a broken call is shown back as written, never as a call the model did not write)."""
    parsed = PLAIN.parse(PLAIN.encode(text))
    if any(call.arguments is None for call in parsed.tool_calls):
        return ChatMessage(role="assistant", content=text)
    return parsed.to_message()


def assistant_text(text: str) -> str:
    """The canonical re-render of a turn the model wrote as ``text``: the message the
    agent appends (:func:`turn_message`), in the plain layout."""
    return message_text(turn_message(text))


def bridges(text: str, close: str, messages: Sequence[ChatMessage]) -> str | None:
    """What follows a turn written as ``text`` (then ``close``) and the environment's
    ``messages``, proved on the conversation: the re-render of the turn, the messages and
    the generation prompt must start with what the episode holds; ``None`` otherwise."""
    held = f"<|assistant|>\n{text}{close}"
    after = assistant_text(text) + "".join(map(message_text, messages)) + "<|assistant|>\n"
    return after[len(held) :] if after.startswith(held) else None


@attrs.frozen
class Expected:
    failure: str | None = None
    elements: list[list[int]] = attrs.Factory(list)
    masks: list[list[bool]] = attrs.Factory(list)
    finish: str = ""
    reward: float = 0.0
    episode: dict[str, Any] = attrs.Factory(dict)
    #: Turns followed by a bridge decision whose text is (is not) its canonical re-render.
    canonical: int = 0
    rewritten: int = 0


def expected_episode(sc: Scenario, script: Script, reset: list[ChatMessage]) -> Expected:
    """The episode the contract predicts, written from DESIGN.md, not from the code."""
    budget = sc.max_episode_tokens
    tools = TOOLSETS[script.tools0]
    env_tools = tools
    conversation = list(reset)
    first = PLAIN.encode(plain_text(reset, tools))
    if budget is not None and len(first) >= budget:
        return Expected(failure="ValueError")  # no room for a turn: refused, loudly
    elements, masks = [first], [[False] * len(first)]
    turns = breaks = tool_calls = parse_errors = truncated = 0
    canonical = rewritten = 0
    reward: float | None = None
    while True:
        ids, mask = elements[-1], masks[-1]
        if budget is not None and budget - len(ids) < 1:
            finish = "max_tokens"
            break
        limit = sc.gen_max_tokens
        if budget is not None:
            left = budget - len(ids)
            limit = left if limit is None else min(limit, left)
        spec = script.turn(turns)
        completion = COMPLETIONS[spec.completion]
        text = completion if limit is None else completion[:limit]
        cut = len(text) < len(completion)
        sampled = PLAIN.encode(text)
        ids += sampled
        mask += [True] * len(sampled)
        turns += 1
        parsed = PLAIN.parse(sampled)
        tool_calls += len(parsed.tool_calls)
        parse_errors += parsed.parse_error is not None
        if spec.raises:
            return Expected(failure="Boom")
        if sc.step_timeout is not None and spec.sleep > sc.step_timeout:
            return Expected(failure="StepTimeoutError")
        if spec.tools_after is not None:
            env_tools = TOOLSETS[spec.tools_after]
        if spec.done:
            finish, reward = "done", spec.reward
            break
        if budget is not None and len(ids) >= budget:
            finish = "max_tokens"
            break
        if turns >= sc.max_turns:
            finish = "max_turns"
            break
        messages = step_messages(turns - 1, spec)
        # The turn goes into the conversation as its parse (a structured message), or
        # as written when a call broke.
        conversation += [turn_message(text), *messages]
        close = PLAIN.encode(sc.close) if cut else []
        # The bridge is proved on the conversation: the turn's text must be its canonical
        # re-render (and a cut turn's close ids must be what the layout writes after it).
        rest = bridges(text, PLAIN.decode(close), messages)
        canonical += rest is not None
        rewritten += rest is None
        if env_tools != tools or spec.brk or rest is None:
            full = PLAIN.encode(plain_text(conversation, env_tools))
            if budget is not None and len(full) >= budget:
                finish = "max_tokens"  # no room for a turn: the episode does not go on
                break
            if sc.on_break == "raise":
                return Expected(failure="TemplateBreakError")
            breaks += 1
            tools = env_tools
            elements.append(full)
            masks.append([False] * len(full))
        else:
            bridge = PLAIN.encode(rest)
            if budget is not None and len(ids) + len(close) + len(bridge) >= budget:
                finish = "max_tokens"
                break
            ids += close + bridge
            mask += [False] * (len(close) + len(bridge))
        truncated += cut
    return Expected(
        elements=elements,
        masks=masks,
        finish=finish,
        reward=script.final if reward is None else reward,
        episode={
            "turns": turns,
            "finish": finish,
            "breaks": breaks,
            "tool_calls": tool_calls,
            "parse_errors": parse_errors,
            "truncated_turns": truncated,
        },
        canonical=canonical,
        rewritten=rewritten,
    )


# --------------------------------------------------------------------------- a run


@attrs.define(eq=False)
class Outcome:
    world: World
    iface: RecordingInference
    source: PromptSource
    delivered: list[tr.RolloutGroup] = attrs.Factory(list)
    committed: list[int] = attrs.Factory(list)
    drain_bodies: list[tuple[int, int]] = attrs.Factory(list)
    error: BaseException | None = None
    final: tr.RolloutStreamStatistics | None = None
    after_exit: tuple[int, int, int, int] | None = None
    ended: bool = False


def problems() -> list[tr.Problem]:
    return [tr.Problem(problem_id=f"p{i}", prompt=f"solve problem {i}") for i in range(N_PROBLEMS)]


def run_scenario(sc: Scenario) -> Outcome:
    world = World(sc)
    iface = RecordingInference(
        policy=make_policy(world),
        latency=LatencyModel(
            first_token=sc.first_token, per_token=sc.per_token, distribution="constant"
        ),
    )
    source = PromptSource(problems(), seed=3)
    out = Outcome(world=world, iface=iface, source=source)
    failure_policy = tr.FailurePolicy()
    if sc.policy is not None:
        attempts, on_failure, budget = sc.policy
        failure_policy = tr.FailurePolicy(
            max_attempts=attempts,
            retry_on=(Boom, tr.StepTimeoutError),
            wait_initial=0.5,
            wait_max=1.0,
            wait_jitter=0.0,
            on_failure=on_failure,
            skip_budget=budget,
        )
    agent = tr.MultiTurnAgent(
        environment=lambda problem: ScriptedEnv(world, problem),
        renderer=BreakingRenderer(sc.close),
        max_turns=sc.max_turns,
        max_episode_tokens=sc.max_episode_tokens,
        step_timeout=sc.step_timeout,
        environment_concurrency=sc.environment_concurrency,
        on_break=sc.on_break,
        prompts=source,
        parallel_generation_tasks=sc.outstanding * sc.num_groups,
        buffer_size=sc.buffer_size,
        failure_policy=failure_policy,
    )
    request = tr.GroupedRolloutRequest(
        num_groups=sc.num_groups,
        rollouts_per_group=sc.rollouts_per_group,
        inference_interface=iface,
        streaming=True,
        generation_args=tr.GenerationArgs(max_tokens=sc.gen_max_tokens),
    )

    async def consume(stream: tr.RolloutStream) -> None:
        for action in sc.actions:
            if isinstance(action, Take):
                try:
                    out.delivered.append(await stream.receive())
                except trio.EndOfChannel:
                    out.ended = True
                    return
                continue
            await trio.sleep(action.delay)
            async with stream.weight_update(action.mode) as update:
                if action.mode == "drain":
                    out.drain_bodies.append((world.live_episodes, iface.in_flight))
                await trio.sleep(action.body)
            out.committed.append(update.epoch)
        if sc.finish == "raise":
            raise ConsumerError

    async def main() -> None:
        box: list[tr.RolloutStream] = []
        with trio.fail_after(HANG_AFTER):
            cancel_after = math.inf if sc.cancel_after is None else sc.cancel_after
            with trio.move_on_after(cancel_after):
                try:
                    async with agent.get_grouped_rollouts(request) as stream:
                        box.append(stream)
                        await consume(stream)
                except ConsumerError:
                    pass
                except Exception as exc:  # judged afterwards
                    out.error = exc
            if box:
                out.final = box[0].statistics()
            out.after_exit = (
                world.live_ops,
                world.live_aclose,
                iface.in_flight,
                world.live_episodes,
            )

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out


# --------------------------------------------------------------------------- judging


def sampled_runs(mask: list[bool]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def expected_boundaries(
    element: list[int], turns: list[tuple[int, Generation]], start_epoch: int
) -> list[tuple[int, int]]:
    """(0, e) first, then (j, e') at the first sampled id generated under e'."""
    epochs: list[tuple[int, int]] = []
    for offset, gen in turns:
        for k in range(len(gen.sampled)):
            epoch = [e for start, e in gen.policy_epoch if start <= k][-1]
            epochs.append((offset + k, epoch))
    if not epochs:
        return [(0, start_epoch)]
    out = [(0, epochs[0][1])]
    for position, epoch in epochs[1:]:
        if epoch != out[-1][1]:
            out.append((position, epoch))
    return out


def check_boundaries(boundaries: list[tuple[int, int]], length: int, where: str) -> None:
    assert boundaries, where
    assert boundaries[0][0] == 0, where
    for (i0, e0), (i1, e1) in itertools.pairwise(boundaries):
        assert i0 < i1 < max(length, 1), where
        assert e0 != e1, where


def check_rollout(out: Outcome, group: tr.RolloutGroup, rollout: tr.TokenRollout) -> int:
    sc, world, iface = out.world.sc, out.world, out.iface
    first = PLAIN.decode(rollout.trajectory[0])
    found = re.match(r"<\|system\|>\nep(\d+)\n", first.removeprefix(_tools_prefix(first)))
    assert found is not None, first[:80]
    n = int(found.group(1))
    problem_id = rollout.problem_id
    assert problem_id is not None
    problem = problems()[int(problem_id[1:])]
    where = f"env {n}, {problem_id}"
    expect = expected_episode(sc, world.script(n), reset_messages(n, problem))
    assert expect.failure is None, f"{where}: delivered, but its script fails: {expect.failure}"

    # The episode is the one the contract predicts.
    record = dict(rollout.extra["episode"])
    per_turn = record.pop("per_turn")
    assert record == expect.episode, where
    # One record per turn: its span is exactly the turn's sampled ids.
    assert rollout.generation_mask is not None
    spans = [
        (i, start, end)
        for i, mask in enumerate(rollout.generation_mask)
        for start, end in sampled_runs(mask)
    ]
    assert [(t["element"], t["start"], t["end"]) for t in per_turn] == spans, where
    assert sum(len(t["tool_calls"]) for t in per_turn) == expect.episode["tool_calls"], where
    assert [PLAIN.decode(ids) for ids in rollout.trajectory] == [
        PLAIN.decode(ids) for ids in expect.elements
    ], where
    assert rollout.generation_mask == expect.masks, where
    assert isinstance(rollout.reward, float), where
    assert rollout.reward == expect.reward, where
    assert rollout.fidelity == "exact", where
    # The environment saw every turn, the last included, and final_reward only after a limit.
    assert world.resets[n] == 1, where
    assert world.steps[n] == expect.episode["turns"], where
    assert world.finals[n] == (expect.finish != "done"), where

    # The extension property, and the sampled ids verbatim, per recorded request.
    generations = iface.log.get(n, [])
    assert rollout.generation_mask is not None
    runs = [
        (i, start, end)
        for i, mask in enumerate(rollout.generation_mask)
        for start, end in sampled_runs(mask)
    ]
    assert len(runs) == len(generations) == expect.episode["turns"], where
    per_element: dict[int, list[tuple[int, Generation]]] = {}
    for (i, start, end), gen in zip(runs, generations, strict=True):
        element = rollout.trajectory[i]
        assert element[: len(gen.prompt_ids)] == gen.prompt_ids, f"{where}: not a prefix"
        assert start == len(gen.prompt_ids), where
        assert element[start:end] == gen.sampled, where
        limit = sc.gen_max_tokens
        if sc.max_episode_tokens is not None:
            left = sc.max_episode_tokens - len(gen.prompt_ids)
            limit = left if limit is None else min(limit, left)
        assert gen.max_tokens == limit, where
        per_element.setdefault(i, []).append((start, gen))

    # Masks and logprobs line up.
    assert rollout.logprobs is not None
    for i, (ids, mask) in enumerate(zip(rollout.trajectory, rollout.generation_mask, strict=True)):
        assert len(rollout.logprobs[i]) == mask.count(True), where
        recorded = [lp for _, gen in per_element.get(i, []) for lp in gen.logprobs or []]
        assert rollout.logprobs[i] == recorded, where
        # Nothing is appended past the bound (only a first render may exceed it alone).
        if sc.max_episode_tokens is not None and (i > 0 or any(mask)):
            assert len(ids) <= sc.max_episode_tokens, f"{where}: element {i} past the bound"

    # Epoch boundaries: well-formed, from the backend's stamps, only known epochs.
    known = {0, *out.committed}
    for i, ids in enumerate(rollout.trajectory):
        boundaries = [tuple(b) for b in rollout.policy_epoch[i]]
        check_boundaries(boundaries, len(ids), where)  # type: ignore[arg-type]
        assert boundaries == expected_boundaries(ids, per_element.get(i, []), group.start_epoch), (
            where
        )
        assert {e for _, e in boundaries} <= known, where
        assert [e for _, e in boundaries] == sorted(e for _, e in boundaries), where
        check_boundaries([tuple(b) for b in rollout.kv_cache_epoch[i]], len(ids), where)  # type: ignore[misc]
    return n


def _tools_prefix(text: str) -> str:
    found = re.match(r"<\|tools\|>\n[^\n]*\n", text)
    return "" if found is None else found.group(0)


def leaves_of(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaves_of(sub)]
    return [exc]


def check(out: Outcome) -> None:
    world, sc = out.world, out.world.sc
    assert not world.violations, world.violations
    # Nothing runs after exit; every environment made is closed exactly once.
    assert out.after_exit == (0, 0, 0, 0)
    assert sorted(world.closed) == world.made
    assert set(world.closed.values()) <= {1}
    if sc.environment_concurrency is not None:
        assert world.max_live_ops <= sc.environment_concurrency
    # A drain update waits for whole episodes.
    assert all(body == (0, 0) for body in out.drain_bodies), out.drain_bodies
    # The ledger.
    assert out.final is not None
    assert out.final.unaccounted == 0
    assert out.final.in_flight == 0
    # Failures are the ones the scenario can cause.
    if out.error is not None:
        # Episodes failing at the same instant (before a sibling's cancellation lands)
        # are an ExceptionGroup of them, as any simultaneous failures of a group.
        allowed = (
            Boom,
            tr.StepTimeoutError,
            tr.TemplateBreakError,
            tr.FailureBudgetExceededError,
            ValueError,  # max_episode_tokens at or below the first render
        )
        # The consumer's own exception comes out with the group's failure when both happen
        # at the same instant, as the pipeline says (an ExceptionGroup of the two).
        leaves = [leaf for leaf in leaves_of(out.error) if not isinstance(leaf, ConsumerError)]
        assert leaves, repr(out.error)
        assert all(isinstance(leaf, allowed) for leaf in leaves), repr(out.error)
        assert sc.can_fail(), repr(out.error)
    # Delivered groups, one rollout per episode, each what the contract predicts.
    seen: set[int] = set()
    for group in out.delivered:
        assert len(group) == sc.rollouts_per_group
        assert len({r.problem_id for r in group}) == 1
        for rollout in group:
            assert isinstance(rollout, tr.TokenRollout)
            n = check_rollout(out, group, rollout)
            assert n not in seen
            seen.add(n)
    if currently_in_test_context():
        note_events(out)
    # PromptSource: every problem taken once across delivered groups, none lost.
    taken = [group[0].problem_id for group in out.delivered]
    assert len(taken) == len(set(taken))
    restored = PromptSource(problems(), seed=3)
    restored.load_state_dict(out.source.state_dict())
    rest = [restored.draw().problem_id for _ in range(N_PROBLEMS - len(taken))]
    assert sorted(taken + rest) == sorted(p.problem_id for p in problems())


def note_events(out: Outcome) -> None:
    """What the example exercised (shown by ``--hypothesis-show-statistics``)."""
    event(f"error: {type(out.error).__name__}")
    event(f"groups delivered: {min(len(out.delivered), 3)}")
    for group in out.delivered:
        for rollout in group:
            episode = rollout.extra["episode"]
            event(f"finish: {episode['finish']}")
            for key in ("breaks", "truncated_turns", "parse_errors", "tool_calls"):
                if episode[key]:
                    event(f"episode with {key}")
            if any(len(b) > 1 for b in rollout.policy_epoch):
                event("episode with several epochs in an element")
            # Two turns in one element: a proved bridge between them.
            if any(len(sampled_runs(mask)) > 1 for mask in rollout.generation_mask or []):
                event("episode with a bridge")
            n = int(PLAIN.decode(rollout.trajectory[0]).split("<|system|>\nep")[1].split("\n")[0])
            problem = problems()[int((rollout.problem_id or "p0")[1:])]
            expect = expected_episode(out.world.sc, out.world.script(n), reset_messages(n, problem))
            if expect.canonical:
                event("episode with a canonical turn")
            if expect.rewritten:
                event("episode with a turn that is not its canonical re-render")
            if any(e > group.start_epoch for b in rollout.policy_epoch for _, e in b):
                event("epoch changed after the group started")


# --------------------------------------------------------------------------- properties


@PROPERTY
@given(scenarios())
def test_random_episodes_keep_every_invariant(sc: Scenario) -> None:
    check(run_scenario(sc))


@PROPERTY
@given(scenarios(failures=False, cancel=False))
def test_episodes_that_cannot_fail_are_all_delivered(sc: Scenario) -> None:
    out = run_scenario(sc)
    check(out)
    assert out.error is None
    assert len(out.delivered) == sum(isinstance(a, Take) for a in sc.actions)


@PROPERTY
@given(scenarios(failures=False, cancel=False, updates=True))
def test_keep_and_abort_updates_inside_and_between_turns_show_in_policy_epoch(
    sc: Scenario,
) -> None:
    out = run_scenario(sc)
    check(out)  # boundaries follow the backend's stamps per turn, at element positions
    assert out.error is None
    assert len(out.delivered) == sum(isinstance(a, Take) for a in sc.actions)


# --------------------------------------------------------------------------- targeted rules


@pytest.mark.parametrize("close", ["", "<|end|>"])
@pytest.mark.parametrize("completion", COMPLETIONS)
def test_the_reference_bridge_is_the_plain_renderers_proof(completion: str, close: str) -> None:
    # The reference model's bridge (written from the layout) against PlainRenderer's
    # proof on the conversation, for every completion and every cut of it; and the
    # completions hold both canonical turns (they bridge) and others (breaks).
    reset = reset_messages(0, problems()[0])
    messages = [ChatMessage(role="tool", content="result 0.0")]
    for k in range(1, len(completion) + 1):
        text = completion[:k]
        history = [*reset, turn_message(text)]
        held = PLAIN.render(reset) + PLAIN.encode(text + close)
        proved = PLAIN.bridge(held, messages, messages=history)
        expected = bridges(text, close, messages)
        assert proved == (None if expected is None else PLAIN.encode(expected)), repr(text)
        assert PLAIN.render([*history, *messages]) == PLAIN.encode(
            plain_text([*history, *messages], None)
        )
    canonical = [i for i, c in enumerate(COMPLETIONS) if bridges(c, "", []) is not None]
    assert tuple(canonical) == CANONICAL


def one_scenario(**changes: Any) -> Scenario:
    """A plain scenario: one group of ``rollouts_per_group`` episodes, taken once."""
    turn = Turn(
        completion=0, replies=1, brk=False, tools_after=None, done=False, reward=0.0,
        sleep=0.0, raises=False,
    )  # fmt: skip
    fields: dict[str, Any] = {
        "scripts": (Script(tools0=0, turns=(turn,), final=0.5),),
        "num_groups": 1,
        "outstanding": 1,
        "rollouts_per_group": 2,
        "buffer_size": 0,
        "max_turns": 3,
        "max_episode_tokens": None,
        "gen_max_tokens": None,
        "close": "",
        "on_break": "split",
        "step_timeout": None,
        "environment_concurrency": None,
        "first_token": 0.1,
        "per_token": 0.01,
        "policy": None,
        "actions": (Take(),),
        "finish": "break",
        "cancel_after": None,
    }
    return Scenario(**{**fields, **changes})


def break_turn(**changes: Any) -> Turn:
    fields: dict[str, Any] = {
        "completion": 0, "replies": 0, "brk": True, "tools_after": None, "done": False,
        "reward": 0.0, "sleep": 0.0, "raises": False,
    }  # fmt: skip
    return Turn(**{**fields, **changes})


@pytest.mark.parametrize("on_break", ["split", "raise"])
def test_a_break_with_no_room_left_for_a_turn_is_not_a_break(on_break: str) -> None:
    # After turn 1 the bridge cannot be proved, and the full render would leave no id
    # for turn 2 within max_episode_tokens: the episode ends there ("max_tokens"),
    # with one element and no break counted, and on_break="raise" raises nothing.
    script = Script(tools0=0, turns=(break_turn(),), final=0.5)
    reset = reset_messages(0, problems()[0])
    first_turn = len(PLAIN.render(reset)) + len(COMPLETIONS[0])
    full = PLAIN.render(
        [
            *reset,
            ChatMessage(role="assistant", content=COMPLETIONS[0]),
            *step_messages(0, script.turns[0]),
        ]
    )
    assert len(full) > first_turn + 1
    for budget in (first_turn + 1, len(full)):
        sc = one_scenario(
            scripts=(script,), rollouts_per_group=1, max_episode_tokens=budget, on_break=on_break
        )
        out = run_scenario(sc)
        check(out)
        assert out.error is None
        [rollout] = out.delivered[0]
        record = dict(rollout.extra["episode"])
        assert len(record.pop("per_turn")) == 1
        assert record == {
            "turns": 1, "finish": "max_tokens", "breaks": 0, "tool_calls": 0,
            "parse_errors": 0, "truncated_turns": 0,
        }  # fmt: skip
        assert len(rollout.trajectory) == 1
        assert rollout.reward == 0.5  # final_reward(): a limit ended it


def test_a_break_with_room_left_splits_or_raises() -> None:
    script = Script(tools0=0, turns=(break_turn(),), final=0.5)
    out = run_scenario(one_scenario(scripts=(script,), max_turns=2))
    check(out)
    for rollout in out.delivered[0]:
        assert len(rollout.trajectory) == 2
        assert rollout.extra["episode"]["breaks"] == 1
        assert not any(rollout.generation_mask[1][: -len(COMPLETIONS[0])])  # type: ignore[index]
    out = run_scenario(one_scenario(scripts=(script,), max_turns=2, on_break="raise"))
    check(out)
    assert all(isinstance(leaf, tr.TemplateBreakError) for leaf in leaves_of(out.error))  # type: ignore[arg-type]


def test_an_episode_cancelled_waiting_for_an_environment_slot_leaves_nothing_behind() -> None:
    # environment_concurrency=1: the second episode waits for the first one's reset; a
    # cancel scope fires meanwhile. Its reset() must never have been called (a coroutine
    # made before the slot and then dropped is a "never awaited" RuntimeWarning, an
    # error in this suite), and both environments are closed once.
    slow = break_turn(brk=False, sleep=5.0)
    sc = one_scenario(
        scripts=(Script(tools0=0, turns=(slow,), final=0.0),),
        environment_concurrency=1,
        rollouts_per_group=3,
        cancel_after=0.05,  # inside the first reset (0.1 s)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_scenario(sc)
        gc.collect()  # a dropped coroutine may sit in a reference cycle until here
    assert [str(w.message) for w in caught] == []
    check(out)
    assert out.delivered == []
    assert sum(out.world.resets.values()) == 1
    assert len(out.world.made) == 3


def test_waiting_for_an_environment_slot_does_not_count_against_step_timeout() -> None:
    # Three episodes, one slot: each step takes 0.8 s of a 1.0 s step_timeout, so later
    # steps wait longer than the deadline for the slot, and none times out.
    ok = break_turn(brk=False, sleep=0.8)
    sc = one_scenario(
        scripts=(Script(tools0=0, turns=(ok,), final=0.0),),
        environment_concurrency=1,
        rollouts_per_group=3,
        step_timeout=1.0,
    )
    out = run_scenario(sc)
    check(out)
    assert out.error is None
    assert [r.extra["episode"]["finish"] for r in out.delivered[0]] == ["max_turns"] * 3
    # A step that itself runs past the deadline is cancelled: StepTimeoutError.
    late = break_turn(brk=False, sleep=1.5)
    out = run_scenario(attrs.evolve(sc, scripts=(Script(tools0=0, turns=(ok, late), final=0.0),)))
    check(out)
    assert all(isinstance(leaf, tr.StepTimeoutError) for leaf in leaves_of(out.error))  # type: ignore[arg-type]
    assert out.world.live_ops == 0


def test_a_step_that_raises_fails_the_group_as_itself_and_closes_every_environment() -> None:
    boom = break_turn(brk=False, sleep=0.3, raises=True)
    slow = break_turn(brk=False, sleep=50.0)
    scripts = (
        Script(tools0=0, turns=(boom,), final=0.0),
        Script(tools0=0, turns=(slow,), final=0.0),
    )
    out = run_scenario(one_scenario(scripts=scripts, rollouts_per_group=2))
    check(out)
    assert isinstance(out.error, Boom)  # the sibling was cancelled, not a second failure
    assert out.world.closed == Counter({0: 1, 1: 1})
    # Retried as a whole group (Boom is in retry_on): new environments, all closed once.
    retry = one_scenario(scripts=scripts, rollouts_per_group=2, policy=(3, "raise", 0))
    out = run_scenario(retry)
    check(out)
    assert isinstance(out.error, Boom)
    assert len(out.world.made) == 6
    assert set(out.world.closed.values()) == {1}
