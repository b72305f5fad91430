"""The library suite against a running vLLM server (``run.py`` starts the server).

Each check reads the server's own account of what happened (``/metrics``, ``/is_paused``,
a re-score through ``/v1/completions`` with ``prompt_logprobs``) rather than trusting the
client:

- **token-in**: a request with ``prompt_ids`` is generated from exactly those ids;
- **tokens**: every response carries its prompt and generated token ids and one logprob
  per generated token, on both endpoints, and the logprobs are the ones the server
  computes for the same tokens when re-scoring them (bit-identical on this CPU);
- **keep**: ``pause("keep")`` with calls in flight: no token is generated while paused,
  no request is preempted, the calls finish with every token, and a repeated prompt is
  served from the prefix cache after the pause;
- **abort**: ``pause("abort")`` with calls in flight: the server aborts them, and each
  call is continued from exactly its token ids (its re-score matches, its token count is
  the one asked);
- **stream**: ``stream.weight_update`` in all four modes with a staleness bound, every
  rollout re-scored; a body that raises and a body that is cancelled; and after every
  route the server is not paused;
- **episodes**: ``MultiTurnAgent`` with ``HFRenderer.from_pretrained`` of the served model
  and a tool-message environment, with a ``keep`` update during the episodes: every turn
  is exact, every sampled id's logprob is the re-score's in its element's context, each
  turn ends with the end-of-turn id (sampled, or closed with mask 0 after a cut), and
  every environment is closed;
- **episodes-qwen2.5**: the same with a real published template, Qwen2.5's ChatML
  (``tests/data/chat_templates/qwen2.5.jinja``, a calculator tool in its system block) on
  the served tokenizer (``HFRenderer(tokenizer)``): besides the above, every turn's request
  sent exactly the element's ids before the turn, the element up to each generation prompt
  is the template's render of the structured conversation so far, and every break is
  explained.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import secrets
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import transformers
import trio
from run import PROBLEMS, CheckFailed, ToolReplies, check

import trio_rollouts as tr
from trio_rollouts._context import CallContext, call_context

#: Seconds each pause is held while the server's token counter is watched.
HOLD = 2.0
#: Generated tokens of a long call (with ``ignore_eos``): about 4 s on this CPU, so that a
#: pause lands inside it even when the server counts its tokens late (under load).
LONG = 900
#: The largest difference allowed between a sampled token's logprob and its re-score.
LOGPROB_TOLERANCE = 1e-5
#: Bound on every check (seconds).
CHECK_TIMEOUT = 300.0


@attrs.frozen
class VLLM:
    """A running server: its root URL (no ``/v1``) and the model id it serves."""

    root: str
    model: str

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(
            self.root + path, data=data, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as reply:  # loopback only
            return json.load(reply)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.root + path, timeout=30) as reply:
            text: str = reply.read().decode()
            return text

    def metric(self, name: str, label: str = "") -> float:
        """The sum of a Prometheus counter's series (those whose labels contain ``label``)."""
        total = 0.0
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
        for found in re.finditer(pattern, self.get_text("/metrics"), re.MULTILINE):
            if label in (found.group(1) or ""):
                total += float(found.group(2))
        return total

    def is_paused(self) -> bool:
        return bool(json.loads(self.get_text("/is_paused"))["is_paused"])

    def rescore(self, ids: Sequence[int]) -> list[float | None]:
        """The server's logprob of each token given the ones before it (None first)."""
        reply = self.post(
            "/v1/completions",
            {"model": self.model, "prompt": list(ids), "max_tokens": 1, "prompt_logprobs": 0},
        )
        scores: list[float | None] = []
        for token, entry in zip(ids, reply["choices"][0]["prompt_logprobs"], strict=True):
            scores.append(None if entry is None else float(entry[str(token)]["logprob"]))
        return scores


async def in_thread(function: Any, *args: Any) -> Any:
    return await trio.to_thread.run_sync(function, *args)


def worst_logprob_gap(
    vllm: VLLM, ids: Sequence[int], start: int, logprobs: Sequence[float]
) -> float:
    """The largest |sampled - re-scored| logprob over the generated tokens ``ids[start:]``."""
    check(len(logprobs) == len(ids) - start, f"{len(logprobs)} logprobs, {len(ids) - start} ids")
    scores = vllm.rescore(ids)[start:]
    gap = 0.0
    for sampled, rescored in zip(logprobs, scores, strict=True):
        if rescored is None or not math.isfinite(sampled):
            raise CheckFailed(f"a logprob that is not a number: {sampled} / {rescored}")
        gap = max(gap, abs(sampled - rescored))
    return gap


