"""The CLI and the library against a real OpenAI-compatible server, with default flags.

``nox -s real-server`` runs this (``nox -R -s real-server`` reuses the install). It:

1. builds a tiny random Llama offline (``build_tiny_llama.py``) in a temporary folder;
2. serves it with ``transformers serve`` on 127.0.0.1 (a free port) and waits, at most
   ``READY_TIMEOUT`` seconds, until it answers ``GET /health``;
3. runs ``trio-rollouts generate`` and ``trio-rollouts eval`` on a small prompt file with
   no flag beyond the required ones, and checks their outputs: whole lines, the expected
   counts, and that ``load_jsonl`` / ``structure`` read them back;
4. runs the library as a trainer would: ``OpenAIInference(base_url, model)`` under a
   ``RewardOnlyAgent``, through ``get_grouped_rollouts`` and through the sync bridge;
   and checks that an explicit ``return_token_ids=True`` is refused with an error that
   names the field (the server returns text only);
5. always stops the server (SIGTERM, then SIGKILL after ``STOP_TIMEOUT`` seconds).

The model's weights are random, so its answers are noise: the check is that every
request works and every output is complete, not that a reward is earned. Every wait is
bounded, and the only address used is the loopback one.

    python tools/real_server/run.py [--keep DIR]    # --keep: work in DIR and leave it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import trio

import trio_rollouts as tr

sys.path.insert(0, str(Path(__file__).parent))
from build_tiny_llama import build

HOST = "127.0.0.1"
#: Seconds for the server to load the model and answer /health.
READY_TIMEOUT = 180.0
#: Seconds for one CLI command; the library checks have the same bound.
STEP_TIMEOUT = 300.0
#: Seconds between SIGTERM and SIGKILL when stopping the server.
STOP_TIMEOUT = 15.0
GROUP_SIZE = 2

PROBLEMS = [
    {"problem_id": "add-1", "prompt": "What is 2 + 3?", "answer": "5"},
    {"problem_id": "add-2", "prompt": "What is 7 + 8?", "answer": "15"},
    {"problem_id": "mul-1", "prompt": "What is 6 * 7?", "answer": "42"},
    {"problem_id": "sub-1", "prompt": "What is 10 - 4?", "answer": "6"},
]

#: Keeps the tiny model offline, quiet, and away from any hub.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


class CheckFailed(Exception):
    """An output is not what the default flags should produce."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


# ------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as reply:  # loopback only
        return json.load(reply)


@contextlib.contextmanager
def serving(model_dir: Path, log_path: Path) -> Iterator[str]:
    """Run ``transformers serve`` for the block; yield its base URL (``/v1`` included)."""
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        str(model_dir),  # preloaded, and the name requests use
        "--host",
        HOST,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--default-seed",
        "0",
    ]
    print("$", " ".join(command), flush=True)
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}
        )
    try:
        wait_until_ready(server, f"http://{HOST}:{port}", log_path)
        yield f"http://{HOST}:{port}/v1"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print(f"server stopped (exit code {server.returncode})", flush=True)


def wait_until_ready(server: subprocess.Popen[bytes], root: str, log_path: Path) -> None:
    """Poll ``/health`` until it answers, the server exits, or READY_TIMEOUT passes.
    (Polling is all a process that is still starting offers.)"""
    started = time.monotonic()
    while time.monotonic() - started < READY_TIMEOUT:
        if server.poll() is not None:
            msg = f"the server exited with {server.returncode} while starting:\n{tail(log_path)}"
            raise CheckFailed(msg)
        with contextlib.suppress(OSError):
            if get_json(f"{root}/health") == {"status": "ok"}:
                print(f"server ready after {time.monotonic() - started:.1f} s", flush=True)
                return
        time.sleep(0.5)
    msg = f"the server did not answer {root}/health within {READY_TIMEOUT} s:\n{tail(log_path)}"
    raise CheckFailed(msg)


