"""The CLI and the library against a real vLLM server on the CPU, with default flags.

``nox -s vllm`` runs this (``nox -R -s vllm`` reuses the install). It:

1. builds a tiny random Llama offline (``tools/real_server/build_tiny_llama.py``, 2 heads:
   vLLM's CPU attention needs a head size of 32 or more) in a temporary folder;
2. serves it with ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 twice,
   one server per core (free ports, ``VLLM_SERVER_DEV_MODE=1`` for ``/pause``): one with
   ``--enable-scale-out`` (vLLM's RL interface; raw logprobs, the default), one with
   ``--logprobs-mode processed_logprobs``; each counts ready only once it answers
   ``/health`` *and* one short completion (a model vLLM cannot run passes ``/health``
   and dies at the first request);
3. runs ``trio-rollouts generate`` and ``trio-rollouts eval`` with default flags and
   checks the outputs, token ids and logprobs included;
4. runs the library suite (``checks.py``): token ids and logprobs against a re-score,
   every weight-update mode through the real ``/pause`` and ``/resume``, the KV and prefix
   cache kept under ``keep``, exact continuations under ``abort``, nothing generated
   while paused and nothing left paused on any route;
5. runs ``sampling_checks.py`` on both servers: the probe tells them apart, a keep update
   mid-generation gives a boundary inside the generated ids with ``mixed == 0``, the
   fallback to ``/v1/completions`` works, biased combinations are flagged, seeds replay,
   and leaving a stream stops generation on the server;
6. runs ``placement_checks.py`` on both servers as two replicas of one interface: each
   ``routing`` on the same workload of groups with a shared prefix, read from the
   servers' prefix-cache counters ("group" must compute the fewest prompt tokens), group
   calls with ``n`` against separate calls (wall time), seeded choices, a cancelled group;
7. runs ``examples/vllm/grpo.py`` against the same server (GRPO that learns; skip it
   with ``--no-grpo``) and checks that its reward rises;
8. once those servers have stopped, serves the Llama once more with ``--scheduling-policy
   priority`` (``check_priority``); then, alone, a tiny random Qwen2 with Qwen2.5's real
   tokenizer and template (``qwen_checks.py``, built offline at the start), with vLLM's
   ``hermes`` tool parser: token-in tool episodes and gateway sessions exact, and the
   gateway's tool calls against vLLM's own parse of the same ids;
9. always stops the servers and its engine process (SIGTERM to its process group, then
   SIGKILL after ``STOP_TIMEOUT`` seconds).

    python tools/vllm/run.py [--keep DIR] [--no-grpo] [--only qwen]

``--only qwen`` builds the models and runs the Qwen server and checks of step 8 alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import trio

import trio_rollouts as tr

sys.path.insert(0, str(Path(__file__).parent))
# Before this folder: the run.py imported is real_server's.
sys.path.insert(0, str(Path(__file__).parents[1] / "real_server"))
from build_tiny_llama import build
from checks import VLLM, run_library_checks
from gateway_checks import check_gateway
from placement_checks import check_priority, run_placement_checks
from qwen_checks import QWEN_FLAGS, build_qwen, run_qwen_checks
from run import (
    HOST,
    OFFLINE,
    PROBLEMS,
    CheckFailed,
    check,
    free_port,
    get_json,
    run_cli,
    run_cli_checks,
    step,
    tail,
)
from sampling_checks import run_sampling_checks

HERE = Path(__file__).parent
#: Seconds for vLLM to start (50-100 s here) and answer its first completion.
READY_TIMEOUT = 400.0
#: Seconds between SIGTERM and SIGKILL when stopping the server.
STOP_TIMEOUT = 30.0
#: What this machine's CPU build needs (see README.md).
VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # mounts /pause, /resume, /is_paused, /collective_rpc
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    # The cores each server's engine binds its threads to: set per server (SERVERS).
}


#: The two servers: the library's main one serves vLLM's RL interface
#: (``--enable-scale-out``: ``/inference/v1/generate`` with per-token weight versions)
#: and its default raw logprobs; the other serves processed logprobs and no RL
#: interface (the probe must tell them apart, and the client falls back there). One
#: core each.
SERVERS = {
    "scale-out": (["--enable-scale-out"], "0"),
    "processed": (["--logprobs-mode", "processed_logprobs"], "1"),
}


#: The scheduler flags of the checks' servers: 1024 is the model's
#: max_position_embeddings (Qwen2.5's system block with one tool is about 700 byte tokens:
#: the episodes-qwen2.5 check).
SCHEDULER_FLAGS: Final = ("--max-model-len", "1024", "--max-num-seqs", "16")


def launch(
    model_dir: Path,
    log_path: Path,
    flags: list[str],
    core: str,
    scheduler: Sequence[str] = SCHEDULER_FLAGS,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start vLLM's OpenAI server with ``scheduler`` and ``flags``, bound to ``core``; its
    process and root."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",  # `vllm serve` needs the `vllm` distribution
        "--model",
        str(model_dir),
        "--host",
        HOST,
        "--port",
        str(port),
        *scheduler,
        "--enforce-eager",
        # The weights as saved (float32): vLLM's default on the CPU, bfloat16, gave
        # logprobs up to 2e-3 off the re-score's after 440 decode steps on this machine.
        "--dtype",
        "float32",
        *flags,
    ]
    print("$", " ".join(command), flush=True)
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **OFFLINE, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": core},
            start_new_session=True,  # its engine core is a child process: stop both
        )
    return server, f"http://{HOST}:{port}"


#: The server of the priority check (``OpenAIInference(priority=True)``), started after
#: the others have stopped, so that its scheduling policy touches no other check.
PRIORITY_SERVER = {"priority": (["--scheduling-policy", "priority"], "0")}


#: The server of the Qwen checks (``qwen_checks.py``): the tiny random Qwen2 with Qwen's
#: real tokenizer, vLLM's RL interface and its hermes tool parser; started last, alone.
QWEN_SERVER = {"qwen": (QWEN_FLAGS, "0")}


@contextlib.contextmanager
def serving(
    model_dir: Path, work: Path, which: dict[str, tuple[list[str], str]] = SERVERS
) -> Iterator[dict[str, VLLM]]:
    """Run the servers ``which`` names (:data:`SERVERS` by default) for the block, started
    at once; yield them by name once each has completed a request."""
    with contextlib.ExitStack() as stack:
        servers: dict[str, VLLM] = {}
        started = {}
        for name, (flags, core) in which.items():
            log_path = work / f"server-{name}.log"
            server, root = launch(model_dir, log_path, flags, core)
            stack.callback(stop, server)
            started[name] = (server, root, log_path)
        for name, (server, root, log_path) in started.items():
            wait_until_ready(server, root, str(model_dir), log_path)
            servers[name] = VLLM(root=root, model=str(model_dir))
        yield servers


def stop(server: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    # The engine core may outlive the API process by a moment: make sure it is gone.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    print(f"server stopped (exit code {server.returncode})", flush=True)


def wait_until_ready(
    server: subprocess.Popen[bytes], root: str, model: str, log_path: Path
) -> None:
    """Poll until ``/health`` answers and a 2-token completion succeeds, the server
    exits, or READY_TIMEOUT passes. (Polling is all a starting process offers.)"""
    started = time.monotonic()
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 2}).encode()
    while time.monotonic() - started < READY_TIMEOUT:
        if server.poll() is not None:
            msg = f"vLLM exited with {server.returncode} while starting:\n{tail(log_path)}"
            raise CheckFailed(msg)
        with contextlib.suppress(OSError, ValueError):
            urllib.request.urlopen(f"{root}/health", timeout=5).close()  # loopback only
            request = urllib.request.Request(
                f"{root}/v1/completions", data=body, headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=60) as reply:
                if json.load(reply)["choices"][0]["text"] is not None:
                    print(f"vLLM ready after {time.monotonic() - started:.1f} s", flush=True)
                    return
        time.sleep(1.0)
    msg = f"vLLM did not complete a request within {READY_TIMEOUT} s:\n{tail(log_path)}"
    raise CheckFailed(msg)


def check_token_rows(out: Path) -> None:
    """With default flags against vLLM, every generated rollout carries its token ids
    and one logprob per generated token (negotiated, nothing to ask for)."""
    with out.open(encoding="utf-8") as file:
        groups = list(tr.load_jsonl(file, tr.RolloutGroup))
    for group in groups:
        for rollout in group:
            if not isinstance(rollout, tr.TokenRollout):
                raise CheckFailed(f"a {type(rollout).__name__} row, not a TokenRollout")
            mask = (rollout.generation_mask or [[]])[0]
            check(rollout.logprobs is not None, "a row without logprobs")
            generated = sum(mask)
            check(
                len((rollout.logprobs or [[]])[0]) == generated > 0,
                f"{generated} generated tokens, {len((rollout.logprobs or [[]])[0])} logprobs",
            )
    print("generate: every row is a TokenRollout with one logprob per generated token")


def check_seeded_cli(
    base_url: str, model: str, prompts: Path, work: Path, timings: dict[str, float]
) -> None:
    """``generate --server vllm --seed 7`` twice: through the RL interface, every row
    records its own seed and the probed logprobs mode, and the rerun samples the same
    ids (vLLM seeds each request's sampler)."""
    step("trio-rollouts generate --server vllm --seed 7 (twice)")
    rows = []
    for name in ("seeded-1.jsonl", "seeded-2.jsonl"):
        out = work / name
        timings[f"generate {name}"] = run_cli(
            "generate", "--base-url", base_url, "--model", model, "--prompts", str(prompts),
            "--out", str(out), "--group-size", "2", "--max-tokens", "12", "--server", "vllm",
            "--seed", "7",
        )  # fmt: skip
        with out.open(encoding="utf-8") as file:
            groups = list(tr.load_jsonl(file, tr.RolloutGroup))
        found = {}
        count = 0
        for group in groups:
            for rollout in group:
                if not isinstance(rollout, tr.TokenRollout) or rollout.sampling is None:
                    raise CheckFailed(f"a row without a sampling record: {rollout!r:.200}")
                (span,) = rollout.sampling[0]
                check(span.seed is not None, "a row without a seed")
                check(span.logprobs_mode == "raw", f"logprobs_mode {span.logprobs_mode!r}")
                found[span.seed] = rollout.trajectory[0]
                count += 1
        check(len(found) == count, f"{count} rows share {len(found)} seeds")
        rows.append(found)
    first, second = rows
    check(first == second, "the rerun sent other seeds or sampled other ids")
    print(f"generate --seed: {len(first)} rows, each its own seed, replayed id for id")


def check_reward_rises(history_path: Path) -> None:
    """The last quarter of the steps earns clearly more than the first (measured here:
    about 0.13 then 0.98 over 40 steps)."""
    history = json.loads(history_path.read_text())
    quarter = max(1, len(history) // 4)
    before = sum(row["reward"] for row in history[:quarter]) / quarter
    after = sum(row["reward"] for row in history[-quarter:]) / quarter
    check(after >= before + 0.3, f"the reward did not rise: {before:.3f} then {after:.3f}")
    print(f"GRPO: mean reward {before:.3f} in the first {quarter} steps, {after:.3f} in the last")


def main(work: Path, grpo: bool, only: str | None = None) -> None:
    timings: dict[str, float] = {}
    started = time.monotonic()
    step("build a tiny random Llama (offline; 2 heads of 32)")
    model_dir = build(work / "tiny-llama", heads=2)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROBLEMS), encoding="utf-8")
    timings["build"] = time.monotonic() - started
    step("build a tiny random Qwen2 with Qwen2.5's real tokenizer (offline)")
    mark = time.monotonic()
    qwen_dir = build_qwen(work / "tiny-qwen2")
    timings["build qwen"] = time.monotonic() - mark
    if only != "qwen":
        check_llama(model_dir, prompts, work, grpo, timings)
    check_qwen(qwen_dir, work, timings)
    timings["total"] = time.monotonic() - started
    step("passed")
    print(", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items()))


def check_llama(
    model_dir: Path, prompts: Path, work: Path, grpo: bool, timings: dict[str, float]
) -> None:
    """Every step on the tiny Llama: the two servers, then the priority server."""
    step("start two vLLM servers (one per core)")
    mark = time.monotonic()
    with serving(model_dir, work) as servers:
        timings["server start"] = time.monotonic() - mark
        vllm = servers["scale-out"]
        model = str(get_json(f"{vllm.base_url}/models")["data"][0]["id"])  # type: ignore[index]
        check(model == vllm.model, f"vLLM serves {model!r}")
        check_token_rows(run_cli_checks(vllm.base_url, model, prompts, work, timings))
        check_seeded_cli(vllm.base_url, model, prompts, work, timings)

        step("the library against vLLM")
        mark = time.monotonic()
        trio.run(run_library_checks, vllm)
        timings["library"] = time.monotonic() - mark

        step("the gateway: unmodified SDK agents in its three dialects, token-in")
        mark = time.monotonic()
        print(f"gateway: {trio.run(check_gateway, vllm)}", flush=True)
        timings["gateway"] = time.monotonic() - mark

        step("what the server says about each sample: the probe, epochs, the check")
        mark = time.monotonic()
        trio.run(run_sampling_checks, servers["scale-out"], servers["processed"])
        timings["sampling"] = time.monotonic() - mark

        step("placement on two replicas, and groups as one call (n)")
        mark = time.monotonic()
        trio.run(run_placement_checks, servers["scale-out"], servers["processed"])
        timings["placement"] = time.monotonic() - mark

        if grpo:
            step("examples/vllm/grpo.py: GRPO on the running server")
            mark = time.monotonic()
            example = HERE.parents[1] / "examples" / "vllm" / "grpo.py"
            command = [
                sys.executable,
                str(example),
                "--server-root",
                vllm.root,
                "--model-dir",
                str(model_dir),
                "--work",
                str(work / "grpo"),
            ]
            print("$", " ".join(command), flush=True)
            done = subprocess.run(command, check=False, stdin=subprocess.DEVNULL, timeout=1800)
            check(done.returncode == 0, f"the GRPO example exited with {done.returncode}")
            timings["grpo"] = time.monotonic() - mark
            check_reward_rises(work / "grpo" / "history.json")

    step("older epochs first: a server with --scheduling-policy priority")
    mark = time.monotonic()
    with serving(model_dir, work, PRIORITY_SERVER) as servers:
        print(f"priority: {trio.run(check_priority, servers['priority'])}", flush=True)
    timings["priority"] = time.monotonic() - mark


def check_qwen(qwen_dir: Path, work: Path, timings: dict[str, float]) -> None:
    """The Qwen checks on their own server, alone (started beside the priority server,
    that check timed out once: its two calls never waited at the same time)."""
    step("the tiny Qwen2 with Qwen2.5's tokenizer, vLLM's hermes tool parser")
    mark = time.monotonic()
    with serving(qwen_dir, work, QWEN_SERVER) as servers:
        timings["qwen server start"] = time.monotonic() - mark
        mark = time.monotonic()
        trio.run(run_qwen_checks, servers["qwen"])
        timings["qwen"] = time.monotonic() - mark


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it there")
    parser.add_argument("--no-grpo", action="store_true", help="skip examples/vllm/grpo.py")
    parser.add_argument(
        "--only", choices=["qwen"], help="run only this step (qwen: the Qwen2 checks)"
    )
    options = parser.parse_args()
    folder = options.keep or Path(tempfile.mkdtemp(prefix="trio-rollouts-vllm-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        main(folder, not options.no_grpo, options.only)
    except (CheckFailed, urllib.error.URLError) as failure:
        for log in sorted(folder.glob("server-*.log")):
            print(f"\n--- {log.name} (last lines):\n{tail(log)}", file=sys.stderr)
        sys.exit(f"vllm check FAILED: {failure}")
    finally:
        if options.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