async def check_response(vllm: VLLM, response: tr.InferenceResponse, tokens: int | None) -> float:
    """Ids, logprobs and usage agree; ``tokens`` generated if given. Returns the
    response's worst logprob gap against a re-score."""
    ids, start, logprobs = response.token_ids, response.prompt_length, response.logprobs
    if ids is None or start is None or logprobs is None:
        raise CheckFailed(f"a response without token ids or logprobs: {response}")
    generated = len(ids) - start
    usage = response.usage or {}
    check(generated == usage.get("completion_tokens"), f"{generated} ids, usage {usage}")
    check(tokens is None or generated == tokens, f"{generated} tokens generated, not {tokens}")
    gap: float = await in_thread(worst_logprob_gap, vllm, ids, start, logprobs)
    check(gap <= LOGPROB_TOLERANCE, f"a logprob differs from its re-score by {gap:.3g}")
    return gap


async def check_tokens(vllm: VLLM) -> str:
    gaps: list[float] = []
    for endpoint in ("chat", "completions"):
        interface = tr.OpenAIInference(vllm.base_url, vllm.model, endpoint=endpoint)
        responses: list[tr.InferenceResponse] = []

        async def one(
            prompt: str,
            interface: tr.OpenAIInference = interface,
            responses: list[tr.InferenceResponse] = responses,
        ) -> None:
            request = interface.prepare_request(prompt, tr.GenerationArgs(max_tokens=24))
            responses.append(await interface.agenerate(request))

        async with trio.open_nursery() as nursery:
            for row in PROBLEMS:
                nursery.start_soon(one, str(row["prompt"]))
        for response in responses:
            gaps.append(await check_response(vllm, response, None))
        await interface.aclose()
    return f"{len(gaps)} responses (chat and completions), worst logprob gap {max(gaps):.3g}"


async def check_token_in(vllm: VLLM) -> str:
    """``prompt_ids``: the server generates from exactly the ids sent (it echoes them),
    and the logprobs are the re-score's; an id prompt with a special token in the middle
    (which text would lose) too."""
    interface = tr.OpenAIInference(vllm.base_url, vllm.model)
    chat = await interface.agenerate(
        interface.prepare_request("Say something.", tr.GenerationArgs(max_tokens=8))
    )
    if chat.token_ids is None or chat.prompt_length is None:
        raise CheckFailed("a chat response without token ids")
    # The served template renders a prompt of user messages as render_plain_chat does.
    served = tr.HFRenderer.from_pretrained(vllm.model).decode(chat.token_ids[: chat.prompt_length])
    plain = tr.inference.render_plain_chat([tr.ChatMessage(role="user", content="Say something.")])
    check(served == plain, f"the served template rendered {served!r}, not {plain!r}")
    special = 258  # <|pad|> of the byte-level tokenizer, inside the context
    gaps = []
    for ids in (chat.token_ids, [*chat.token_ids[:5], special, *chat.token_ids[5:]]):
        request = tr.InferenceRequest(
            prompt=[], prompt_ids=list(ids), generation_args=tr.GenerationArgs(max_tokens=16)
        )
        response = await interface.agenerate(request)
        check(response.token_ids is not None, "no token ids for an id prompt")
        check((response.token_ids or [])[: len(ids)] == ids, "the echoed ids differ")
        gaps.append(await check_response(vllm, response, None))
    await interface.aclose()
    return f"2 id prompts (one with a special token inside): echoed, worst gap {max(gaps):.3g}"


async def long_calls(
    vllm: VLLM, interface: tr.OpenAIInference, mode: tr.WeightUpdateMode
) -> tuple[list[tr.InferenceResponse], dict[str, float]]:
    """Four ``LONG``-token calls, paused in ``mode`` once all four are running, held
    ``HOLD`` seconds, resumed. Returns the responses and what ``/metrics`` counted."""
    responses: list[tr.InferenceResponse] = []
    seen: dict[str, float] = {}
    prompt = f"{secrets.token_hex(4)} Tell me a long story."

    async def one() -> None:
        request = interface.prepare_request(prompt, tr.GenerationArgs(max_tokens=LONG))
        responses.append(await interface.agenerate(request))

    attempts = sum(interface.statistics().attempts)
    preempted: float = await in_thread(vllm.metric, "vllm:num_preemptions_total")
    generated: float = await in_thread(vllm.metric, "vllm:generation_tokens_total")
    aborted: float = await in_thread(vllm.metric, "vllm:request_success_total", '"abort"')
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(one)
        # Poll the server until all four are decoding: nothing client-side says so. (Its
        # num_requests_running gauge lagged on a fresh server; the counter does not.)
        while (
            decoded := await in_thread(vllm.metric, "vllm:generation_tokens_total") - generated
        ) < 4 * 16:
            if responses:
                msg = f"{mode}: a call ended before the pause ({decoded:.0f} tokens generated)"
                raise CheckFailed(msg)
            await trio.sleep(0.05)
        await interface.pause(mode)
        check(await in_thread(vllm.is_paused), f"{mode}: /is_paused is false after pause()")
        before = await in_thread(vllm.metric, "vllm:generation_tokens_total")
        await trio.sleep(HOLD)
        seen["generated while paused"] = (
            await in_thread(vllm.metric, "vllm:generation_tokens_total") - before
        )
        await interface.resume(1)
    check(not await in_thread(vllm.is_paused), f"{mode}: the server is still paused")
    seen["preempted"] = await in_thread(vllm.metric, "vllm:num_preemptions_total") - preempted
    seen["aborted"] = (
        await in_thread(vllm.metric, "vllm:request_success_total", '"abort"') - aborted
    )
    # Requests sent: an aborted call is sent again (its continuation).
    seen["requests"] = sum(interface.statistics().attempts) - attempts
    check(seen["generated while paused"] == 0, f"{mode}: tokens generated while paused: {seen}")
    return responses, seen