def served_model(base_url: str) -> str:
    """The model id the server expects in requests (for a local folder: its path)."""
    listing = get_json(f"{base_url}/models")
    if not (isinstance(listing, dict) and listing.get("data")):
        msg = f"GET {base_url}/models gave {listing!r:.200}"
        raise CheckFailed(msg)
    model: str = listing["data"][0]["id"]
    return model


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ------------------------------------------------------------------------- the CLI


def run_cli(*args: str) -> float:
    """Run ``trio-rollouts ARGS``; fail on a non-zero exit. Returns the seconds it took."""
    command = [str(Path(sys.executable).with_name("trio-rollouts")), *args]
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    done = subprocess.run(command, timeout=STEP_TIMEOUT, check=False, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    check(done.returncode == 0, f"trio-rollouts {args[0]} exited with {done.returncode}")
    return seconds


def check_generate_output(out: Path) -> None:
    text = out.read_text(encoding="utf-8")
    check(text.endswith("\n"), f"{out} ends in a torn line")
    lines = text.splitlines()
    check(len(lines) == len(PROBLEMS), f"{out} has {len(lines)} lines, not {len(PROBLEMS)}")
    for number, line in enumerate(lines, 1):
        check(isinstance(json.loads(line), dict), f"{out}:{number} is not a JSON object")
    with out.open(encoding="utf-8") as file:
        groups = list(tr.load_jsonl(file, tr.RolloutGroup))
    ids = sorted(group[0].problem_id or "" for group in groups)
    check(ids == sorted(p["problem_id"] for p in PROBLEMS), f"problem ids {ids}")
    for group in groups:
        check(len(group) == GROUP_SIZE, f"a group of {len(group)} rollouts, not {GROUP_SIZE}")
        group.rewards()  # every reward is a finite number
    print(f"generate: {len(groups)} groups x {GROUP_SIZE} rollouts; load_jsonl reads them")


def check_eval_output(out: Path) -> None:
    data = json.loads(out.read_text(encoding="utf-8"))
    response = tr.structure(data["response"], tr.EvaluationResponse)
    check(
        len(response.results) == len(PROBLEMS),
        f"eval has {len(response.results)} results, not {len(PROBLEMS)}",
    )
    print(f"eval: {len(response.results)} results; metrics {data.get('metrics')}")


def run_cli_checks(
    base_url: str, model: str, prompts: Path, work: Path, timings: dict[str, float]
) -> Path:
    """``generate`` and ``eval`` with default flags, their outputs checked; returns the
    ``generate`` output."""
    server = ["--base-url", base_url, "--model", model, "--prompts", str(prompts)]
    step("trio-rollouts generate (default flags)")
    generated = work / "generate.jsonl"
    group_size = ["--group-size", str(GROUP_SIZE)]
    timings["generate"] = run_cli("generate", *server, *group_size, "--out", str(generated))
    check_generate_output(generated)

    step("trio-rollouts eval (default flags)")
    evaluated = work / "eval.json"
    timings["eval"] = run_cli("eval", *server, "--out", str(evaluated))
    check_eval_output(evaluated)
    return generated


# ------------------------------------------------------------------------- the library


@attrs.define(kw_only=True)
class ArithmeticAgent(tr.RewardOnlyAgent):
    """Asks the problems in turn; the last number of a completion is its answer."""

    problems: list[tr.Problem]
    asked: int = 0

    async def get_prompt(self, request: tr.GroupedRolloutRequest) -> tr.Problem:
        problem = self.problems[self.asked % len(self.problems)]
        self.asked += 1
        return problem

    async def get_reward(self, problem: tr.Problem, response: tr.InferenceResponse) -> float:
        numbers = re.findall(r"-?\d+", response.response.content)
        return 1.0 if numbers and numbers[-1] == problem.answer else 0.0


def library_request(base_url: str, model: str) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=GROUP_SIZE,
        inference_interface=tr.OpenAIInference(base_url, model),
        generation_args=tr.GenerationArgs(max_tokens=16),
        streaming=True,
    )


