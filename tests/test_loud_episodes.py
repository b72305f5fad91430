"""Silent wrong data in episodes, made loud: each test fails without its fix.

1. A renderer whose ids the backend cannot take (``HFRenderer``'s BPE ids over the
   embedded backend's code points) is refused when the stream opens, by vocabulary
   (``token_vocabulary`` on both sides), not by class; so is the pair at ``serve``.
2. ``testing.VocabularyInference``: a seeded token-in backend over a tokenizer's
   vocabulary, the backend ``HFRenderer`` episodes need offline.
3. Roles: ``ChatMessage`` refuses roles no template renders (a tool result as
   ``"function"``), a renderer declares its extra roles, and a bridge whose new messages
   render to no text is a break, never a proof.
4. A broken tool call is shown back to the model as it wrote it.
5. ``step_timeout`` and ``max_episode_tokens`` have finite defaults.

The HF tests use the real chat templates of ``tests/data/chat_templates`` on offline
tokenizers (``_families.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_rollouts as tr
from trio_rollouts import (
    AssistantTurn,
    BaseEnvironment,
    ChatMessage,
    EnvironmentStep,
    GenerationArgs,
    GroupedRolloutRequest,
    HFRenderer,
    MultiTurnAgent,
    PlainRenderer,
    Problem,
    PromptSource,
    TokenRollout,
)
from trio_rollouts.inference import (
    CODE_POINTS,
    AcceptsTokens,
    EmbeddedInference,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
    ReturnsLogProbs,
    ReturnsRaw,
    ReturnsTokens,
    accepts_tokens,
    token_vocabulary,
)
from trio_rollouts.renderers import tokenizer_vocabulary
from trio_rollouts.testing import VocabularyInference

pytest.importorskip("transformers", reason="the hf extra is not installed")
import _families

PROBLEMS = [Problem(problem_id="p0", prompt="What is 2 + 2?", answer=4)]
QWEN = "qwen2.5"
#: A role nobody's template renders, declared by one renderer in these tests only.
ODD_ROLE = "loud_test_observer"


def qwen() -> HFRenderer:
    return HFRenderer(_families.tokenizer(QWEN))


def hf_model(family: str, policy: Any = None, **fields: Any) -> VocabularyInference:
    tokenizer = _families.tokenizer(family)
    stops = HFRenderer(tokenizer).stop_token_ids
    return VocabularyInference(tokenizer, seed=0, policy=policy, stop_token_ids=stops, **fields)


class Quiz(BaseEnvironment):
    """Asks 2 + 2; answers each tool call with one ``reply_role`` message (an error for
    a broken call), and is done at the first turn without calls."""

    def __init__(self, problem: Problem, reply_role: str = "tool", turns: int = 3) -> None:
        super().__init__()
        self.problem, self.reply_role, self.turns = problem, reply_role, turns
        self.steps = 0

    async def reset(self) -> Sequence[ChatMessage]:
        await trio.lowlevel.checkpoint()
        return [ChatMessage(role="user", content=str(self.problem.prompt))]

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        await trio.lowlevel.checkpoint()
        self.steps += 1
        if self.steps >= self.turns:
            return EnvironmentStep(done=True, reward=1.0)
        replies = [
            ChatMessage(
                role=self.reply_role,
                content="4" if call.arguments is not None else f"error: {call.parse_error}",
                extra={"tool_call_id": call.id},
            )
            for call in turn.tool_calls
        ] or [ChatMessage(role="user", content="Are you sure?")]
        return EnvironmentStep(messages=replies)


def agent(renderer: Any, **fields: Any) -> MultiTurnAgent:
    made = fields.pop("made", None)
    reply_role = fields.pop("reply_role", "tool")

    def environment(problem: Problem) -> Quiz:
        if made is not None:
            made.append(problem)
        return Quiz(problem, reply_role)

    return MultiTurnAgent(
        environment=environment,
        renderer=renderer,
        prompts=PromptSource(PROBLEMS),
        **{"max_turns": 3, **fields},
    )


def request(backend: InferenceInterface, group: int = 1) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=group, inference_interface=backend
    )


async def one_group(a: MultiTurnAgent, r: GroupedRolloutRequest) -> list[TokenRollout]:
    async with a.get_grouped_rollouts(r) as stream:
        group = await stream.receive()
    return [rollout for rollout in group if isinstance(rollout, TokenRollout)]


def scripted(*turns: str) -> Any:
    """A policy that writes ``turns[n]`` as the model's turn ``n`` (the last one after)."""

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        n = sum(message.role == "assistant" for message in messages)
        return [turns[min(n, len(turns) - 1)]], [1.0]

    return policy