async def check_keep(vllm: VLLM) -> str:
    interface = tr.OpenAIInference(
        vllm.base_url, vllm.model, server="vllm", extra_body={"ignore_eos": True}
    )
    responses, seen = await long_calls(vllm, interface, "keep")
    check(seen["preempted"] == 0, f"keep preempted {seen['preempted']} requests")
    check(seen["requests"] == 4, f"keep: {seen['requests']} requests for 4 calls")
    gaps = [await check_response(vllm, response, LONG) for response in responses]
    await interface.aclose()
    return (
        f"4 calls held {HOLD:.0f} s: 0 tokens generated, 0 preempted, {LONG} tokens each, "
        f"worst logprob gap {max(gaps):.3g}"
    )


@contextlib.contextmanager
def group_started_under(epoch: int) -> Any:
    """What the pipeline sets before a group's call: the epoch the group started under."""
    token = call_context.set(CallContext(start_epoch=epoch))
    try:
        yield
    finally:
        call_context.reset(token)


async def salted_hits(vllm: VLLM, cache_salt: Any, epoch: int) -> dict[str, float]:
    """A prompt sent by a group started under ``epoch``; a sibling of that group; a
    ``keep`` update with a real weight reload (``collective_rpc reload_weights``, as
    ``examples/vllm/grpo.py`` pushes weights) to ``epoch + 1``; then the same prompt from
    the old group (a later turn) and from a new group. The prompt tokens each read from
    the prefix cache, by the server's ``prefix_cache_hits_total``."""
    interface = tr.OpenAIInference(vllm.base_url, vllm.model, server="vllm", cache_salt=cache_salt)
    await interface.resume(epoch)
    prompt = " ".join(secrets.token_hex(2) for _ in range(60))
    request = interface.prepare_request(prompt, tr.GenerationArgs(max_tokens=1))
    hits: dict[str, float] = {}

    async def send(name: str, started: int) -> None:
        before = await in_thread(vllm.metric, "vllm:prefix_cache_hits_total")
        with group_started_under(started):
            response = await interface.agenerate(request)
        hits[name] = await in_thread(vllm.metric, "vllm:prefix_cache_hits_total") - before
        hits["prompt"] = float((response.usage or {}).get("prompt_tokens", 0))

    await send("first", epoch)
    await send("sibling", epoch)
    await interface.pause("keep")
    await in_thread(
        vllm.post,
        "/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": vllm.model}},
    )
    await interface.resume(epoch + 1)
    await send("later turn", epoch)
    await send("new group", epoch + 1)
    await interface.aclose()
    return hits


async def check_salted_cache(vllm: VLLM) -> str:
    salted = await salted_hits(vllm, "epoch", 10)
    unsalted = await salted_hits(vllm, "off", 20)
    prompt = salted["prompt"]
    # Whole KV blocks are cached (128 tokens on this CPU build): at least half here.
    for hits in (salted, unsalted):
        check(hits["first"] == 0, f"a new prompt was read from the cache: {hits}")
        check(hits["sibling"] >= prompt / 2, f"siblings do not share their prefix: {hits}")
    # Within a group the salt costs nothing: the same hits as without it (within 2%).
    check(
        abs(salted["sibling"] - unsalted["sibling"]) <= 0.02 * unsalted["sibling"],
        f"the salt changed a group's own hits: {salted} against {unsalted}",
    )
    check(
        salted["later turn"] >= prompt / 2,
        f"a group's later turn lost its prefix across the update: {salted}",
    )
    check(
        unsalted["new group"] >= prompt / 2,
        f"without the salt a new group should read the old weights' KV: {unsalted}",
    )
    check(
        salted["new group"] == 0,
        f"a group started after the update read KV of the old weights: {salted}",
    )
    return (
        f"after a keep update with reload_weights, a new group's {prompt:.0f}-token "
        f"prompt read {unsalted['new group']:.0f} tokens of the old weights' KV with "
        f"cache_salt='off' and {salted['new group']:.0f} with the default; the group's "
        f"own hits: sibling {salted['sibling']:.0f} (off: {unsalted['sibling']:.0f}), "
        f"later turn {salted['later turn']:.0f}"
    )