def new_agent() -> ArithmeticAgent:
    problems = [tr.Problem(**row) for row in PROBLEMS]
    return ArithmeticAgent(problems=problems, env_id="arithmetic", parallel_generation_tasks=4)


async def stream_groups(base_url: str, model: str, n: int) -> list[tr.RolloutGroup]:
    """The Trio path, with the transport owned by the caller's ``async with``: it is
    closed (no connection left) when the block ends."""
    groups: list[tr.RolloutGroup] = []
    request = library_request(base_url, model)
    interface = request.inference_interface
    check(isinstance(interface, tr.OpenAIInference), "the request's interface is not HTTP")
    with trio.fail_after(STEP_TIMEOUT):
        async with interface:  # type: ignore[attr-defined]
            async with new_agent().get_grouped_rollouts(request) as stream:
                async for group in stream:
                    groups.append(group)
                    if len(groups) == n:
                        break
            used = interface.statistics()  # type: ignore[attr-defined]
    check(sum(used.attempts) > 0, "no request went through the caller's transport")
    check(not any(used.in_flight), f"requests in flight when the stream ended: {used}")
    print(f"caller-owned transport: {sum(used.attempts)} requests, closed with its block")
    return groups


def check_library(base_url: str, model: str, work: Path) -> None:
    groups = trio.run(stream_groups, base_url, model, 4)
    with tr.blocking_grouped_rollouts(new_agent(), library_request(base_url, model)) as stream:
        groups += stream.take(4, timeout=STEP_TIMEOUT)
    check(len(groups) == 8, f"the library got {len(groups)} groups, not 8")
    for group in groups:
        check(len(group) == GROUP_SIZE, f"a group of {len(group)} rollouts, not {GROUP_SIZE}")
        group.rewards()
    kinds = sorted({type(rollout).__name__ for group in groups for rollout in group})
    out = work / "library.jsonl"
    with out.open("w", encoding="utf-8") as file:
        tr.dump_jsonl(groups, file)
    with out.open(encoding="utf-8") as file:
        check(len(list(tr.load_jsonl(file, tr.RolloutGroup))) == 8, "dump/load lost groups")
    print(f"library: 4 groups streamed + 4 through the sync bridge, {kinds}; JSON round trip")


async def weight_updates(base_url: str, model: str) -> str:
    """drain and restart updates (all a plain server supports) with a staleness bound,
    the agent drawing from a PromptSource; keep is refused before anything pauses."""
    problems = [tr.Problem(**row) for row in PROBLEMS]
    source = tr.PromptSource(problems, seed=0)

    class Drawing(tr.RewardOnlyAgent):
        async def get_reward(self, problem: tr.Problem, response: tr.InferenceResponse) -> float:
            return float(str(problem.answer) in response.response.content)

    agent = Drawing(prompts=source, env_id="arithmetic", parallel_generation_tasks=4)
    request = library_request(base_url, model)
    request.max_staleness = 1
    taken: list[tr.RolloutGroup] = []
    with trio.fail_after(STEP_TIMEOUT):
        async with agent.get_grouped_rollouts(request) as stream:
            for mode in ("drain", "restart", "drain"):
                taken += [await stream.receive(), await stream.receive()]
                async with stream.weight_update(mode) as update:  # type: ignore[arg-type]
                    check(stream.statistics().in_flight == 0, f"{mode}: a call in flight")
                check(stream.policy_epoch == update.epoch, "the epoch did not move")
                taken.append(await stream.receive())
                check(
                    stream.policy_epoch - taken[-1].start_epoch <= 1,
                    f"a group older than the bound: {taken[-1].start_epoch}",
                )
            try:
                async with stream.weight_update("keep"):
                    check(False, "keep on a plain server must be refused")
            except TypeError as error:
                check("server='vllm'" in str(error), f"the error gives no hint: {error}")
            stats = stream.statistics()
    check(stats.unaccounted == 0, f"the ledger does not add up: {stats}")
    check(stats.weight_updates == 3, f"{stats.weight_updates} updates, not 3")
    state = source.state_dict()
    check(json.loads(json.dumps(state)) == state, "the PromptSource state is not plain data")
    # Every draw is done (its group taken) or pending (given back at close): the source
    # counts exactly the groups taken as done.
    drawn = state["epoch"] * len(problems) + state["position"]
    done = drawn - len(state["pending"])
    check(done == len(taken), f"{done} draws done, {len(taken)} groups taken")
    return (
        f"3 updates (drain, restart, drain), epoch {stats.policy_epoch}, "
        f"{stats.restarted} restarted, {stats.stale} stale; keep refused; "
        f"{done} draws done = groups taken, {len(state['pending'])} pending"
    )