def embedded(*turns: str) -> EmbeddedInference:
    latency = LatencyModel(first_token=0.1, per_token=0.0, distribution="constant")
    return EmbeddedInference(policy=scripted(*turns), latency=latency)


# --------------------------------------------------------------------------- 1. vocabularies


async def test_hf_renderer_over_code_points_is_refused_when_the_stream_opens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    made: list[Problem] = []
    a = agent(qwen(), made=made)
    with pytest.raises(TypeError) as info:
        a.get_grouped_rollouts(request(embedded("The answer is 4.")))
    message = str(info.value)
    assert "HFRenderer" in message
    assert "EmbeddedInference" in message
    assert "Unicode code points" in message
    assert "hf:" in message
    assert "PlainRenderer()" in message
    assert "VocabularyInference(tokenizer)" in message
    assert made == []  # before any work: no environment was made


async def test_group_rollout_alone_refuses_the_pair_before_any_work(
    autojump_clock: trio.testing.MockClock,
) -> None:
    made: list[Problem] = []
    with pytest.raises(TypeError, match=r"HFRenderer .* EmbeddedInference"):
        await agent(qwen(), made=made).group_rollout(request(embedded("x")))
    assert made == []


async def test_the_same_pair_under_the_gateway_is_refused_at_serve() -> None:
    with pytest.raises(TypeError, match=r"serve\(\): the renderer HFRenderer"):
        async with tr.gateway.serve(embedded("x"), qwen()):
            pass  # pragma: no cover - refused before the server starts


async def test_a_renderer_that_declares_no_vocabulary_is_refused_over_code_points(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @attrs.frozen
    class Undeclared:
        """PlainRenderer's members, delegated, without its token_vocabulary."""

        plain: PlainRenderer = attrs.Factory(PlainRenderer)
        stop_token_ids: list[int] = attrs.Factory(list)
        close_ids: list[int] = attrs.Factory(list)

        def render(self, messages: Any, *, tools: Any = None, add_generation_prompt: bool = True) -> list[int]:  # fmt: skip
            return self.plain.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)  # fmt: skip

        def bridge(self, previous_ids: Any, new_messages: Any, *, tools: Any = None) -> list[int] | None:  # fmt: skip
            return self.plain.bridge(previous_ids, new_messages, tools=tools)

        def parse(self, completion_ids: Any) -> AssistantTurn:
            return self.plain.parse(completion_ids)

        def decode(self, ids: Any) -> str:
            return self.plain.decode(ids)

        def encode(self, text: str) -> list[int]:
            return self.plain.encode(text)

    with pytest.raises(TypeError, match="token_vocabulary = 'code_points'"):
        agent(Undeclared()).get_grouped_rollouts(request(embedded("x")))

    @attrs.frozen
    class Declared(Undeclared):
        token_vocabulary: str = CODE_POINTS

    (rollout,) = await one_group(agent(Declared()), request(embedded("The answer is 4.")))
    assert rollout.fidelity == "exact"


def test_a_plain_renderer_subclass_with_its_own_encoding_declares_nothing() -> None:
    @attrs.frozen
    class Encoded(PlainRenderer):
        def encode(self, text: str) -> list[int]:
            return [ord(c) + 1 for c in text]

    assert PlainRenderer().token_vocabulary == CODE_POINTS
    assert Encoded().token_vocabulary is None


def test_plain_renderer_over_a_tokenizer_vocabulary_is_refused() -> None:
    with pytest.raises(TypeError, match="PlainRenderer writes Unicode code points"):
        agent(PlainRenderer()).get_grouped_rollouts(request(hf_model(QWEN)))