async def check_abort(vllm: VLLM) -> str:
    interface = tr.OpenAIInference(
        vllm.base_url, vllm.model, server="vllm", extra_body={"ignore_eos": True}
    )
    # vLLM 0.32 (CPU) does not always abort every request in flight at a
    # /pause?mode=abort: in repeated runs it aborted 4, 3 or none of the 4 calls, the
    # others held as by keep (with cache_salt "epoch" and "off" alike). A call it did
    # not abort is one request; one it aborted is continued (two). The scenario is
    # repeated (at most 3 times) until the server aborted at least one call.
    tries = []
    for _ in range(3):
        responses, seen = await long_calls(vllm, interface, "abort")
        continued = seen["requests"] - 4
        tries.append(continued)
        # vLLM's abort counter (request_success_total, finished_reason="abort") is not
        # always updated for requests aborted by a pause: the client's count is the proof.
        check(0 <= continued <= 4, f"abort: {seen['requests']} requests for 4 calls")
        gaps = [await check_response(vllm, response, LONG) for response in responses]
        if continued:
            break
    check(tries[-1] > 0, f"abort: the server aborted no call in {len(tries)} tries")
    await interface.aclose()
    return (
        f"{tries[-1]:.0f} of 4 calls aborted (aborted per try: {tries}; "
        f"{seen['aborted']:.0f} counted by the server) and continued from their token "
        f"ids: {LONG} tokens each, 0 generated while paused, worst logprob gap "
        f"{max(gaps):.3g}"
    )


class HasAnswer(tr.RewardOnlyAgent):
    async def get_reward(self, problem: tr.Problem, response: tr.InferenceResponse) -> float:
        return float(str(problem.answer) in response.response.content)


def stream_request(vllm: VLLM) -> tuple[HasAnswer, tr.GroupedRolloutRequest]:
    source = tr.PromptSource([tr.Problem(**row) for row in PROBLEMS], seed=0)
    agent = HasAnswer(prompts=source, env_id="arithmetic", parallel_generation_tasks=8)
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=tr.OpenAIInference(
            vllm.base_url, vllm.model, server="vllm", extra_body={"ignore_eos": True}
        ),
        generation_args=tr.GenerationArgs(max_tokens=96),
        streaming=True,
        max_staleness=1,
    )
    return agent, request


async def rescore_groups(vllm: VLLM, groups: list[tr.RolloutGroup]) -> float:
    worst = 0.0
    for group in groups:
        for rollout in group:
            if not isinstance(rollout, tr.TokenRollout) or not rollout.logprobs:
                raise CheckFailed(f"a rollout without tokens or logprobs: {rollout!r:.200}")
            ids, mask = rollout.trajectory[0], (rollout.generation_mask or [[]])[0]
            start = mask.count(False)
            gap = await in_thread(worst_logprob_gap, vllm, ids, start, rollout.logprobs[0])
            check(gap <= LOGPROB_TOLERANCE, f"a rollout's logprob is {gap:.3g} off its re-score")
            worst = max(worst, gap)
    return worst


