"""Server CPU per call of the gateway's HTTP server (h11 on ``trio.serve_tcp``) beside
Hypercorn's Trio worker: what justifies serving the gateway on the former.

Usage: python benchmarks/gateway_http.py [--concurrency 1,64] [--duration 3] [--rounds 3]
                                         [--servers h11,hypercorn]

Needs the ``test`` extra (Hypercorn). Each server runs in its own process (this script,
re-run with ``--serve NAME``) and answers every ``POST`` with the same 300-byte JSON after
reading its 1 KB body: ``trio_rollouts.gateway._http.serve_http`` with a trivial handler,
and ``hypercorn.trio.serve`` with a minimal ASGI app doing the same (no framework). The
client is this process, on other CPU: raw keep-alive sockets driven by ``selectors``, C
connections each with one request in flight, pre-built request bytes, so its own cost is
excluded and small. The server reports its CPU time (``time.process_time``, user and
system) on ``GET /cpu``; a run measures it before and after ``--duration`` seconds of
calls, after a warm-up, and divides by the calls completed. The rounds interleave the
servers; the table gives the median of the rounds, and the ratio Hypercorn / h11.

The figures are for comparing the two servers on one machine, not absolutes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import selectors
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

REPLY = json.dumps(
    {
        "id": "chatcmpl-0123456789abcdef",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * 90},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 100, "completion_tokens": 30, "total_tokens": 130},
    }
).encode()
BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "y" * 960}]}).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
) + BODY


# --------------------------------------------------------------------------- servers


async def serve_h11(task_status: trio.TaskStatus[int]) -> None:
    from trio_rollouts.gateway._http import HTTPRequest, HTTPResponse, serve_http

    async def handler(request: HTTPRequest) -> HTTPResponse:
        if request.path == "/cpu":
            return HTTPResponse(200, json.dumps({"cpu": time.process_time()}).encode())
        return HTTPResponse(200, REPLY)

    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(serve_http, handler, "127.0.0.1", 0)
        task_status.started(port)


async def serve_hypercorn(task_status: trio.TaskStatus[int]) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    Receive = Callable[[], Awaitable[dict[str, Any]]]
    Send = Callable[[dict[str, Any]], Awaitable[None]]

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        more_body = True
        while more_body:  # the body is read whole, as the gateway must
            message = await receive()
            more_body = message.get("more_body", False)
        body = REPLY
        if scope["path"] == "/cpu":
            body = json.dumps({"cpu": time.process_time()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_max_requests = 2**62  # its default (1000) closes busy connections
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


SERVERS = {"h11": serve_h11, "hypercorn": serve_hypercorn}


def run_server(name: str) -> None:
    """The ``--serve`` mode: print the port, serve until stdin closes."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(SERVERS[name])
            print(port, flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # the parent closes it to stop us
            nursery.cancel_scope.cancel()

    trio.run(main)


# --------------------------------------------------------------------------- client

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def _response_end(buffer: bytes | bytearray) -> int | None:
    """Where the complete response at the start of ``buffer`` ends, or None."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    match = _LENGTH.search(buffer, 0, head_end + 2)
    if match is None:
        msg = f"a response without Content-Length: {bytes(buffer[:head_end])!r}"
        raise RuntimeError(msg)
    end = head_end + 4 + int(match.group(1))
    return end if len(buffer) >= end else None


def call_once(port: int, request: bytes) -> bytes:
    """One request on a fresh connection; the response's body."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        buffer = bytearray()
        while (end := _response_end(buffer)) is None:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError("the server closed the connection")
            buffer += data
        return bytes(buffer[buffer.find(b"\r\n\r\n") + 4 : end])


def server_cpu(port: int) -> float:
    request = b"GET /cpu HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
    cpu: float = json.loads(call_once(port, request))["cpu"]
    return cpu


def load(port: int, connections: int, seconds: float) -> int:
    """Keep ``connections`` keep-alive connections busy for ``seconds``; calls completed."""
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(REQUEST)
        sock.setblocking(False)
        buffers[sock] = bytearray()
        selector.register(sock, selectors.EVENT_READ, data=sock)
    calls = 0
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            for key, _ in selector.select(timeout=1.0):
                ready: socket.socket = key.data
                buffer = buffers[ready]
                data = ready.recv(65536)
                if not data:
                    raise RuntimeError("the server closed a keep-alive connection")
                buffer += data
                if (end := _response_end(buffer)) is not None:
                    if end != len(buffer):
                        raise RuntimeError("a response with bytes after it")
                    buffer.clear()
                    calls += 1
                    ready.sendall(REQUEST)  # small: fits the socket's buffer at once
    finally:
        for sock in buffers:
            selector.unregister(sock)
            sock.close()
        selector.close()
    return calls


def measure(port: int, connections: int, seconds: float) -> tuple[float, float]:
    """(µs of server CPU per call, calls/s) for one run, after a warm-up."""
    load(port, connections, min(0.5, seconds))
    before = server_cpu(port)
    start = time.perf_counter()
    calls = load(port, connections, seconds)
    elapsed = time.perf_counter() - start
    after = server_cpu(port)
    return (after - before) / calls * 1e6, calls / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=sorted(SERVERS), help=argparse.SUPPRESS)
    parser.add_argument("--servers", default="h11,hypercorn", help="comma-separated")
    parser.add_argument("--concurrency", default="1,64", help="client connections, e.g. 1,64")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per server and concurrency")
    args = parser.parse_args()
    if args.serve:
        run_server(args.serve)
        return

    from _report import Report, machine_lines, progress

    servers = args.servers.split(",")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    processes = {}
    for name in servers:
        process = subprocess.Popen(
            [sys.executable, __file__, "--serve", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        processes[name] = (process, int(process.stdout.readline()))
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for round_ in range(args.rounds):
            for connections in concurrencies:
                for name in servers:
                    progress(f"round {round_ + 1}/{args.rounds}: {name}, {connections} conn.")
                    run = measure(processes[name][1], connections, args.duration)
                    results.setdefault((name, connections), []).append(run)
    finally:
        for process, _ in processes.values():
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=10)

    report = Report()
    versions = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in ("h11", "hypercorn")
    )
    for line in machine_lines(versions):
        report.line(line)
    rows = []
    for connections in concurrencies:
        for name in servers:
            runs = results[(name, connections)]
            cpu = statistics.median(run[0] for run in runs)
            rate = statistics.median(run[1] for run in runs)
            rows.append([name, str(connections), f"{cpu:.0f}", f"{rate:,.0f}"])
    report.line("a call: a 1 KB POST answered with a 300-byte JSON, on a keep-alive connection")
    report.table(
        f"Server CPU per call, median of {args.rounds} runs of {args.duration:g} s",
        ["server", "connections", "µs CPU/call", "calls/s"],
        rows,
    )
    if "h11" in servers and "hypercorn" in servers:
        for connections in concurrencies:
            ours = statistics.median(run[0] for run in results[("h11", connections)])
            theirs = statistics.median(run[0] for run in results[("hypercorn", connections)])
            report.line(f"{connections} conn.: Hypercorn / h11 = {theirs / ours:.2f}x CPU per call")


if __name__ == "__main__":
    main()