async def test_hf_renderer_over_vocabulary_inference_of_its_tokenizer_runs_exact(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rollouts = await one_group(agent(qwen()), request(hf_model(QWEN), group=2))
    assert [r.fidelity for r in rollouts] == ["exact", "exact"]
    for rollout in rollouts:
        assert rollout.logprobs is not None
        assert rollout.generation_mask is not None
        assert sum(map(sum, rollout.generation_mask)) == sum(map(len, rollout.logprobs))


async def test_a_backend_that_does_not_know_its_vocabulary_is_taken_on_trust(
    autojump_clock: trio.testing.MockClock,
) -> None:
    @attrs.define(eq=False)
    class Server(InferenceInterface, ReturnsRaw, ReturnsLogProbs, AcceptsTokens):
        inner: VocabularyInference

        async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
            return await self.inner.base_generate(request)

    assert token_vocabulary(Server(hf_model(QWEN))) is None
    (rollout,) = await one_group(agent(qwen()), request(Server(hf_model(QWEN))))
    assert rollout.fidelity == "exact"


def test_a_vocabulary_is_the_token_map_not_the_tokenizer_object() -> None:
    import transformers

    one, two = (
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=_families._train(["<|im_start|>", "<|im_end|>"], [])
        )
        for _ in range(2)
    )
    assert one is not two
    vocabulary = tokenizer_vocabulary(one)
    assert vocabulary is not None
    assert vocabulary.startswith("hf:")
    assert vocabulary == tokenizer_vocabulary(two)
    qwen_vocabulary = tokenizer_vocabulary(_families.tokenizer(QWEN))
    assert qwen_vocabulary == qwen().token_vocabulary
    assert qwen_vocabulary not in (vocabulary, tokenizer_vocabulary(_families.tokenizer("phi3.5")))
    assert tokenizer_vocabulary(object()) is None


# --------------------------------------------------------------------------- 2. the backend


def prompt_request(args: GenerationArgs | None = None) -> InferenceRequest:
    ids = qwen().render([ChatMessage(role="user", content="What is 2 + 2?")])
    return InferenceRequest(prompt=[], prompt_ids=ids, generation_args=args or GenerationArgs())


def generated(response: InferenceResponse) -> list[int]:
    assert response.token_ids is not None
    assert response.prompt_length is not None
    return response.token_ids[response.prompt_length :]


def test_vocabulary_inference_has_the_markers_of_a_token_in_backend() -> None:
    model = hf_model(QWEN)
    for marker in (AcceptsTokens, ReturnsRaw, ReturnsTokens, ReturnsLogProbs):
        assert isinstance(model, marker)
    assert accepts_tokens(model)
    assert model.token_vocabulary == qwen().token_vocabulary