async def check_stream(vllm: VLLM) -> str:
    agent, request = stream_request(vllm)
    taken: list[tr.RolloutGroup] = []
    paused_tokens: list[float] = []
    async with agent.get_grouped_rollouts(request) as stream:
        for mode in ("drain", "restart", "keep", "abort"):
            taken += [await stream.receive(), await stream.receive()]
            preempted = await in_thread(vllm.metric, "vllm:num_preemptions_total")
            async with stream.weight_update(mode) as update:
                paused = await in_thread(vllm.is_paused)
                check(paused == (mode in ("keep", "abort")), f"{mode}: /is_paused is {paused}")
                before = await in_thread(vllm.metric, "vllm:generation_tokens_total")
                await trio.sleep(HOLD / 2)
                after = await in_thread(vllm.metric, "vllm:generation_tokens_total")
                paused_tokens.append(after - before)
                check(after == before, f"{mode}: {after - before} tokens generated in the body")
            check(not await in_thread(vllm.is_paused), f"{mode}: still paused after the block")
            check(stream.policy_epoch == update.epoch, f"{mode}: the epoch did not move")
            if mode == "keep":
                moved = await in_thread(vllm.metric, "vllm:num_preemptions_total") - preempted
                check(moved == 0, f"keep preempted {moved} requests")
            taken.append(await stream.receive())
            check(
                stream.policy_epoch - taken[-1].start_epoch <= 1,
                f"a group older than the bound: epoch {taken[-1].start_epoch}",
            )

        # Failure routes: a body that raises, a body that is cancelled.
        try:
            async with stream.weight_update("keep"):
                raise LookupError("the weight push failed")
        except LookupError:
            pass
        check(not await in_thread(vllm.is_paused), "paused after a body that raised")
        with trio.move_on_after(HOLD / 2) as scope:
            async with stream.weight_update("abort"):
                await trio.sleep_forever()
        check(scope.cancelled_caught, "the body was not cancelled")
        check(not await in_thread(vllm.is_paused), "paused after a cancelled body")
        taken.append(await stream.receive())
        stats = stream.statistics()
    check(not await in_thread(vllm.is_paused), "paused after the stream closed")
    check(stats.unaccounted == 0, f"the ledger does not add up: {stats}")
    worst = await rescore_groups(vllm, taken)
    return (
        f"drain, restart, keep, abort, a raising and a cancelled body: {len(taken)} groups, "
        f"epoch {stats.policy_epoch}, {stats.restarted} restarted, {stats.stale} stale, "
        f"{stats.mixed} mixed; 0 tokens in every body; worst logprob gap {worst:.3g}"
    )


#: Assistant turns of an episode in the episodes check.
EPISODE_TURNS = 3


def check_turn_ends(rollout: tr.TokenRollout, close: list[int], stops: set[int]) -> None:
    """In each element, a turn the episode went on after ends with the end-of-turn id:
    sampled (mask 1), or appended after a cut turn (mask 0); then the bridge."""
    for ids, mask in zip(rollout.trajectory, rollout.generation_mask or [], strict=True):
        for i in range(len(ids) - 1):
            if mask[i] and not mask[i + 1]:  # the end of a turn, not of the element
                if ids[i] in stops:
                    continue
                check(
                    ids[i + 1 : i + 1 + len(close)] == close,
                    f"a cut turn is followed by {ids[i + 1 : i + 4]}, not the close {close}",
                )


async def stream_episodes(
    agent: tr.MultiTurnAgent, interface: tr.OpenAIInference, max_tokens: int
) -> tuple[list[tr.RolloutGroup], set[int]]:
    """Six groups of four episodes, with a ``keep`` weight update after the first; check
    that the ledger adds up. Returns the groups and the policy epochs of their turns."""
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=4,
        inference_interface=interface,
        generation_args=tr.GenerationArgs(max_tokens=max_tokens),
        streaming=True,
    )
    groups: list[tr.RolloutGroup] = []
    async with agent.get_grouped_rollouts(request) as stream:
        groups.append(await stream.receive())
        async with stream.weight_update("keep"):
            pass
        # Groups that started after the update: their turns carry epoch 1.
        groups += [await stream.receive() for _ in range(5)]
        stats = stream.statistics()
    check(stats.unaccounted == 0, f"the ledger does not add up: {stats}")
    epochs: set[int] = set()
    for group in groups:
        for rollout in group:
            for boundaries in rollout.policy_epoch:
                epochs.update(epoch for _, epoch in boundaries)
    check(epochs == {0, 1}, f"turns of epochs {sorted(epochs)}, not 0 and 1 (one keep update)")
    return groups, epochs


def exact_episode(rollout: object) -> tr.TokenRollout:
    """The rollout, checked to be an exact episode with logprobs."""
    if not isinstance(rollout, tr.TokenRollout) or rollout.logprobs is None:
        raise CheckFailed(f"an episode without logprobs: {rollout!r:.200}")
    check(rollout.fidelity == "exact", f"fidelity {rollout.fidelity}")
    return rollout


async def episode_logprob_gap(vllm: VLLM, rollout: tr.TokenRollout) -> float:
    """The largest gap between a sampled id's logprob and vLLM's re-score of its element."""
    worst = 0.0
    for ids, mask, logprobs in zip(
        rollout.trajectory, rollout.generation_mask or [], rollout.logprobs or [], strict=True
    ):
        scores = await in_thread(vllm.rescore, ids)
        sampled = [score for score, m in zip(scores, mask, strict=True) if m]
        check(len(sampled) == len(logprobs), "logprobs and mask disagree")
        for mine, theirs in zip(logprobs, sampled, strict=True):
            check(theirs is not None, "a sampled id at position 0")
            worst = max(worst, abs(mine - (theirs or 0.0)))
    return worst