def check_strict_token_ids(base_url: str, model: str) -> None:
    """``return_token_ids=True`` stays strict: a server that refuses the field is an
    error that names the field, not a silent downgrade."""
    interface = tr.OpenAIInference(base_url, model, return_token_ids=True, max_retries=0)
    prompt = interface.prepare_request("What is 2 + 3?", tr.GenerationArgs(max_tokens=4))
    try:
        response = interface.generate(prompt)
    except tr.InferenceError as error:
        check("return_token_ids" in str(error), f"the error does not name the field: {error}")
        print(f"strict return_token_ids=True: {type(error).__name__}: {error}")
        return
    check(response.token_ids is not None, "return_token_ids=True gave no token ids, no error")
    print("strict return_token_ids=True: this server returns token ids")


class ToolReplies(tr.BaseEnvironment):
    """Answers each turn with one message (:meth:`reply`: a ``"tool"`` result); done after
    ``turns`` turns. Counts the environments made and closed, per class (``nox -s vllm``'s
    episodes checks use it and a subclass)."""

    made = 0
    closed = 0

    def __init__(self, problem: tr.Problem, *, turns: int = 2) -> None:
        super().__init__()
        self.problem = problem
        self.turns = turns
        self.steps = 0
        type(self).made += 1

    async def reset(self) -> list[tr.ChatMessage]:
        await trio.lowlevel.checkpoint()
        return [tr.ChatMessage(role="user", content=str(self.problem.prompt))]

    async def step(self, turn: tr.AssistantTurn) -> tr.EnvironmentStep:
        await trio.lowlevel.checkpoint()
        self.steps += 1
        if self.steps == self.turns:
            return tr.EnvironmentStep(done=True, reward=1.0)
        return tr.EnvironmentStep(messages=[self.reply(turn)])

    def reply(self, turn: tr.AssistantTurn) -> tr.ChatMessage:
        return tr.ChatMessage(
            role="tool", content=f"result {self.steps}", extra={"tool_call_id": "call_0"}
        )

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
        type(self).closed += 1