async def test_the_same_seed_gives_the_same_ids_and_another_seed_others() -> None:
    tokenizer = _families.tokenizer(QWEN)
    runs = []
    for seed in (0, 0, 1):
        model = VocabularyInference(tokenizer, seed=seed, mean_length=40)
        runs.append([generated(await model.agenerate(prompt_request())) for _ in range(3)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert runs[0][0] != runs[0][1]  # the same prompt again: the next sample


async def test_a_request_seed_fixes_its_sample_whatever_came_before() -> None:
    seeded = prompt_request(GenerationArgs(seed=7))
    fresh = hf_model(QWEN)
    used = hf_model(QWEN)
    for _ in range(3):
        await used.agenerate(prompt_request())
    assert generated(await fresh.agenerate(seeded)) == generated(await used.agenerate(seeded))


async def test_turns_end_at_the_stop_id_or_at_max_tokens_with_one_logprob_per_id() -> None:
    model = hf_model(QWEN, mean_length=4)
    stops = qwen().stop_token_ids
    finishes = set()
    for _ in range(20):
        response = await model.agenerate(prompt_request(GenerationArgs(max_tokens=6)))
        ids = generated(response)
        assert response.logprobs is not None
        assert len(response.logprobs) == len(ids)
        assert all(math.isfinite(x) and x <= 0 for x in response.logprobs)
        assert response.logprobs_mode == "processed"
        if response.finish_reason == "stop":
            assert ids[-1] == stops[0]
            assert stops[0] not in ids[:-1]
        else:
            assert response.finish_reason == "length"
            assert len(ids) == 6
            assert not set(ids) & set(stops)
        finishes.add(response.finish_reason)
        assert response.raw_text == qwen().decode(response.token_ids or [])
    assert finishes == {"stop", "length"}


async def test_no_special_token_but_the_stop_and_no_byte_fragment_is_sampled() -> None:
    tokenizer = _families.tokenizer(QWEN)
    model = hf_model(QWEN, mean_length=200, max_tokens=200)
    special = set(tokenizer.all_special_ids)
    for _ in range(5):
        ids = generated(await model.agenerate(prompt_request()))
        body = ids[:-1] if ids[-1] in qwen().stop_token_ids else ids
        assert not set(body) & special
        assert all("\ufffd" not in tokenizer.decode([i]) for i in body)


async def test_generation_args_are_honoured() -> None:
    model = hf_model(QWEN, mean_length=30)
    greedy = [
        generated(await model.agenerate(prompt_request(GenerationArgs(temperature=0.0))))
        for _ in range(2)
    ]
    assert greedy[0] == greedy[1]  # greedy: the same ids every time
    top_1 = generated(await model.agenerate(prompt_request(GenerationArgs(top_k=1))))
    assert top_1 == greedy[0]
    cold = await model.agenerate(prompt_request(GenerationArgs(temperature=0.05)))
    hot = await model.agenerate(prompt_request(GenerationArgs(temperature=5.0)))
    assert cold.logprobs is not None
    assert hot.logprobs is not None
    # A cold distribution is sharper: its samples are far more probable.
    assert sum(cold.logprobs) / len(cold.logprobs) > sum(hot.logprobs) / len(hot.logprobs)


async def test_a_policy_writes_its_completion_in_the_tokenizers_ids() -> None:
    tokenizer = _families.tokenizer(QWEN)

    def policy(messages: list[ChatMessage]) -> tuple[list[str], list[float]]:
        assert messages[-1].content == "What is 2 + 2?"
        return ["It is 4.", "It is 5."], [3.0, 1.0]

    model = hf_model(QWEN, policy=policy)
    response = await model.agenerate(
        attrs.evolve(prompt_request(), prompt=[ChatMessage(role="user", content="What is 2 + 2?")])
    )
    ids = generated(response)
    text = response.response.content
    assert text in ("It is 4.", "It is 5.")
    assert ids == [*tokenizer.encode(text, add_special_tokens=False), qwen().stop_token_ids[0]]
    assert response.logprobs is not None
    assert math.isclose(sum(response.logprobs), math.log(0.75 if text.endswith("4.") else 0.25))


async def test_a_chat_request_is_rendered_with_the_tokenizers_template() -> None:
    model = hf_model(QWEN)
    chat = InferenceRequest(prompt=[ChatMessage(role="user", content="What is 2 + 2?")])
    response = await model.agenerate(chat)
    assert response.token_ids is not None
    assert response.token_ids[: response.prompt_length] == prompt_request().prompt_ids


async def test_a_cancelled_call_draws_no_sample(autojump_clock: trio.testing.MockClock) -> None:
    cancelled, untouched = hf_model(QWEN, latency=1.0), hf_model(QWEN, latency=1.0)
    with trio.move_on_after(0.5):
        await cancelled.agenerate(prompt_request())
    assert len(cancelled.requests) == 1
    assert generated(await cancelled.agenerate(prompt_request())) == generated(
        await untouched.agenerate(prompt_request())
    )


def test_a_tokenizer_without_a_vocabulary_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a Hugging Face tokenizer"):
        VocabularyInference(object())
    with pytest.raises(TypeError, match=r"stop_token_ids\[0\]"):
        VocabularyInference(_families.tokenizer(QWEN), stop_token_ids=["<|im_end|>"])


# --------------------------------------------------------------------------- 3. roles


def test_a_role_no_template_renders_is_refused_naming_field_value_and_roles() -> None:
    with pytest.raises(ValueError) as info:
        ChatMessage(role="function", content="4")
    message = str(info.value)
    assert message.startswith("role must be one of 'system', 'user', 'assistant', 'tool'")
    assert "got 'function'" in message
    assert "'tool' message" in message
    with pytest.raises(TypeError, match="role must be a str"):
        ChatMessage(role=None, content="4")  # type: ignore[arg-type]
    chat = ChatMessage(role="user", content="4")
    with pytest.raises(ValueError, match="got 'function'"):
        chat.role = "function"


def test_structuring_a_message_with_an_unknown_role_is_a_validation_error() -> None:
    with pytest.raises(tr.ValidationError, match=r"role must be one of .* got 'function'"):
        tr.structure({"role": "function", "content": "4"}, ChatMessage)
    back = tr.structure({"role": "tool", "content": "4", "tool_call_id": "c"}, ChatMessage)
    assert back.extra == {"tool_call_id": "c"}


def test_a_renderer_declares_the_extra_roles_its_template_renders() -> None:
    role = f"{ODD_ROLE}_declared"  # this test's own: roles are declared for the process
    assert role not in ChatMessage.allowed_roles()
    with pytest.raises(ValueError, match=f"got '{role}'"):
        ChatMessage(role=role, content="x")
    renderer = HFRenderer(_families.tokenizer(QWEN), extra_roles=[role])
    assert renderer.extra_roles == (role,)
    assert ChatMessage(role=role, content="x").role == role
    assert ChatMessage.allowed_roles()[:4] == ChatMessage.ROLES
    with pytest.raises(TypeError, match="extra_roles must be a sequence"):
        PlainRenderer(extra_roles="ipython")
    with pytest.raises(ValueError, match="extra_roles: a role must be a non-empty name"):
        PlainRenderer(extra_roles=[" "])


async def test_an_episode_refuses_a_role_its_renderer_does_not_declare(
    autojump_clock: trio.testing.MockClock,
) -> None:
    PlainRenderer(extra_roles=[ODD_ROLE])  # declared by another renderer than the agent's
    call = '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>'
    a = agent(PlainRenderer(), reply_role=ODD_ROLE)
    with pytest.raises(ValueError) as info:
        await one_group(a, request(embedded(call)))
    assert str(info.value).startswith(
        f"step().messages[0].role is '{ODD_ROLE}', which the renderer PlainRenderer does not "
        "render (its roles: 'system', 'user', 'assistant', 'tool')"
    )
    declaring = agent(PlainRenderer(extra_roles=[ODD_ROLE]), reply_role=ODD_ROLE)
    (rollout,) = await one_group(declaring, request(embedded(call, "The answer is 4.")))
    assert rollout.extra["episode"]["breaks"] == 0


def phi_conversation() -> tuple[HFRenderer, list[ChatMessage], list[int]]:
    renderer = HFRenderer(_families.tokenizer("phi3.5"))
    conversation = [
        ChatMessage(role="user", content="What is 2 + 2?"),
        ChatMessage(role="assistant", content="Let me compute."),
    ]
    held = renderer.render(conversation[:1]) + renderer.encode("Let me compute.")
    return renderer, conversation, held + renderer.close_ids


def test_a_bridge_whose_new_messages_render_to_nothing_is_not_proved() -> None:
    # Phi-3.5's template has no tool role: a tool message renders to no text at all.
    renderer, conversation, held = phi_conversation()
    result = [ChatMessage(role="tool", content="4")]
    assert renderer.render([*conversation, *result]) == renderer.render(conversation)
    assert renderer.bridge(held, result, messages=conversation) is None
    assert renderer.bridge(held, result) is None  # the fixed-base proof too
    # What it renders still bridges, and a bridge of no message is not refused.
    user = [ChatMessage(role="user", content="Thanks.")]
    assert renderer.bridge(held, user, messages=conversation) is not None
    assert renderer.bridge(held, user) is not None
    assert renderer.bridge(held, [], messages=conversation) is not None


class Interpreter(Quiz):
    """Runs each turn as code and answers with its output as a ``"tool"`` message."""

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        await trio.lowlevel.checkpoint()
        self.steps += 1
        if self.steps >= self.turns:
            return EnvironmentStep(done=True, reward=1.0)
        return EnvironmentStep(messages=[ChatMessage(role="tool", content="4")])


def phi_episode(**fields: Any) -> tuple[MultiTurnAgent, GroupedRolloutRequest]:
    # The model writes plain text, as Phi-3.5's template writes an answer: every turn
    # would bridge, but the template drops the tool messages between them.
    renderer = HFRenderer(_families.tokenizer("phi3.5"))
    a = MultiTurnAgent(
        environment=Interpreter,
        renderer=renderer,
        prompts=PromptSource(PROBLEMS),
        max_turns=3,
        **fields,
    )
    return a, request(hf_model("phi3.5", scripted("print(2 + 2)")))


async def test_tool_results_a_template_drops_are_a_counted_break(
    autojump_clock: trio.testing.MockClock,
) -> None:
    (rollout,) = await one_group(*phi_episode())
    episode = rollout.extra["episode"]
    assert episode["turns"] == 3
    assert episode["breaks"] == 2 == len(rollout.trajectory) - 1


async def test_tool_results_a_template_drops_raise_under_on_break_raise(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with pytest.raises(tr.TemplateBreakError) as info:
        await one_group(*phi_episode(on_break="raise"))
    assert "the step's messages (roles 'tool') render to no text" in str(info.value)


async def test_a_declared_role_the_template_drops_is_a_break_not_a_proof(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Qwen2.5's template drops any role but system, user, assistant and tool: a renderer
    # that declares one anyway gets a break, never a "proved" bridge that shows nothing.
    renderer = HFRenderer(_families.tokenizer(QWEN), extra_roles=[ODD_ROLE])
    model = hf_model(QWEN, scripted('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'))
    a = agent(renderer, reply_role=ODD_ROLE, on_break="raise")
    with pytest.raises(tr.TemplateBreakError, match=f"roles '{ODD_ROLE}'.* render to no text"):
        await one_group(a, request(model))


# --------------------------------------------------------------------------- 4. broken calls


BROKEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": 2 +}\n</tool_call>'


async def test_a_broken_call_is_shown_back_as_the_model_wrote_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    renderer = qwen()
    model = hf_model(QWEN, scripted(BROKEN, "It is 4."))
    (rollout,) = await one_group(agent(renderer, max_turns=2), request(model))
    episode = rollout.extra["episode"]
    assert (episode["parse_errors"], episode["breaks"]) == (1, 0)
    first, second = model.requests
    # The second prompt extends the first turn's ids: the call as written, then the bridge.
    assert first.prompt_ids is not None
    assert second.prompt_ids is not None
    start = rollout.extra["episode"]["per_turn"][0]
    sampled = rollout.trajectory[0][start["start"] : start["end"]]
    assert second.prompt_ids[: start["end"]] == first.prompt_ids + sampled
    # The conversation holds the text the model wrote, never a call it did not write.
    assert second.prompt[1] == ChatMessage(role="assistant", content=BROKEN)
    assert '"name": ""' not in renderer.decode(second.prompt_ids)


async def test_a_call_that_is_json_but_not_a_call_is_written_back_as_sampled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    written = "<tool_call>[1, 2]</tool_call>"
    (rollout,) = await one_group(
        agent(PlainRenderer(), max_turns=2), request(embedded(written, "The answer is 4."))
    )
    assert rollout.extra["episode"]["breaks"] == 0
    assert len(rollout.trajectory) == 1
    text = PlainRenderer().decode(rollout.trajectory[0])
    assert f"<|assistant|>\n{written}\n<|tool|>\nerror: " in text
    assert '"name"' not in text


# --------------------------------------------------------------------------- 5. defaults


def test_the_limits_have_finite_defaults_and_none_means_no_limit() -> None:
    a = agent(PlainRenderer())
    assert a.step_timeout == 300.0
    assert a.max_episode_tokens == 32_768
    unbounded = agent(PlainRenderer(), step_timeout=None, max_episode_tokens=None)
    assert (unbounded.step_timeout, unbounded.max_episode_tokens) == (None, None)


class Hung(Quiz):
    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover


async def test_by_default_a_hung_step_fails_after_five_minutes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = MultiTurnAgent(environment=Hung, renderer=PlainRenderer(), prompts=PromptSource(PROBLEMS))
    start = trio.current_time()
    with trio.fail_after(3600), pytest.raises(tr.StepTimeoutError, match=r"step_timeout=300\.0"):
        await a.group_rollout(request(embedded("x")))
    assert trio.current_time() - start == pytest.approx(300.1)


class Verbose(Quiz):
    """Answers every turn with a 5 KB tool result, never done."""

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        await trio.lowlevel.checkpoint()
        return EnvironmentStep(messages=[ChatMessage(role="tool", content="x" * 5000)])


async def test_by_default_an_episode_stops_growing_at_32768_ids(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = MultiTurnAgent(
        environment=Verbose, renderer=PlainRenderer(), prompts=PromptSource(PROBLEMS), max_turns=50
    )
    (rollout,) = await a.group_rollout(request(embedded("Let me look.")))
    episode = rollout.extra["episode"]
    assert episode["finish"] == "max_tokens"
    assert episode["turns"] < 50
    assert max(map(len, rollout.trajectory)) <= 32_768