async def check_episodes(vllm: VLLM) -> str:
    renderer = tr.HFRenderer.from_pretrained(vllm.model)
    eos = renderer.tokenizer.eos_token_id
    check(renderer.close_ids == [eos], f"close_ids {renderer.close_ids}, not [<|eos|>]")
    agent = tr.MultiTurnAgent(
        environment=functools.partial(ToolReplies, turns=EPISODE_TURNS),
        renderer=renderer,
        prompts=tr.PromptSource([tr.Problem(**row) for row in PROBLEMS], seed=0),
        max_turns=EPISODE_TURNS,
        parallel_generation_tasks=4,
    )
    ToolReplies.made = ToolReplies.closed = 0
    interface = tr.OpenAIInference(vllm.base_url, vllm.model, server="vllm")
    groups, epochs = await stream_episodes(agent, interface, 6)
    made, closed = ToolReplies.made, ToolReplies.closed
    check(closed == made, f"{closed} environments closed of {made} made")
    worst = 0.0
    totals = dict.fromkeys(("turns", "breaks", "truncated_turns"), 0)
    for group in groups:
        for rollout in map(exact_episode, group):
            worst = max(worst, await episode_logprob_gap(vllm, rollout))
            check_turn_ends(rollout, renderer.close_ids, set(renderer.stop_token_ids))
            for name in totals:
                totals[name] += rollout.extra["episode"][name]
    check(worst <= LOGPROB_TOLERANCE, f"a sampled id's logprob is {worst:.3g} off its re-score")
    return (
        f"{sum(len(g) for g in groups)} episodes, {totals['turns']} turns, all exact; "
        f"{totals['truncated_turns']} cut turns closed with <|eos|>, {totals['breaks']} "
        f"splits (turns the tiny model ended on a stop byte), epochs {sorted(epochs)}; "
        f"{ToolReplies.closed} environments closed; worst logprob gap {worst:.3g}"
    )


#: A real published chat template: Qwen2.5's ChatML, with the tools in its system block.
QWEN_TEMPLATE = Path(__file__).parents[2] / "tests" / "data" / "chat_templates" / "qwen2.5.jinja"
#: The one tool the episodes-qwen2.5 environment declares.
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "such as 2 + 3"}},
            "required": ["expression"],
        },
    },
}
#: max_tokens of a turn in episodes-qwen2.5: most turns are cut (then closed with
#: <|im_end|>, mask 0).
QWEN_MAX_TOKENS = 6


def calculator_reply(number: int, turn: tr.AssistantTurn) -> tr.ChatMessage:
    """The environment's answer to turn ``number``: a ``"tool"`` result for its first call
    (the id the assistant message declared), or a user message when it made none."""
    if turn.tool_calls:
        call = turn.tool_calls[0].id
        return tr.ChatMessage(role="tool", content=f"result {number}", extra={"tool_call_id": call})
    return tr.ChatMessage(role="user", content=f"Use the calculator ({number}).")


class CalculatorReplies(ToolReplies):
    """Declares the calculator tool and answers each turn with :func:`calculator_reply`;
    done after ``turns`` turns. Counts its own environments."""

    tools: ClassVar[list[dict[str, Any]] | None] = [CALCULATOR]
    made = 0
    closed = 0

    def reply(self, turn: tr.AssistantTurn) -> tr.ChatMessage:
        return calculator_reply(self.steps, turn)


