"""Helpers of the command-line tests: running a command in-process (click's
``CliRunner``) or as a subprocess that gets a real signal, prompt files, and reading the
output back."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _openai_server import FakeOpenAIServer, serving_in_thread
from click.testing import CliRunner, Result

import trio_rollouts as tr
from trio_rollouts.cli import main


def invoke(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("Error")]


def write_prompts(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def groups_in(path: Path) -> list[tr.RolloutGroup]:
    return list(tr.load_jsonl(path, tr.RolloutGroup))


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def serving(fake: FakeOpenAIServer) -> Iterator[FakeOpenAIServer]:
    with serving_in_thread(fake):
        yield fake


def standard_prompts(path: Path) -> Path:
    # The fake server answers "server: <last message>".
    return write_prompts(
        path,
        [
            {"problem_id": "p1", "prompt": "2+2", "answer": "2+2"},
            {
                "problem_id": "p2",
                "prompt": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Capital of France?"},
                ],
                "answer": "Paris",
            },
            {"prompt": "hello", "answer": "hello"},
        ],
    )


def signal_when(args: list[str], ready: Callable[[], bool], signum: int) -> tuple[int, str, float]:
    """Run ``python -m trio_rollouts.cli ARGS``, send it ``signum`` once ``ready()``
    holds, and return its exit code, its stderr, and how long it took to exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_rollouts.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the command did not get ready"
            time.sleep(0.02)
        sent = time.monotonic()
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=10)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, stderr, took


__all__ = [
    "closed_port",
    "error_lines",
    "groups_in",
    "invoke",
    "lines",
    "serving",
    "signal_when",
    "standard_prompts",
    "write_prompts",
]
