"""The gateway's CPU per call, its HTTP server included and the agent's HTTP client
excluded, beside a direct call on the same backend: what the gateway itself costs.

Usage: python benchmarks/gateway.py [--sessions 1,64] [--duration 3] [--rounds 3]
                                    [--turns 8] [--keep-connections] [--profile]

The backend is ``EmbeddedInference`` with no latency (``LatencyModel(first_token=0,
per_token=0)``) and a policy giving the same 20-character answer to any prompt; the
renderer is ``PlainRenderer()``. For each session count N, a server process (this script,
re-run with ``--serve N``) opens ``trio_rollouts.gateway.serve(...)`` and N sessions,
prints their base URLs, and, whenever this process asks on its stdin, reports its CPU time
(``time.process_time``: user and system, every thread) and the calls its backend answered
(the backend is wrapped to count them). This process is the N agents, on other CPU: raw
keep-alive sockets driven by ``selectors``, one connection per session, each request with
the headers the openai SDK sends. Each agent runs a multi-turn loop: every call posts the
conversation so far (a 200-character user message, the reply it got, a new user message,
...), so each call extends the session's token stream by a bridge, never a break (checked:
every rollout has 0 breaks). Conversations are bounded: after ``--turns`` calls (default
8) the agent closes its connection, and the server leaves the session, takes its rollout
(``session.rollout``) and opens a fresh one, whose URL the agent uses on a new connection;
those costs are the gateway's too, spread over the session's calls. Request bodies are 0.3
to 2.3 KB, 1.3 KB on average. ``--keep-connections`` keeps one connection per agent across
its sessions instead (an agent that keeps its HTTP client).

A run measures the server's CPU over ``--duration`` seconds of calls (after a warm-up) and
divides it by the calls its backend answered: the gateway's total, the backend's own work
included. Then, with the agents idle, the server makes the same number of calls twice
more, N at a time, restarting every ``--turns`` calls, each measured the same way:

- direct: ``await inference.agenerate(InferenceRequest(prompt=..., prompt_ids=ids))``,
  token-in, the ids growing as in the sessions;
- handler: the agents' requests given to the gateway's handler in-process
  (``gw.handle(HTTPRequest(...))`` in fresh sessions: no socket, no HTTP parsing).

The table gives, per call, the median of ``--rounds`` runs of: the gateway's total, the
handler's and the direct cost (with the kernel's part of the first and last), the
gateway's own cost (total - direct: the figure the goal, 400 µs, is for), split into HTTP
(total - handler: sockets, h11, the server's tasks, connections) and logic (handler -
direct: routing, JSON, the session's matching and bridging, the renderer, the reply), and
the other load (the cores the rest of the machine kept busy meanwhile, from /proc/stat: on
a shared machine other work inflates CPU times, and varies between runs). The CPU per call
also falls as the server gets busier (more requests handled per pass of Trio's scheduler),
so with 64 sessions it depends on how much CPU the server gets: compare runs with similar
calls/s and other load.

``--profile`` adds one more run per session count under ``cProfile`` in the server (not in
the table: the profiler slows everything, the many small calls of Trio and h11 most) and
prints the top 25 functions by cumulative and by own time, then the gateway's own
functions by cumulative time. The profiler's clock is the process's CPU time (so time
spent preempted is not counted); reading it costs about 0.5 µs, which inflates small
functions most. A coroutine's time counts only while it runs, and each resumption counts
as a call.

The figures are for one machine: compare them with each other, not with other machines.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.metadata
import io
import json
import math
import os
import platform
import pstats
import re
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_rollouts import ChatMessage, PlainRenderer, Problem
from trio_rollouts.gateway import Gateway, serve
from trio_rollouts.gateway._http import HTTPRequest
from trio_rollouts.inference import (
    EmbeddedInference,
    InferenceRequest,
    InferenceResponse,
    LatencyModel,
)

GOAL_US = 400.0
ANSWER = "Checked: step holds."  # what the policy answers, to any prompt
USER_TEXT = "Please check the next step of the proof and say whether it holds. " * 3
USER_TEXT = USER_TEXT[:200]
PROBLEM = Problem(problem_id="bench", prompt=USER_TEXT, answer=None)
INSTANT = LatencyModel(first_token=0.0, per_token=0.0)
WARM_UP = 0.5
STALL = 60.0  # seconds without an awaited reply before the client gives up

assert len(ANSWER) == 20


def policy(messages: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
    return [ANSWER], np.ones(1)


class CountingInference(EmbeddedInference):
    """The embedded backend, counting the calls it answers (the gateway's and direct)."""

    served = 0

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        self.served += 1
        return await super().base_generate(request)


# --------------------------------------------------------------------------- server


@attrs.define
class _Server:
    """The ``--serve`` process: the gateway, its sessions, the control commands."""

    sessions: int
    turns: int
    inference: CountingInference = attrs.field(
        factory=lambda: CountingInference(policy=policy, seed=0, latency=INSTANT)
    )
    renderer: PlainRenderer = attrs.field(factory=PlainRenderer)
    gateway: Gateway | None = None
    ended: dict[int, trio.Event] = attrs.field(factory=dict)
    breaks: int = 0
    rollouts: int = 0
    profiler: cProfile.Profile | None = None
    profiled_from: int = 0

    @staticmethod
    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    async def run(self) -> None:
        async def slot(gw: Gateway, index: int) -> None:
            while True:
                async with gw.session(PROBLEM) as session:
                    self.ended[index] = trio.Event()
                    self.emit(f"url {index} {session.base_url}")
                    await self.ended[index].wait()
                # What a trainer does with a session: its rollout (and a check here).
                rollout = session.rollout(reward=1.0)
                self.breaks += rollout.extra["gateway"]["breaks"]
                self.rollouts += 1

        control = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async with serve(self.inference, self.renderer) as gw, trio.open_nursery() as nursery:
            self.gateway = gw
            for index in range(self.sessions):
                nursery.start_soon(slot, gw, index)
            buffer = b""
            while data := await control.receive_some(65_536):  # b"": the client is done
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    await self.command(line.decode().split())
            nursery.cancel_scope.cancel()

    async def command(self, words: list[str]) -> None:
        match words:
            case ["done", index]:
                self.ended[int(index)].set()
            case ["cpu"]:
                cpu, system = time.process_time(), os.times().system
                served = self.inference.served
                self.emit(f"cpu {cpu!r} {system!r} {served} {self.breaks} {self.rollouts}")
            case [("direct" | "handler") as kind, calls, concurrency]:
                run = self.direct if kind == "direct" else self.handler
                cpu, system = time.process_time(), os.times().system
                await run(int(calls), int(concurrency))
                cpu, system = time.process_time() - cpu, os.times().system - system
                self.emit(f"{kind} {cpu!r} {system!r}")
            case ["profile", "start"]:
                # CPU time, not wall time: on a shared machine, time the process spends
                # preempted (by the agents, by other work) would land in whatever ran.
                self.profiler = cProfile.Profile(time.process_time, builtins=False)
                self.profiled_from = self.inference.served
                self.profiler.enable()
                self.emit("profile started")
            case ["profile", "stop", path]:
                assert self.profiler is not None
                self.profiler.disable()
                served = self.inference.served - self.profiled_from
                out = io.StringIO()
                stats = pstats.Stats(self.profiler, stream=out).strip_dirs()
                stats.sort_stats("cumulative").print_stats(25)
                stats.sort_stats("tottime").print_stats(25)
                print("The gateway's own functions:", file=out)
                stats.sort_stats("cumulative").print_stats(
                    r"(_element|_session|_gateway|_http|_sse)\.py", 25
                )
                await trio.Path(path).write_text(out.getvalue())
                self.profiler = None
                self.emit(f"profile stopped {served}")
            case _:
                raise RuntimeError(f"unknown command {words!r}")

    async def direct(self, calls: int, concurrency: int) -> None:
        """``calls`` direct backend calls, ``concurrency`` at a time, each agent's ids
        growing as a session's do for ``turns`` calls, then starting over."""
        inference, renderer = self.inference, self.renderer
        user = ChatMessage(role="user", content=USER_TEXT)
        first = renderer.render([user])
        bridge = renderer.bridge(first, [user])  # "\n" + the user message + the prompt
        assert bridge is not None
        remaining = calls

        async def agent() -> None:
            nonlocal remaining
            while remaining > 0:
                ids, messages = first, [user]
                for _ in range(self.turns):
                    if remaining <= 0:
                        return
                    remaining -= 1
                    request = InferenceRequest(prompt=list(messages), prompt_ids=ids)
                    response = await inference.agenerate(request)
                    assert response.token_ids is not None
                    ids = response.token_ids + bridge
                    messages += [response.response, user]

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(agent)

    async def handler(self, calls: int, concurrency: int) -> None:
        """``calls`` calls given to the gateway's handler in-process (``gw.handle``, no
        socket, no HTTP parsing), ``concurrency`` sessions at a time, ``turns`` calls
        each, with the bodies and headers the agents send (made beforehand)."""
        gw = self.gateway
        assert gw is not None
        conversation: list[dict[str, str]] = []
        bodies = []
        for _ in range(self.turns):
            conversation.append({"role": "user", "content": USER_TEXT})
            bodies.append(json.dumps({"messages": conversation, "model": "policy"}).encode())
            conversation.append({"role": "assistant", "content": ANSWER})
        remaining = calls

        async def agent() -> None:
            nonlocal remaining
            while remaining > 0:
                async with gw.session(PROBLEM) as session:
                    path = urlsplit(session.base_url).path + "/chat/completions"
                    for body in bodies:
                        if remaining <= 0:
                            break
                        remaining -= 1
                        request = HTTPRequest("POST", path, "", HANDLER_HEADERS, body)
                        response = await gw.handle(request)
                        if response.status != 200:
                            raise RuntimeError(f"the gateway answered {response!r:.300}")
                self.breaks += session.rollout(reward=1.0).extra["gateway"]["breaks"]

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(agent)


# --------------------------------------------------------------------------- client

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def _sdk_headers() -> bytes:
    """The headers the openai SDK sends with a chat completion (all but Host and
    Content-Length), so that the server parses what it would in use."""
    try:
        version = importlib.metadata.version("openai")
    except importlib.metadata.PackageNotFoundError:
        version = "1.0.0"
    headers = [
        "Accept: application/json",
        "Accept-Encoding: gzip, deflate",
        "Connection: keep-alive",
        "Content-Type: application/json",
        f"User-Agent: AsyncOpenAI/Python {version}",
        "X-Stainless-Lang: python",
        f"X-Stainless-Package-Version: {version}",
        "X-Stainless-OS: Linux",
        "X-Stainless-Arch: x64",
        "X-Stainless-Runtime: CPython",
        f"X-Stainless-Runtime-Version: {platform.python_version()}",
        "Authorization: Bearer trio-rollouts",
        "X-Stainless-Async: async:asyncio",
        "x-stainless-retry-count: 0",
        "x-stainless-read-timeout: 600",
    ]
    return "".join(f"{header}\r\n" for header in headers).encode()


SDK_HEADERS = _sdk_headers()
#: The headers as the gateway's HTTP server gives them to its handler.
HANDLER_HEADERS = {
    name.lower(): value
    for name, _, value in (
        line.partition(": ")
        for line in ["Host: 127.0.0.1", *SDK_HEADERS.decode().splitlines(), "Content-Length: 1"]
    )
}


@attrs.define(eq=False)
class _Agent:
    """One session's agent: its connection, its conversation, its state."""

    index: int
    host: str = ""
    port: int = 0
    path: bytes = b""
    sock: socket.socket | None = None
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    calls: int = 0  # in the current session
    buffer: bytearray = attrs.field(factory=bytearray)
    state: str = "waiting"  # for its URL; "sending" (a call in flight) or "parked"

    def request(self, body: bytes) -> bytes:
        head = b"POST %s HTTP/1.1\r\nHost: %s:%d\r\n%sContent-Length: %d\r\n\r\n" % (
            self.path,
            self.host.encode(),
            self.port,
            SDK_HEADERS,
            len(body),
        )
        return head + body


class _Client:
    """Drives a server's sessions, and talks to it on its stdin and stdout."""

    def __init__(
        self, process: subprocess.Popen[bytes], sessions: int, turns: int, keep: bool
    ) -> None:
        assert process.stdin is not None
        assert process.stdout is not None
        self.process = process
        self.turns = turns
        self.keep = keep  # one connection per agent, kept across its sessions
        self.selector = selectors.DefaultSelector()
        self.out = process.stdout.fileno()
        os.set_blocking(self.out, False)
        self.selector.register(self.out, selectors.EVENT_READ, data=None)
        self.lines = b""
        self.replies: list[list[str]] = []
        self.agents = [_Agent(index) for index in range(sessions)]
        self.active = False
        self.completed = 0
        self.body_bytes = 0

    # -- control

    def send(self, command: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(command.encode() + b"\n")
        stdin.flush()

    def query(self, command: str) -> list[str]:
        """Send ``command``; its reply's words (the load goes on meanwhile)."""
        self.send(command)
        self.pump(lambda: bool(self.replies), stall=STALL)
        return self.replies.pop(0)

    def _read_control(self) -> None:
        data = os.read(self.out, 65_536)
        if not data:
            raise RuntimeError(f"the server exited (status {self.process.wait()})")
        self.lines += data
        *lines, self.lines = self.lines.split(b"\n")
        for line in lines:
            words = line.decode().split()
            if words[0] == "url":
                self._open(self.agents[int(words[1])], words[2])
            else:
                self.replies.append(words)

    # -- the agents

    def _open(self, agent: _Agent, base_url: str) -> None:
        """A new session's URL: a new connection, a new conversation."""
        url = urlsplit(base_url)
        assert url.hostname is not None
        assert url.port is not None
        agent.host, agent.port = url.hostname, url.port
        agent.path = (url.path + "/chat/completions").encode()
        if agent.sock is None:
            sock = socket.create_connection((agent.host, agent.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            agent.sock = sock
            self.selector.register(sock, selectors.EVENT_READ, data=agent)
        agent.messages = [{"role": "user", "content": USER_TEXT}]
        agent.calls = 0
        self._next(agent)

    def _next(self, agent: _Agent) -> None:
        if not self.active:
            agent.state = "parked"
            return
        assert agent.sock is not None
        body = json.dumps({"messages": agent.messages, "model": "policy"}).encode()
        self.body_bytes += len(body)
        agent.sock.sendall(agent.request(body))  # at most a few KB: fits the socket's buffer
        agent.state = "sending"

    def _read_agent(self, agent: _Agent) -> None:
        assert agent.sock is not None
        data = agent.sock.recv(65_536)
        if not data:
            raise RuntimeError("the server closed a keep-alive connection")
        buffer = agent.buffer
        buffer += data
        head_end = buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        match = _LENGTH.search(buffer, 0, head_end + 2)
        if match is None:
            raise RuntimeError(f"a response without Content-Length: {bytes(buffer[:head_end])!r}")
        end = head_end + 4 + int(match.group(1))
        if len(buffer) < end:
            return
        if not buffer.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"the gateway answered {bytes(buffer[:end])!r:.300}")
        if end != len(buffer):
            raise RuntimeError("a response with bytes after it")
        reply = json.loads(buffer[head_end + 4 : end])
        buffer.clear()
        self.completed += 1
        agent.calls += 1
        agent.messages.append(
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
        )
        if agent.calls < self.turns:
            agent.messages.append({"role": "user", "content": USER_TEXT})
            self._next(agent)
            return
        # The agent is done: it closes its client; the trainer leaves the session.
        if not self.keep:
            self.selector.unregister(agent.sock)
            agent.sock.close()
            agent.sock = None
        agent.state = "waiting"
        self.send(f"done {agent.index}")

    # -- the loop

    def pump(self, until: Callable[[], bool], *, stall: float | None = None) -> None:
        """Serve events until ``until()`` holds (a ``RuntimeError`` after ``stall`` s)."""
        give_up = None if stall is None else time.perf_counter() + stall
        while not until():
            if give_up is not None and time.perf_counter() > give_up:
                raise RuntimeError("no progress: the server stopped answering")
            for key, _ in self.selector.select(timeout=1.0):
                if key.data is None:
                    self._read_control()
                else:
                    self._read_agent(key.data)

    def run_for(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        self.pump(lambda: time.perf_counter() >= deadline)

    def start(self) -> None:
        self.active = True
        for agent in self.agents:
            if agent.state == "parked":
                self._next(agent)

    def stop(self) -> None:
        """No new calls; wait for those in flight."""
        self.active = False
        self.pump(lambda: all(agent.state != "sending" for agent in self.agents), stall=STALL)

    def close(self) -> None:
        for agent in self.agents:
            if agent.sock is not None:
                self.selector.unregister(agent.sock)
                agent.sock.close()
        self.selector.close()
        stdin = self.process.stdin
        assert stdin is not None
        stdin.close()
        self.process.wait(timeout=30)


@attrs.frozen
class _Run:
    calls: int
    seconds: float
    gateway_us: float
    gateway_system_us: float
    handler_us: float
    direct_us: float
    direct_system_us: float
    body_bytes: float
    other_load: float | None

    @property
    def own_us(self) -> float:
        return self.gateway_us - self.direct_us

    @property
    def http_us(self) -> float:
        return self.gateway_us - self.handler_us

    @property
    def logic_us(self) -> float:
        return self.handler_us - self.direct_us


@attrs.frozen
class _Sample:
    """The server's CPU seconds (``system``: in the kernel), the calls its backend
    answered, the breaks and the rollouts so far."""

    cpu: float
    system: float
    served: int
    breaks: int
    rollouts: int


def _sample(client: _Client) -> _Sample:
    _, cpu, system, served, breaks, rollouts = client.query("cpu")
    if int(breaks):
        raise RuntimeError(f"{breaks} calls broke their session: the agents must bridge")
    return _Sample(float(cpu), float(system), int(served), int(breaks), int(rollouts))


def measure(client: _Client, sessions: int, seconds: float) -> _Run:
    """One run: the gateway's CPU per call over ``seconds``, then the direct calls."""
    client.start()
    client.run_for(WARM_UP)
    from _report import busy_cpu_seconds

    before = _sample(client)
    sent_before, completed_before = client.body_bytes, client.completed
    start, busy, ours = time.perf_counter(), busy_cpu_seconds(), time.process_time()
    client.run_for(seconds)
    after = _sample(client)
    elapsed = time.perf_counter() - start
    busy_after, ours = busy_cpu_seconds(), time.process_time() - ours + after.cpu - before.cpu
    other = None if busy is None or busy_after is None else (busy_after - busy - ours) / elapsed
    body_bytes = (client.body_bytes - sent_before) / max(1, client.completed - completed_before)
    client.stop()
    calls = after.served - before.served
    _, direct_cpu, direct_system = client.query(f"direct {calls} {sessions}")
    _, handler_cpu, _ = client.query(f"handler {calls} {sessions}")
    return _Run(
        calls=calls,
        seconds=elapsed,
        gateway_us=(after.cpu - before.cpu) / calls * 1e6,
        gateway_system_us=(after.system - before.system) / calls * 1e6,
        handler_us=float(handler_cpu) / calls * 1e6,
        direct_us=float(direct_cpu) / calls * 1e6,
        direct_system_us=float(direct_system) / calls * 1e6,
        body_bytes=body_bytes,
        other_load=other,
    )


def profile(client: _Client, seconds: float) -> tuple[int, str]:
    """A run under cProfile in the server: the calls served and the printed stats."""
    client.start()
    client.run_for(WARM_UP)
    client.query("profile start")
    client.run_for(seconds)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.txt"
        words = client.query(f"profile stop {path}")
        text = path.read_text()
    client.stop()
    return int(words[2]), text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sessions", default="1,64", help="concurrent sessions, e.g. 1,64")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per session count")
    parser.add_argument("--turns", type=int, default=8, help="calls per session (>= 1)")
    parser.add_argument(
        "--keep-connections",
        action="store_true",
        help="one connection per agent, kept across its sessions (default: one per session)",
    )
    parser.add_argument("--profile", action="store_true", help="one run under cProfile more")
    args = parser.parse_args()
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    if args.serve is not None:
        trio.run(_Server(args.serve, args.turns).run)
        return

    from _report import Report, machine_lines, progress

    counts = [int(n) for n in args.sessions.split(",")]
    clients: dict[int, _Client] = {}
    results: dict[int, list[_Run]] = {}
    profiles: dict[int, tuple[int, str]] = {}
    try:
        for sessions in counts:
            process = subprocess.Popen(
                [sys.executable, __file__, "--serve", str(sessions), "--turns", str(args.turns)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            clients[sessions] = _Client(process, sessions, args.turns, args.keep_connections)
        for round_ in range(args.rounds):
            for sessions in counts:
                progress(f"round {round_ + 1}/{args.rounds}: {sessions} sessions")
                run = measure(clients[sessions], sessions, args.duration)
                results.setdefault(sessions, []).append(run)
        if args.profile:
            for sessions in counts:
                progress(f"profiling: {sessions} sessions")
                profiles[sessions] = profile(clients[sessions], args.duration)
        rollouts = {sessions: _sample(client).rollouts for sessions, client in clients.items()}
    finally:
        for client in clients.values():
            client.close()

    report = Report(width=160)
    versions = f"h11 {importlib.metadata.version('h11')}"
    for line in machine_lines(versions):
        report.line(line)
    connections = "per agent" if args.keep_connections else "per session"
    report.line(
        f"a call: a multi-turn agent's POST /chat/completions (the conversation so far, "
        f"{args.turns} calls per session, then a fresh session; one connection {connections}), "
        f"answered with a {len(ANSWER)}-character completion by EmbeddedInference (no "
        "latency), PlainRenderer"
    )
    rows = []
    for sessions in counts:
        runs = results[sessions]

        def median(field: Callable[[_Run], float | None], runs: list[_Run] = runs) -> float:
            values = [value for run in runs if (value := field(run)) is not None]
            return statistics.median(values) if values else math.nan

        own = median(lambda run: run.own_us)
        rows.append(
            [
                str(sessions),
                f"{median(lambda run: run.calls):,.0f}",
                f"{median(lambda run: run.calls / run.seconds):,.0f}",
                f"{median(lambda run: run.body_bytes):,.0f}",
                f"{median(lambda run: run.gateway_us):.0f} "
                f"({median(lambda run: run.gateway_system_us):.0f})",
                f"{median(lambda run: run.handler_us):.0f}",
                f"{median(lambda run: run.direct_us):.0f} "
                f"({median(lambda run: run.direct_system_us):.0f})",
                f"{own:.0f}",
                f"{median(lambda run: run.http_us):.0f}",
                f"{median(lambda run: run.logic_us):.0f}",
                f"{GOAL_US:.0f}",
                "yes" if own <= GOAL_US else "no",
                f"{median(lambda run: run.other_load):.1f}",
            ]
        )
    report.table(
        f"Gateway CPU per call (server process), median of {args.rounds} runs of "
        f"{args.duration:g} s",
        [
            "sessions",
            "calls/run",
            "calls/s",
            "body B",
            "gateway µs (sys)",
            "handler µs",
            "direct µs (sys)",
            "own µs",
            "HTTP µs",
            "logic µs",
            "goal µs",
            "met",
            "other load",
        ],
        rows,
    )
    for line in (
        "gateway: the server's CPU per call over HTTP, the backend's work included, (sys) "
        "the part in the kernel;",
        "handler: the same calls given to gw.handle in-process (no socket, no HTTP); direct: "
        "the same calls on the backend in-process;",
        f"own = gateway - direct, the gateway's own cost (the goal: <= {GOAL_US:.0f} µs) = "
        "HTTP (gateway - handler: sockets, h11, connections) + logic (handler - direct: "
        "routing, JSON, session, renderer);",
        "other load: the cores the rest of the machine kept busy meanwhile (other work "
        "inflates CPU times).",
    ):
        report.line(line)
    for sessions in counts:
        report.line(
            f"{sessions} sessions: {rollouts[sessions]:,} rollouts taken, 0 breaks (every call "
            "extended its session)"
        )
    for sessions, (calls, text) in profiles.items():
        report.line()
        report.line(f"cProfile of the server, {sessions} sessions, {calls:,} calls:")
        report.line(text.strip())


if __name__ == "__main__":
    main()