class RecordingInference(tr.OpenAIInference):
    """``OpenAIInference`` that notes each answered call (each choice of a group call):
    the prompt ids it sent and the ids the server returned (prompt and sampled)."""

    calls: ClassVar[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []

    async def agenerate(self, request: tr.InferenceRequest) -> tr.InferenceResponse:
        response = await super().agenerate(request)
        sent, got = tuple(request.prompt_ids or ()), tuple(response.token_ids or ())
        RecordingInference.calls.append((sent, got))
        return response

    async def agenerate_group(
        self, request: tr.InferenceRequest, n: int
    ) -> list[tr.InferenceResponse]:
        # The episodes' first turns come as one group call (n choices).
        responses = await super().agenerate_group(request, n)
        sent = tuple(request.prompt_ids or ())
        RecordingInference.calls.extend((sent, tuple(r.token_ids or ())) for r in responses)
        return responses


def template_message(message: tr.ChatMessage) -> dict[str, Any]:
    """A message as the template reads it (written here, not the library's conversion):
    a call's arguments as the object they hold."""
    data: dict[str, Any] = {**message.extra, "role": message.role, "content": message.content}
    calls = []
    for call in data.get("tool_calls", []):
        function = dict(call["function"])
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(function["arguments"])
        calls.append({**call, "function": function})
    if calls:
        data["tool_calls"] = calls
    return data


def numbered(turn: tr.AssistantTurn, number: int) -> tr.AssistantTurn:
    """Call ids a parser made up (``call_<index>``) as the episode numbers them
    (``call_<turn>_<index>``)."""
    calls = tuple(
        attrs.evolve(call, id=f"call_{number}_{index}") if call.id == f"call_{index}" else call
        for index, call in enumerate(turn.tool_calls)
    )
    return attrs.evolve(turn, tool_calls=calls)


def sampled_runs(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each stretch of sampled ids: one turn each."""
    runs: list[tuple[int, int]] = []
    for i, sampled in enumerate(mask):
        if sampled and (i == 0 or not mask[i - 1]):
            runs.append((i, i + 1))
        elif sampled:
            runs[-1] = (runs[-1][0], i + 1)
    return runs


@attrs.define
class QwenTally:
    """What check_episodes_qwen counts over all episodes."""

    turns: int = 0
    bridged: int = 0  # turns whose prompt was a bridge (not a first or full render)
    bridged_same_ids: int = 0  # ... whose prefix also re-encodes to the same ids
    cut: int = 0  # cut by max_tokens, <|im_end|> appended with mask 0
    closed_sampled: int = 0  # ended on a sampled <|im_end|>
    stop_byte: int = 0  # ended on one of the engine's stop bytes, bridged
    splits: int = 0
    split_eos: int = 0  # ... after a turn ended on <|eos|>
    tool_calls: int = 0


def check_qwen_episode(
    rollout: tr.TokenRollout,
    tokenizer: Any,
    renderer: tr.HFRenderer,
    engine_stops: set[int],
    tally: QwenTally,
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rebuild the episode's structured conversation from its sampled ids and check each
    element against the template's render; returns each turn's (prompt ids, ids through
    the turn), the request it must have made."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = tokenizer.eos_token_id

    def decode(ids: Sequence[int]) -> str:
        text: str = tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return text

    def template(conversation: list[tr.ChatMessage]) -> str:
        text: str = tokenizer.apply_chat_template(
            [template_message(message) for message in conversation],
            tools=[CALCULATOR],
            add_generation_prompt=True,
            tokenize=False,
        )
        return text

    prompts = {row["problem_id"]: row["prompt"] for row in PROBLEMS}
    conversation = [tr.ChatMessage(role="user", content=prompts[rollout.problem_id])]
    elements = list(zip(rollout.trajectory, rollout.generation_mask or [], strict=True))
    turns = [(e, run) for e, (_, mask) in enumerate(elements) for run in sampled_runs(mask)]
    episode = rollout.extra["episode"]
    check(len(turns) == episode["turns"], f"{len(turns)} sampled runs, {episode['turns']} turns")
    check(len(elements) == episode["breaks"] + 1, f"{len(elements)} elements, {episode}")
    requests = []
    cut_turns = 0
    lossy = False  # a turn of the element so far whose ids its text does not give back
    for number, (e, (start, end)) in enumerate(turns, 1):
        ids, mask = elements[e]
        if number > 1 and turns[number - 2][0] != e:
            lossy = False
        requests.append((tuple(ids[:start]), tuple(ids[:end])))
        # The element up to the generation prompt: the template's render of the
        # structured conversation so far (in text; in ids too unless it was bridged
        # after bytes that are not UTF-8, which text cannot carry).
        expected = template(conversation)
        check(decode(ids[:start]) == expected, f"turn {number}: the prompt is not the render")
        same_ids = list(ids[:start]) == tokenizer.encode(expected, add_special_tokens=False)
        if number > 1 and turns[number - 2][0] == e:
            tally.bridged += 1
            tally.bridged_same_ids += same_ids
            check(same_ids or lossy, f"turn {number}: the prompt is not the template's ids")
        else:
            check(same_ids, f"turn {number}: a first or full render is not the template's ids")
        sampled = list(ids[start:end])
        lossy |= tokenizer.encode(decode(sampled), add_special_tokens=False) != sampled
        turn = numbered(renderer.parse(sampled), number)
        tally.turns += 1
        tally.tool_calls += len(turn.tool_calls)
        conversation.append(turn.to_message())
        if number == len(turns):
            check(end == len(ids), "the last turn does not end its element")
            break
        conversation.append(calculator_reply(number, turn))
        last = sampled[-1]
        cut = len(sampled) == QWEN_MAX_TOKENS and last not in engine_stops
        cut_turns += cut
        if turns[number][0] == e:  # bridged: the turn ends with <|im_end|>
            check(not mask[end], "two turns without a bridge between them")
            if last == im_end:
                tally.closed_sampled += 1
            else:
                # Appended (mask 0): the close after a cut, or the bridge's first id after
                # a turn the engine stopped on a byte (the renderer's stops are <|im_end|>
                # and <|eos|> only: the byte is content, the template closes the message).
                check(ids[end] == im_end, f"turn {number} is followed by {ids[end : end + 3]}")
                check(cut or last in engine_stops - {eos}, f"turn {number} ended on {last}")
                tally.cut += cut
                tally.stop_byte += not cut
            continue
        # A split: the turn's text (closed if it was cut) is not what the template writes.
        tally.splits += 1
        check(end == len(ids), f"turn {number} is followed by ids in its element")
        closed = decode([*sampled, *([im_end] if cut else [])])
        head = decode(ids[:start])
        check(not template(conversation).startswith(head + closed), f"turn {number}: no break")
        text = decode([token for token in sampled if token not in (im_end, eos)])
        if last != eos:  # the only rewrite: the template writes <|im_end|>, not <|eos|>
            raise CheckFailed(f"turn {number}: a break not explained: {sampled} {text!r}")
        tally.split_eos += 1
    check(cut_turns == episode["truncated_turns"], f"{cut_turns} cut turns, {episode}")
    return requests


async def check_episodes_qwen(vllm: VLLM) -> str:
    """``MultiTurnAgent`` with Qwen2.5's real template on the served tokenizer, token-in."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(vllm.model)
    tokenizer.chat_template = QWEN_TEMPLATE.read_text(encoding="utf-8")
    renderer = tr.HFRenderer(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    check(renderer.close_ids == [im_end], f"close_ids {renderer.close_ids}, not [<|im_end|>]")
    family = renderer.family
    check(family is not None and family.tool_parser == "hermes", f"family {family}")
    engine_stops = set(transformers.GenerationConfig.from_pretrained(vllm.model).eos_token_id)
    check(im_end in engine_stops, "the served model does not stop on <|im_end|>")
    agent = tr.MultiTurnAgent(
        environment=functools.partial(CalculatorReplies, turns=EPISODE_TURNS),
        renderer=renderer,
        prompts=tr.PromptSource([tr.Problem(**row) for row in PROBLEMS], seed=0),
        max_turns=EPISODE_TURNS,
        parallel_generation_tasks=4,
        on_break="split",
    )
    CalculatorReplies.made = CalculatorReplies.closed = 0
    RecordingInference.calls = []
    interface = RecordingInference(vllm.base_url, vllm.model, server="vllm")
    groups, epochs = await stream_episodes(agent, interface, QWEN_MAX_TOKENS)
    made, closed = CalculatorReplies.made, CalculatorReplies.closed
    check(closed == made, f"{closed} environments closed of {made} made")
    tally = QwenTally()
    worst = 0.0
    expected: Counter[tuple[tuple[int, ...], tuple[int, ...]]] = Counter()
    breaks = 0
    for group in groups:
        for rollout in map(exact_episode, group):
            worst = max(worst, await episode_logprob_gap(vllm, rollout))
            breaks += rollout.extra["episode"]["breaks"]
            expected.update(check_qwen_episode(rollout, tokenizer, renderer, engine_stops, tally))
    check(worst <= LOGPROB_TOLERANCE, f"a sampled id's logprob is {worst:.3g} off its re-score")
    check(breaks == tally.splits, f"{breaks} breaks counted, {tally.splits} splits seen")
    # Every turn was one request, which sent exactly the element's ids before the turn
    # and got them back followed by the turn's ids (calls of episodes cancelled when the
    # stream closed are recorded too: they are not in any group).
    missing = expected - Counter(RecordingInference.calls)
    check(not missing, f"{sum(missing.values())} turns without their request")
    return (
        f"{sum(len(g) for g in groups)} episodes, {tally.turns} turns, all exact, each "
        f"request the element so far; {tally.bridged} bridged turns, each prompt the "
        f"template's render of the conversation ({tally.bridged_same_ids} also in ids, the "
        f"others after bytes that are not UTF-8); {tally.cut} cut turns closed with "
        f"<|im_end|>, {tally.stop_byte} ended on a stop byte (the bridge writes <|im_end|>), "
        f"{tally.closed_sampled} on a sampled <|im_end|>; {tally.splits} breaks, each after "
        f"a turn ended on <|eos|> ({tally.split_eos}); {tally.tool_calls} tool calls; epochs "
        f"{sorted(epochs)}; {closed} environments closed; worst logprob gap {worst:.3g}"
    )


async def run_library_checks(vllm: VLLM) -> None:
    for name, run_check in (
        ("tokens", check_tokens),
        ("token-in", check_token_in),
        ("keep", check_keep),
        ("abort", check_abort),
        ("stream", check_stream),
        ("episodes", check_episodes),
        ("episodes-qwen2.5", check_episodes_qwen),
        # Last: it reloads the weights (the same ones) while the server is paused.
        ("salted-cache", check_salted_cache),
    ):
        with trio.fail_after(CHECK_TIMEOUT):
            print(f"{name}: {await run_check(vllm)}", flush=True)
    check(not await in_thread(vllm.is_paused), "the server is left paused")
