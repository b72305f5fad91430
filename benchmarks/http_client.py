"""Client cost of OpenAIInference beside aiohttp on uvloop and the openai SDK, in one run.

Usage: python benchmarks/http_client.py [--configs 256,512@20] [--rounds N] [--duration S]
                                        [--clients a,b,...] [--json FILE]

This runs the shared HTTP comparison (``shared/bench/http/compare.py`` next to the
repository) from the project, unchanged: a canned OpenAI-compatible server on 127.0.0.1
that costs about 10 µs per request, so what is measured is the client; each client runs in
its own process with C requests in flight through a pool of C connections, the clients
interleaved over rounds; the table gives median req/s and CPU µs per request. The
default clients are this library, aiohttp on uvloop (what SkyRL, AReaL and TRL use), the
openai SDK on asyncio (what verifiers and prime-rl use) and a raw Trio socket loop (the
floor: what Trio itself costs).

The interpreter running this script must have the project and the peers' clients
installed: ``nox -s bench-http`` makes such a venv (openai, aiohttp, uvloop) and runs it.
The numbers are for comparing clients on one machine, not absolutes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
COMPARE = REPO.parent / "shared" / "bench" / "http" / "compare.py"

DEFAULT_CLIENTS = "trio_rollouts,aiohttp-uvloop,openai-asyncio,raw-trio"
DEFAULT_CONFIGS = "256,512@20"
VERSIONS = ("trio", "h11", "httptools", "httpx2", "aiohttp", "uvloop", "openai", "stamina")


def describe_machine() -> list[str]:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for name in VERSIONS:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    return [
        f"machine: {os.cpu_count()} cores, {cpu}",
        f"python {platform.python_version()} ({platform.python_implementation()}); "
        + ", ".join(versions),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="C or C@latency_ms, ...")
    parser.add_argument("--clients", default=DEFAULT_CLIENTS, help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every client")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per run")
    parser.add_argument("--json", default=None, help="also write every run to this file")
    args = parser.parse_args()
    if not COMPARE.is_file():
        raise SystemExit(f"the shared HTTP comparison is missing: {COMPARE} not found")
    for line in describe_machine():
        print(line, flush=True)
    command = [
        sys.executable,
        str(COMPARE),
        "--python",
        sys.executable,
        "--configs",
        args.configs,
        "--clients",
        args.clients,
        "--rounds",
        str(args.rounds),
        "--duration",
        str(args.duration),
    ]
    if args.json:
        command += ["--json", args.json]
    raise SystemExit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__":
    main()