async def episodes(base_url: str, model: str, model_dir: Path) -> str:
    """Multi-turn episodes against a server that renders chats only and returns text
    (``token_prompts=False``): refused at the default ``min_fidelity``, retokenized when
    allowed, each turn closed with the template's end-of-turn id and bridged with no
    break, every environment closed."""
    renderer = tr.HFRenderer.from_pretrained(model_dir)
    question = [tr.ChatMessage(role="user", content="What is 2 + 3?")]
    rendered = renderer.decode(renderer.render(question))
    plain = tr.inference.render_plain_chat(question)
    check(rendered == plain, f"the template renders {rendered!r}, not {plain!r}")
    interface = tr.OpenAIInference(base_url, model, token_prompts=False)
    request = tr.GroupedRolloutRequest(
        num_groups=2,
        rollouts_per_group=2,
        inference_interface=interface,
        generation_args=tr.GenerationArgs(max_tokens=8),
    )
    source = tr.PromptSource([tr.Problem(**row) for row in PROBLEMS], seed=0)

    def agent(**fields: Any) -> tr.MultiTurnAgent:
        return tr.MultiTurnAgent(
            environment=ToolReplies, renderer=renderer, prompts=source, max_turns=2, **fields
        )

    try:
        async with agent().get_grouped_rollouts(request) as stream:
            await stream.receive()
        check(False, "a text-only server must be below the default min_fidelity")
    except tr.TokenFidelityError as error:
        check("min_fidelity" in str(error), f"the error gives no fix: {error}")
    groups: list[tr.RolloutGroup] = []
    with trio.fail_after(STEP_TIMEOUT):
        async with agent(min_fidelity="retokenized").get_grouped_rollouts(request) as stream:
            groups += [await stream.receive(), await stream.receive()]
    close = renderer.close_ids
    breaks = 0
    for group in groups:
        for rollout in group:
            if not isinstance(rollout, tr.TokenRollout):
                raise CheckFailed(f"not a TokenRollout: {rollout!r:.80}")
            check(rollout.fidelity == "retokenized", f"fidelity {rollout.fidelity}")
            check(rollout.logprobs is None, "a retokenized rollout with logprobs")
            episode = rollout.extra["episode"]
            check(episode["turns"] == 2, f"{episode['turns']} turns, not 2")
            # A turn the random model ended on one of its stop bytes rather than the
            # template's <|eos|> re-renders otherwise (the template closes it with
            # <|eos|>): a counted break, and the only one there may be.
            stops = set(renderer.stop_token_ids) - set(close)
            turns = episode["per_turn"][:-1]  # the last turn is not bridged
            explained = sum(
                bool(ids) and ids[-1] in stops
                for ids in (rollout.trajectory[t["element"]][t["start"] : t["end"]] for t in turns)
            )
            check(
                episode["breaks"] == explained,
                f"{episode['breaks']} breaks, {explained} after a stop byte: the bridge failed",
            )
            breaks += episode["breaks"]
            for ids, mask in zip(rollout.trajectory, rollout.generation_mask or [], strict=True):
                ends = [i for i in range(len(ids) - 1) if mask[i] and not mask[i + 1]]
                for end in ends:
                    if ids[end] not in stops:
                        check(
                            ids[end + 1 : end + 1 + len(close)] == close, "a turn without its close"
                        )
    check(ToolReplies.closed == ToolReplies.made, "an environment was not closed")
    shown = renderer.decode(groups[0].rollouts[0].trajectory[0])  # type: ignore[union-attr]
    return (
        f"refused at min_fidelity='server_tokens'; {sum(len(g) for g in groups)} "
        f"retokenized episodes of 2 turns, {breaks} breaks (each after a turn the model "
        f"ended on a stop byte), {ToolReplies.closed} environments "
        f"closed; the first: {shown!r}"
    )


# ------------------------------------------------------------------------- main


def main(work: Path) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    step("build a tiny random Llama (offline)")
    model_dir = build(work / "tiny-llama")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROBLEMS), encoding="utf-8")
    timings["build"] = time.monotonic() - started

    step("start transformers serve")
    mark = time.monotonic()
    with serving(model_dir, work / "server.log") as base_url:
        timings["server start"] = time.monotonic() - mark
        model = served_model(base_url)
        run_cli_checks(base_url, model, prompts, work, timings)

        step("the library: OpenAIInference + RewardOnlyAgent, async and sync bridge")
        mark = time.monotonic()
        check_library(base_url, model, work)
        check_strict_token_ids(base_url, model)
        print("weight updates:", trio.run(weight_updates, base_url, model))
        print("episodes:", trio.run(episodes, base_url, model, model_dir))
        timings["library"] = time.monotonic() - mark

    timings["total"] = time.monotonic() - started
    step("passed")
    print(", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it there")
    options = parser.parse_args()
    folder = options.keep or Path(tempfile.mkdtemp(prefix="trio-rollouts-real-server-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        main(folder)
    except CheckFailed as failure:
        log = folder / "server.log"
        if log.exists():
            print(f"\n--- server log (last lines):\n{tail(log)}", file=sys.stderr)
        sys.exit(f"real-server check FAILED: {failure}")
    finally:
        if options.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
