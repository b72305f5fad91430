"""Calibrate ``EngineModel``'s step time against the real vLLM on this machine's CPU.

The simulated engine's step time is ``base + per_prefill_token * prefilled +
per_decode_seq * running`` (seconds per engine step). This script measures the *shape*
of that cost on vLLM itself (the CPU build in the ``nox -s vllm`` venv, with the same tiny
random Llama as ``run.py``), fits the three coefficients by least squares and writes
everything to ``docs/_data/engine_calibration.json``, together with a GPU preset taken
from a published profile (:func:`gpu_preset`, not measured here).

It starts ONE server, bound to one core (``VLLM_CPU_OMP_THREADS_BIND``, core 1 by
default; that binds the model worker only: the API server and engine-core processes
float, and the JSON records what each used), with vLLM's CPU defaults for the scheduler
(``max_num_seqs``, ``max_num_batched_tokens``, block size, prefix caching: none given),
``--max-model-len 2048`` (the built model's ``max_position_embeddings`` is raised to 2048
in its ``config.json``: RoPE, nothing learned depends on it) so that a 1024-token prompt
fits, and ``run.py``'s ``--enforce-eager --dtype float32`` and environment. Then:

1. **decode**: for B in 1, 2, 4, 8, 16, 32, B concurrent ``/v1/completions`` of distinct
   16-token id prompts, ``max_tokens=64``, ``ignore_eos``, temperature 0, sent while the
   scheduler is paused (``/pause?mode=keep``, then ``/resume``: ``VLLM_SERVER_DEV_MODE``)
   so that all B are admitted in one step (checked: 64 engine iterations); the step time
   is vLLM's own ``vllm:request_decode_time_seconds`` (first to last token, engine-core
   timestamps) / 63, per request, averaged (sum/count deltas of ``/metrics``), beside the
   client's wall / 64; each round is repeated without the pause, for comparison;
2. **prefill**: for P in 64 ... 1024, one request at a time, ``max_tokens=1``, random ids
   (a new first token each time: no prefix-cache hit, which is checked); the prefill
   time is ``vllm:request_prefill_time_seconds`` (scheduled to first token), beside
   ``vllm:time_to_first_token_seconds`` and the client's wall;
3. **fit**: ``base`` and ``per_decode_seq`` from the decode step times (a line in B),
   ``per_prefill_token`` from the prefill times (a line in P), through the fastest
   repeat of each point (the machine is shared; the medians' fit is written beside it),
   and a joint fit over both sets, also with a fourth, per-prefill-step term;
4. **prefix cache**: the same 256-token prompt twice (and a 257-token one twice), reading
   ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` deltas, and
   ``vllm:cache_config_info`` (block size, KV blocks) and the startup log (KV capacity,
   scheduler defaults).

Always stops the server (SIGTERM to its process group, then SIGKILL: ``run.stop``).

    .nox/vllm/bin/python tools/vllm/calibrate_engine.py [--core 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import importlib.util
import itertools
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).parent
# As run.py does: this folder, then real_server's before it (the `run` imported is
# real_server's); tools/vllm/run.py itself is loaded under another name below.
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "real_server"))
from build_tiny_llama import build  # noqa: E402
from checks import VLLM  # noqa: E402
from run import CheckFailed, check, step, tail  # noqa: E402


def _load_vllm_run() -> Any:
    """tools/vllm/run.py as a module (its name, ``run``, is real_server's here)."""
    spec = importlib.util.spec_from_file_location("vllm_run", HERE / "run.py")
    if spec is None or spec.loader is None:
        raise ImportError(HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vllm_run = _load_vllm_run()
stop = vllm_run.stop
wait_until_ready = vllm_run.wait_until_ready
VLLM_ENV: dict[str, str] = vllm_run.VLLM_ENV

OUT = HERE.parents[1] / "docs" / "_data" / "engine_calibration.json"
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
PROMPT_LENGTHS = (64, 128, 256, 512, 1024)
DECODE_PROMPT = 16
DECODE_TOKENS = 64
#: Seconds the scheduler stays paused while a round's calls arrive: this plus this per call.
ARRIVAL_WAIT = 0.3
ARRIVAL_WAIT_PER_CALL = 0.01
MAX_MODEL_LEN = 2048
#: Byte tokens only (the vocabulary's 256 bytes; the specials above them are left out).
VOCAB = 256

#: The GPU preset's source: DistServe's (OSDI'24, arXiv 2401.09670) published per-step
#: profile of **vLLM** serving OPT-13B (fp16, TP=1) on one A100-80GB SXM, fitted by
#: least squares on batches of identical requests (B 1..192, prompt 4..2020 tokens,
#: evaluation/0-test-single-forward-performance + evaluation/1-fit-time-usage). In ms:
#: prefill step = a + b * sum(prompt tokens) + c * sum(prompt tokens ** 2);
#: decode step = a + b * sum(context tokens of the batch) + c * B (B < 95).
DISTSERVE_VLLM_OPT13B_A100 = {
    "prefill": (22.052204789310185, 0.14050923870128956, 8.076584822611088e-06),
    "decoding_smallbs": (23.475041008414784, 0.000592934466077393, 0.060726861260369455),
    "decoding_largebs": (20.206356173691958, 0.0004907727036234946, 0.1200031385587413),
}
#: The context length (tokens per running sequence) and prompt length at which the
#: GPU profile's context and quadratic terms are folded into EngineModel's two slopes.
GPU_REFERENCE_CONTEXT = 512
GPU_REFERENCE_PROMPT = 512


def gpu_preset() -> dict[str, Any]:
    """EngineModel's coefficients (seconds) from :data:`DISTSERVE_VLLM_OPT13B_A100`."""
    pa, pb, pc = DISTSERVE_VLLM_OPT13B_A100["prefill"]
    da, db, dc = DISTSERVE_VLLM_OPT13B_A100["decoding_smallbs"]
    per_decode_seq_ms = dc + db * GPU_REFERENCE_CONTEXT
    per_prefill_token_ms = pb + pc * GPU_REFERENCE_PROMPT
    return {
        "name": "vllm-opt-13b-a100-80gb",
        "model": "facebook/opt-13b, fp16, tensor parallel 1",
        "gpu": "NVIDIA A100-80GB SXM",
        "engine": "vLLM (2024, block size 16), LLM.generate with per-step timing",
        "source": {
            "paper": "Zhong et al., DistServe: Disaggregating Prefill and Decoding for "
            "Goodput-optimized Large Language Model Serving, OSDI 2024, "
            "https://arxiv.org/abs/2401.09670",
            "profile": "https://github.com/LLMServe/DistServe/blob/"
            "82831f1604cc6b10bebd360f6c437a07790dde9f/simdistserve/estimators/profile_data/"
            "profiler-a100-80g.vllm.json (last changed in 4c68ed9, 2024-05-01)",
            "model_of_the_profile": "https://github.com/LLMServe/DistServe/blob/"
            "82831f1604cc6b10bebd360f6c437a07790dde9f/simdistserve/estimators/"
            "time_estimator.py; fit: evaluation/1-fit-time-usage/main.py; measurement: "
            "evaluation/0-test-single-forward-performance (sut/sut_vllm.py)",
            "figures_ms": {k: list(v) for k, v in DISTSERVE_VLLM_OPT13B_A100.items()},
        },
        "derivation": {
            "base": f"decode intercept a = {da:.4f} ms",
            "per_decode_seq": f"c + b * L = {dc:.6f} + {db:.9f} * {GPU_REFERENCE_CONTEXT} "
            f"= {per_decode_seq_ms:.6f} ms (L = context tokens per running sequence; the "
            "profile charges KV reads per context token, EngineModel per sequence)",
            "per_prefill_token": f"b + c * P = {pb:.6f} + {pc:.4e} * {GPU_REFERENCE_PROMPT} "
            f"= {per_prefill_token_ms:.6f} ms ({1000 / per_prefill_token_ms:.0f} tokens/s; "
            "P = prompt length; the quadratic term is attention)",
            "prefill_intercept_ms": pa,
            "decode_step_at_B1_L512_ms": da + per_decode_seq_ms,
            "prefill_1024_ms": pa + pb * 1024 + pc * 1024**2,
        },
        "coefficients": {
            "base": da / 1000,
            "per_decode_seq": per_decode_seq_ms / 1000,
            "per_prefill_token": per_prefill_token_ms / 1000,
        },
    }


# ------------------------------------------------------------------ the server


def launch(
    model_dir: Path, log_path: Path, core: str
) -> tuple[subprocess.Popen[bytes], str, list[str]]:
    """vLLM's OpenAI server as run.py starts it, but with the scheduler's CPU defaults
    (no ``--max-num-seqs``: B goes to 32) and ``--max-model-len 2048``."""
    scheduler = ["--max-model-len", str(MAX_MODEL_LEN)]
    server, root = vllm_run.launch(model_dir, log_path, [], core, scheduler)
    return server, root, [*scheduler, "--enforce-eager", "--dtype", "float32"]


@contextlib.contextmanager
def serving(model_dir: Path, work: Path, core: str) -> Iterator[tuple[VLLM, Path, list[str], int]]:
    """The server for the block: its client, log, flags and process group."""
    log_path = work / "server.log"
    server, root, flags = launch(model_dir, log_path, core)
    try:
        wait_until_ready(server, root, str(model_dir), log_path)
        yield VLLM(root=root, model=str(model_dir)), log_path, flags, server.pid
    finally:
        stop(server)


def group_processes(pgid: int) -> dict[int, dict[str, Any]]:
    """The server's processes (its process group): name, allowed cores, CPU seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, dict[str, Any]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:  # fields[0] is the state: pgrp is the 5th field
                continue
            status = (entry / "status").read_text()
            allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.MULTILINE)
            found[int(entry.name)] = {
                "name": stat[stat.index("(") + 1 : stat.rindex(")")],
                "cpus_allowed": allowed.group(1) if allowed else "?",
                "cpu_s": (int(fields[11]) + int(fields[12])) / ticks,
                "threads": int(fields[17]),
            }
    return found


def cpu_used(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    return [
        {**info, "cpu_s": round(info["cpu_s"] - before.get(pid, {"cpu_s": 0.0})["cpu_s"], 2)}
        for pid, info in sorted(after.items())
    ]


def server_info(vllm: VLLM) -> dict[str, Any]:
    """The scheduler and cache config the server runs with (``/server_info``, dev mode)."""
    try:
        with urllib.request.urlopen(  # loopback only
            f"{vllm.root}/server_info?config_format=json", timeout=120
        ) as reply:
            config = json.load(reply)["vllm_config"]
    except (OSError, ValueError, KeyError) as error:
        return {"error": repr(error)}
    scheduler = config.get("scheduler_config", {})
    cache = config.get("cache_config", {})
    keep_scheduler = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_chunked_prefill",
        "async_scheduling",
        "policy",
        "long_prefill_token_threshold",
        "max_num_partial_prefills",
    )
    keep_cache = (
        "block_size",
        "enable_prefix_caching",
        "num_gpu_blocks",
        "kv_cache_memory_bytes",
        "prefix_caching_hash_algo",
        "cache_dtype",
    )
    return {
        "scheduler_config": {k: scheduler[k] for k in keep_scheduler if k in scheduler},
        "cache_config": {k: cache[k] for k in keep_cache if k in cache},
    }


# ------------------------------------------------------------------ /metrics

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? (\S+)$")


def snapshot(vllm: VLLM) -> dict[str, float]:
    """Every series of ``/metrics`` summed over its labels (buckets left out)."""
    totals: dict[str, float] = {}
    for line in vllm.get_text("/metrics").splitlines():
        found = _LINE.match(line)
        if found is None or found.group(1).endswith("_bucket"):
            continue
        totals[found.group(1)] = totals.get(found.group(1), 0.0) + float(found.group(3))
    return totals


def settled(vllm: VLLM, before: dict[str, float], finished: int) -> dict[str, float]:
    """``/metrics`` once ``finished`` more requests are counted and two reads agree
    (the counters lag the responses by a moment)."""
    deadline = time.monotonic() + 30.0
    last: dict[str, float] | None = None
    while time.monotonic() < deadline:
        now = snapshot(vllm)
        done = delta(before, now, "vllm:request_success_total")
        keys = (
            "vllm:request_success_total",
            "vllm:iteration_tokens_total_count",
            "vllm:inter_token_latency_seconds_count",
        )
        if done >= finished and last is not None and all(now.get(k) == last.get(k) for k in keys):
            return now
        last = now
        time.sleep(0.15)
    raise CheckFailed(f"/metrics did not count {finished} finished requests within 30 s")


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def mean_of(before: dict[str, float], after: dict[str, float], histogram: str) -> float:
    count = delta(before, after, f"{histogram}_count")
    return delta(before, after, f"{histogram}_sum") / count if count else float("nan")


def cache_config_info(vllm: VLLM) -> dict[str, str]:
    text = vllm.get_text("/metrics")
    found = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.MULTILINE)
    if found is None:
        return {}
    return dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))


# ------------------------------------------------------------------ requests


def complete(vllm: VLLM, prompt: Sequence[int], max_tokens: int) -> tuple[float, dict[str, Any]]:
    body = {
        "model": vllm.model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    reply = vllm.post("/v1/completions", body)
    wall = time.perf_counter() - started
    usage = reply["usage"]
    check(usage["completion_tokens"] == max_tokens, f"{usage} instead of {max_tokens} tokens")
    check(usage["prompt_tokens"] == len(prompt), f"{usage} for a {len(prompt)}-token prompt")
    return wall, usage


class Prompts:
    """Random byte-token prompts whose first token never repeats in a run (so no two
    share a prefix-cache block), unless asked for the same one again."""

    def __init__(self, seed: int = 0) -> None:
        self.random = random.Random(seed)
        self.firsts = list(range(VOCAB))
        self.random.shuffle(self.firsts)
        self.used = 0

    def new(self, length: int) -> list[int]:
        if self.used == len(self.firsts):
            self.used = 0  # 256 first tokens used: the rest of the prompt is random
        first = self.firsts[self.used]
        self.used += 1
        return [first, *(self.random.randrange(VOCAB) for _ in range(length - 1))]


def decode_round(
    vllm: VLLM, prompts: Prompts, batch: int, *, together: bool = True
) -> dict[str, Any]:
    """``batch`` concurrent calls of DECODE_TOKENS tokens; what vLLM and the client saw.

    ``together``: the scheduler is paused (``/pause?mode=keep``) while the calls arrive
    and resumed :data:`ARRIVAL_WAIT` later, so that they are admitted in one step and
    decode together. Without it, calls the API server takes a moment to pass on are
    admitted steps apart, and fewer than ``batch`` may run at once. (While paused the
    engine does not step, so ``/metrics`` cannot say when all have arrived: the round is
    checked afterwards instead, ``clean``.)"""
    bodies = [prompts.new(DECODE_PROMPT) for _ in range(batch)]
    before = snapshot(vllm)
    with concurrent.futures.ThreadPoolExecutor(max_workers=batch) as pool:
        if together:
            vllm.post("/pause?mode=keep&clear_cache=false")
        try:
            futures = [pool.submit(complete, vllm, prompt, DECODE_TOKENS) for prompt in bodies]
            if together:
                time.sleep(ARRIVAL_WAIT + ARRIVAL_WAIT_PER_CALL * batch)
            started = time.perf_counter()
        finally:
            if together:
                vllm.post("/resume")
        results = [future.result() for future in futures]
    wall = time.perf_counter() - started
    after = settled(vllm, before, batch)
    iterations = delta(before, after, "vllm:iteration_tokens_total_count")
    return {
        "B": batch,
        "together": together,
        # Admitted in one step: one prefill step, then DECODE_TOKENS - 1 decode steps.
        "clean": iterations <= DECODE_TOKENS,
        # vLLM's engine-core timestamps: first to last token of each request, per step.
        "decode_step_s": mean_of(before, after, "vllm:request_decode_time_seconds")
        / (DECODE_TOKENS - 1),
        "inter_token_latency_s": mean_of(before, after, "vllm:inter_token_latency_seconds"),
        "itl_observations": delta(before, after, "vllm:inter_token_latency_seconds_count"),
        "prefill_time_s": mean_of(before, after, "vllm:request_prefill_time_seconds"),
        "client_wall_s": wall,
        "client_wall_per_token_s": wall / DECODE_TOKENS,
        "client_mean_request_s": statistics.fmean(r[0] for r in results),
        "iterations": iterations,
        "tokens_per_iteration": mean_of(before, after, "vllm:iteration_tokens_total"),
        "generation_tokens": delta(before, after, "vllm:generation_tokens_total"),
        "preemptions": delta(before, after, "vllm:num_preemptions_total"),
    }


def prefill_round(vllm: VLLM, prompts: Prompts, length: int) -> dict[str, float]:
    """One call of a ``length``-token prompt and ``max_tokens=1``."""
    prompt = prompts.new(length)
    before = snapshot(vllm)
    wall, _ = complete(vllm, prompt, 1)
    after = settled(vllm, before, 1)
    return {
        "P": length,
        "prefill_time_s": mean_of(before, after, "vllm:request_prefill_time_seconds"),
        "ttft_s": mean_of(before, after, "vllm:time_to_first_token_seconds"),
        "queue_time_s": mean_of(before, after, "vllm:request_queue_time_seconds"),
        "client_wall_s": wall,
        "iterations": delta(before, after, "vllm:iteration_tokens_total_count"),
        "prefix_cache_hits": delta(before, after, "vllm:prefix_cache_hits_total"),
        "prefix_cache_queries": delta(before, after, "vllm:prefix_cache_queries_total"),
    }


def prefix_cache_probe(vllm: VLLM, prompts: Prompts, length: int) -> list[dict[str, float]]:
    """The same ``length``-token prompt sent twice: what each send counted."""
    prompt = prompts.new(length)
    sends = []
    for send in (1, 2):
        before = snapshot(vllm)
        complete(vllm, prompt, 1)
        after = settled(vllm, before, 1)
        sends.append(
            {
                "prompt_tokens": length,
                "send": send,
                "queries": delta(before, after, "vllm:prefix_cache_queries_total"),
                "hits": delta(before, after, "vllm:prefix_cache_hits_total"),
                "prompt_tokens_cached": delta(before, after, "vllm:prompt_tokens_cached_total"),
                "prompt_tokens_counted": delta(before, after, "vllm:prompt_tokens_total"),
                "prefill_time_s": mean_of(before, after, "vllm:request_prefill_time_seconds"),
            }
        )
    return sends


# ------------------------------------------------------------------ fitting


def fit_line(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """``y = intercept + slope * x`` by least squares, with R² and the worst residual."""
    design = np.column_stack([np.ones(len(x)), np.asarray(x, dtype=float)])
    target = np.asarray(y, dtype=float)
    (intercept, slope), *_ = np.linalg.lstsq(design, target, rcond=None)
    predicted = design @ np.array([intercept, slope])
    residual = target - predicted
    total = float(((target - target.mean()) ** 2).sum())
    return {
        "intercept": float(intercept),
        "slope": float(slope),
        "r2": 1.0 - float((residual**2).sum()) / total if total else float("nan"),
        "max_abs_relative_residual": float(np.max(np.abs(residual) / target)),
    }


def fit_quadratic(x: Sequence[float], y: Sequence[float]) -> dict[str, float]:
    """``y = a + b * x + c * x**2``: how far from a line the decode step is."""
    c, b, a = np.polyfit(np.asarray(x, dtype=float), np.asarray(y, dtype=float), 2)
    return {"a": float(a), "b": float(b), "c": float(c)}


def marginal_slopes(rows: Sequence[dict[str, float]], x: str, y: str) -> list[dict[str, float]]:
    """The slope between consecutive points: (y2 - y1) / (x2 - x1)."""
    return [
        {"from": one[x], "to": two[x], "slope": (two[y] - one[y]) / (two[x] - one[x])}
        for one, two in itertools.pairwise(rows)
    ]


def fit_joint(
    decode: Sequence[dict[str, Any]], prefill: Sequence[dict[str, Any]], suffix: str = ""
) -> dict[str, Any]:
    """All three coefficients at once: a decode step is (prefilled 0, running B), a
    prefill (one step here) is (prefilled P, running 0). ``suffix``: "_min" fits the
    fastest repeats."""
    rows = [(1.0, 0.0, row["B"]) for row in decode] + [(1.0, row["P"], 0.0) for row in prefill]
    target = [row[f"decode_step_s{suffix}"] for row in decode] + [
        row[f"prefill_time_s{suffix}"] for row in prefill
    ]
    coefficients, *_ = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)
    base, per_prefill_token, per_decode_seq = (float(c) for c in coefficients)
    # The same with a fourth term, 1 for a step that prefills: what a prefill step costs
    # beyond base whatever its length.
    rows4 = [(*row, 0.0 if row[1] == 0.0 else 1.0) for row in rows]
    four, *_ = np.linalg.lstsq(np.array(rows4), np.array(target), rcond=None)
    return {
        "three_terms": {
            "base": base,
            "per_prefill_token": per_prefill_token,
            "per_decode_seq": per_decode_seq,
        },
        "with_prefill_step_term": dict(
            zip(
                ("base", "per_prefill_token", "per_decode_seq", "per_prefill_step"),
                (float(c) for c in four),
                strict=True,
            )
        ),
    }


def medians(rounds: list[dict[str, Any]], key: str, measure: str) -> list[dict[str, Any]]:
    """Per value of ``key``, the median of every measured number over the repeats, the
    minimum of ``measure`` (load from elsewhere only ever adds time) and how many repeats;
    for decode, only the rounds admitted in one step when there are any."""
    grouped: dict[float, list[dict[str, Any]]] = {}
    for row in rounds:
        grouped.setdefault(row[key], []).append(row)
    summary = []
    for value, rows in sorted(grouped.items()):
        kept = [row for row in rows if row.get("clean", True)] or rows
        numbers = [name for name, v in kept[0].items() if not isinstance(v, bool)]
        summary.append(
            {name: statistics.median(row[name] for row in kept) for name in numbers}
            | {
                key: value,
                f"{measure}_min": min(row[measure] for row in kept),
                "repeats": len(kept),
                "left_out": len(rows) - len(kept),
            }
        )
    return summary


# ------------------------------------------------------------------ the log

LOG_PATTERNS = (
    "non-default args",
    "KV cache size",
    "for KV cache",
    "core ids=",
    "VLLM_CPU_OMP_THREADS_BIND=",
    "Torch threads",
    "Chunked prefill",
    "chunked prefill",
    "prefix caching",
)


def log_facts(log_path: Path) -> dict[str, Any]:
    """What the startup log says about the KV cache, the cores and the engine config."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace"))
    lines = [
        line.strip()[:400]
        for line in text.splitlines()
        if any(pattern in line for pattern in LOG_PATTERNS)
    ]
    facts: dict[str, Any] = {"lines": lines[:20]}
    if found := re.search(r"KV cache size: ([\d,]+) tokens", text):
        facts["kv_cache_tokens"] = int(found.group(1).replace(",", ""))
    if found := re.search(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text):
        facts["max_concurrency"] = {
            "tokens_per_request": int(found.group(1).replace(",", "")),
            "requests": float(found.group(2)),
        }
    if config := re.search(r"with config: (.*)$", text, re.MULTILINE):
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "max_seq_len", "dtype"):
            if found := re.search(rf"\b{name}=([^,]+)", config.group(1)):
                facts[name] = found.group(1)
    return facts


# ------------------------------------------------------------------ main


def print_decode(row: dict[str, Any]) -> None:
    print(
        f"B={row['B']:>2}: decode step {row['decode_step_s'] * 1e3:7.2f} ms, "
        f"ITL {row['inter_token_latency_s'] * 1e3:7.2f} ms, wall/64 "
        f"{row['client_wall_per_token_s'] * 1e3:7.2f} ms, {row['iterations']:.0f} "
        f"iterations, {row['tokens_per_iteration']:.2f} tokens each"
        + ("" if row["together"] else " [no pause]")
        + ("" if row["clean"] else " (NOT admitted in one step)"),
        flush=True,
    )


def print_table(title: str, rows: Sequence[dict[str, float]], columns: Sequence[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>22}" for c in columns))
    for row in rows:
        cells = []
        for c in columns:
            value = row[c]
            cells.append(f"{value:>22.6g}" if isinstance(value, float) else f"{value:>22}")
        print("  ".join(cells))


def main(work: Path, core: str, repeats_decode: int, repeats_prefill: int, out: Path) -> None:
    started = time.monotonic()
    load_before = os.getloadavg()
    step("build a tiny random Llama (offline; 2 heads of 32), max positions 2048")
    model_dir = build(work / "tiny-llama", heads=2)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN  # RoPE: nothing learned depends on it
    config_path.write_text(json.dumps(config, indent=2))

    step(f"start one vLLM server on core {core}")
    prompts = Prompts()
    with serving(model_dir, work, core) as (vllm, log_path, flags, pgid):
        startup = time.monotonic() - started
        info = cache_config_info(vllm)
        print("cache_config_info:", json.dumps(info))
        served = server_info(vllm)
        print("server_info:", json.dumps(served))
        processes_before = group_processes(pgid)
        decode_started = time.monotonic()

        step("decode: B concurrent calls of 64 tokens, admitted together (paused, resumed)")
        for batch in BATCH_SIZES:
            decode_round(vllm, prompts, batch)  # warm-up, not kept
        decode_rounds: list[dict[str, Any]] = []
        free_rounds: list[dict[str, Any]] = []
        # Round-robin over B, each round then the same without the pause (the calls
        # admitted as the API server passes them on): load from elsewhere spreads over all.
        for _ in range(repeats_decode):
            for batch in BATCH_SIZES:
                for rounds, together in ((decode_rounds, True), (free_rounds, False)):
                    row = decode_round(vllm, prompts, batch, together=together)
                    rounds.append(row)
                    print_decode(row)

        decode_wall = time.monotonic() - decode_started
        decode_cpu = cpu_used(processes_before, group_processes(pgid))
        print(f"CPU seconds per server process over the decode phase ({decode_wall:.1f} s):")
        for process in decode_cpu:
            print("   ", json.dumps(process))

        step("prefill: one call at a time, max_tokens=1")
        for length in PROMPT_LENGTHS:
            prefill_round(vllm, prompts, length)  # warm-up, not kept
        prefill_rounds = []
        for _ in range(repeats_prefill):
            for length in PROMPT_LENGTHS:
                row = prefill_round(vllm, prompts, length)
                prefill_rounds.append(row)
                print(
                    f"P={length:>4}: prefill {row['prefill_time_s'] * 1e3:7.2f} ms, TTFT "
                    f"{row['ttft_s'] * 1e3:7.2f} ms, wall {row['client_wall_s'] * 1e3:7.2f} ms, "
                    f"queue {row['queue_time_s'] * 1e3:5.2f} ms, {row['iterations']:.0f} "
                    f"iteration(s), hits {row['prefix_cache_hits']:.0f}",
                    flush=True,
                )
        check(
            all(row["prefix_cache_hits"] == 0 for row in prefill_rounds),
            "a prefill measurement hit the prefix cache",
        )

        step("prefix cache: the same prompt twice")
        probes = prefix_cache_probe(vllm, prompts, 256) + prefix_cache_probe(vllm, prompts, 257)
        for probe in probes:
            print(json.dumps(probe))
        info = cache_config_info(vllm) or info
        block = int(info.get("block_size", "0") or 0)
        for probe in probes:
            tokens = int(probe["prompt_tokens"])
            expected = 0 if probe["send"] == 1 else (tokens - 1) // block * block if block else 0
            check(
                probe["hits"] == expected and probe["queries"] == tokens,
                f"prefix cache counted {probe}, not {expected} hits of {tokens} queries",
            )
    load_after = os.getloadavg()
    facts = log_facts(log_path)
    shutil.copy(log_path, work / "server-kept.log")

    decode = medians(decode_rounds, "B", "decode_step_s")
    free = medians(free_rounds, "B", "decode_step_s")
    prefill = medians(prefill_rounds, "P", "prefill_time_s")
    decode_columns = [
        "B",
        "decode_step_s",
        "decode_step_s_min",
        "client_wall_per_token_s",
        "iterations",
        "tokens_per_iteration",
        "repeats",
        "left_out",
    ]
    print_table("decode, admitted together (medians of clean rounds; seconds)", decode,
                decode_columns)  # fmt: skip
    print_table("decode, admitted as they come (no pause; medians; seconds)", free,
                decode_columns)  # fmt: skip
    print_table(
        "prefill (medians over repeats; seconds)",
        prefill,
        ["P", "prefill_time_s", "prefill_time_s_min", "ttft_s", "queue_time_s",
         "client_wall_s", "iterations"],
    )  # fmt: skip

    decode_fit = fit_line([r["B"] for r in decode], [r["decode_step_s"] for r in decode])
    decode_min_fit = fit_line([r["B"] for r in decode], [r["decode_step_s_min"] for r in decode])
    free_fit = fit_line([r["B"] for r in free], [r["decode_step_s"] for r in free])
    prefill_fit = fit_line([r["P"] for r in prefill], [r["prefill_time_s"] for r in prefill])
    prefill_min_fit = fit_line(
        [r["P"] for r in prefill], [r["prefill_time_s_min"] for r in prefill]
    )
    ttft_fit = fit_line([r["P"] for r in prefill], [r["ttft_s"] for r in prefill])
    joint = fit_joint(decode, prefill)
    joint_min = fit_joint(decode, prefill, "_min")
    quadratic = fit_quadratic([r["B"] for r in decode], [r["decode_step_s"] for r in decode])
    decode_marginal = marginal_slopes(decode, "B", "decode_step_s")
    prefill_marginal = marginal_slopes(prefill, "P", "prefill_time_s")
    # The machine is shared (another engineer's server and tests run beside this one):
    # load from elsewhere only ever adds time, so the coefficients come from the fastest
    # repeat of each point; the medians' fit is kept beside them.
    coefficients = {
        "base": decode_min_fit["intercept"],
        "per_decode_seq": decode_min_fit["slope"],
        "per_prefill_token": prefill_min_fit["slope"],
        "per_prefill_step_extra": joint_min["with_prefill_step_term"]["per_prefill_step"],
    }
    coefficients_median = {
        "base": decode_fit["intercept"],
        "per_decode_seq": decode_fit["slope"],
        "per_prefill_token": prefill_fit["slope"],
        "per_prefill_step_extra": joint["with_prefill_step_term"]["per_prefill_step"],
    }
    print("\nfit: decode step(B) =", json.dumps(decode_fit))
    print("fit: decode min(B)   =", json.dumps(decode_min_fit))
    print("fit: no-pause step(B)=", json.dumps(free_fit))
    print("fit: prefill min(P)  =", json.dumps(prefill_min_fit))
    print("fit: prefill(P)      =", json.dumps(prefill_fit))
    print("fit: TTFT(P)         =", json.dumps(ttft_fit))
    print("fit: joint           =", json.dumps(joint))
    print("fit: decode step(B) quadratic =", json.dumps(quadratic))
    print(
        "marginal decode slope per sequence:",
        ", ".join(
            f"B {m['from']:.0f}->{m['to']:.0f}: {m['slope'] * 1e6:.1f} us" for m in decode_marginal
        ),
    )
    print(
        "marginal prefill slope per token:",
        ", ".join(
            f"P {m['from']:.0f}->{m['to']:.0f}: {m['slope'] * 1e6:.2f} us" for m in prefill_marginal
        ),
    )
    preset = gpu_preset()
    print("GPU preset           =", json.dumps(preset["coefficients"]))
    print("GPU preset derivation:", json.dumps(preset["derivation"], indent=1))
    print("fit: joint (min)     =", json.dumps(joint_min))
    print("coefficients (CPU, fastest repeats) =", json.dumps(coefficients))
    print("coefficients (CPU, medians)         =", json.dumps(coefficients_median))

    import torch
    import vllm as vllm_package

    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    result = {
        "what": "EngineModel step time = base + per_prefill_token * prefilled + "
        "per_decode_seq * running (seconds per engine step)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "script": "tools/vllm/calibrate_engine.py",
        "vllm_version": vllm_package.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "machine": {
            "cores": os.cpu_count(),
            "cpu": cpu_model,
            "server_core": core,
            "binding": f"VLLM_CPU_OMP_THREADS_BIND={core}: binds the model worker process "
            "(VLLM::Worker) only; the API server and the engine-core (scheduler) processes may "
            "run on any core (see server.decode_phase_cpu)",
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "model": {
            "kind": "tiny random Llama (tools/real_server/build_tiny_llama.py, heads=2)",
            **{
                k: config[k]
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "vocab_size",
                    "max_position_embeddings",
                    "torch_dtype",
                )
                if k in config
            },
        },
        "server": {
            "command": "python -m vllm.entrypoints.openai.api_server --model DIR --host "
            f"127.0.0.1 --port N {' '.join(flags)}",
            "env": {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": core},
            "startup_s": round(startup, 1),
            "cache_config_info": info,
            "server_info": served,
            "log": facts,
            "decode_phase_cpu": {"wall_s": round(decode_wall, 2), "processes": decode_cpu},
            "cpu_defaults_in_source": {
                "where": "vllm/engine/arg_utils.py EngineArgs.get_batch_defaults, "
                "current_platform.is_cpu(); vllm/platforms/cpu.py block size",
                "max_num_seqs": {"openai_api_server": 128, "llm_class": 256},
                "max_num_batched_tokens": {"openai_api_server": 2048, "llm_class": 4096},
                "block_size": 128,
            },
        },
        "method": {
            "decode": f"B concurrent /v1/completions, distinct {DECODE_PROMPT}-token id prompts, "
            f"max_tokens={DECODE_TOKENS}, ignore_eos, temperature 0, sent while the scheduler "
            "is paused (/pause?mode=keep&clear_cache=false) and resumed "
            f"{ARRIVAL_WAIT} s + {ARRIVAL_WAIT_PER_CALL} s per call later, so that they are "
            "admitted in one step (a round is clean when it took at most "
            f"{DECODE_TOKENS} engine iterations; only clean rounds are kept); one warm-up round "
            f"per B, then {repeats_decode} round-robin passes over B; decode_step_s = delta "
            f"sum/count of vllm:request_decode_time_seconds / {DECODE_TOKENS - 1} (engine-core "
            "timestamps, first to last token; vllm:inter_token_latency_seconds is the same "
            f"number); each round is followed by the same without the pause",
            "prefill": "one request at a time, max_tokens=1, random ids with a new first "
            f"token (no prefix-cache hit, checked); one warm-up per P, then {repeats_prefill} "
            "round-robin passes; prefill_time_s = delta of vllm:request_prefill_time_seconds "
            "(scheduled to first token: one engine step here, the prompt fits "
            "max_num_batched_tokens)",
            "fit": "numpy least squares: base and per_decode_seq are the intercept and slope "
            "of decode_step_s in B; per_prefill_token is the slope of prefill_time_s in P; "
            "fit.cpu uses the fastest repeat of each point (*_min), fit.cpu_from_medians the "
            "medians; joint = all three over both sets at once (and with a fourth, "
            "per-prefill-step term)",
            "load": "the machine is shared: load averages before and after are recorded",
        },
        "measurements": {
            "decode": decode,
            "prefill": prefill,
            "decode_without_pause": free,
            "decode_rounds": decode_rounds,
            "decode_rounds_without_pause": free_rounds,
            "prefill_rounds": prefill_rounds,
        },
        "fit": {
            "cpu": coefficients,
            "cpu_from_medians": coefficients_median,
            "cpu_note": "cpu: base and per_decode_seq from the line through the fastest "
            "repeat of each B, per_prefill_token from the line through the fastest repeat of "
            "each P (the machine is shared: load from elsewhere only adds time); "
            "per_prefill_step_extra (not in EngineModel's formula) is what a step that "
            "prefills costs beyond base whatever its length, from the joint four-term fit",
            "decode_step_vs_B": decode_fit,
            "decode_step_min_vs_B": decode_min_fit,
            "decode_step_vs_B_without_pause": free_fit,
            "prefill_min_vs_P": prefill_min_fit,
            "prefill_vs_P": prefill_fit,
            "ttft_vs_P": ttft_fit,
            "joint": joint,
            "joint_min": joint_min,
            "decode_step_vs_B_quadratic": quadratic,
            "decode_marginal_slopes": decode_marginal,
            "prefill_marginal_slopes": prefill_marginal,
            "prefill_intercept_minus_base_s": prefill_min_fit["intercept"]
            - decode_min_fit["intercept"],
        },
        "prefix_cache": {
            "probes": probes,
            "block_size": info.get("block_size"),
            "enable_prefix_caching": info.get("enable_prefix_caching"),
            "how_counted": "in tokens: vllm:prefix_cache_queries_total grows by the prompt's "
            "length on every request, vllm:prefix_cache_hits_total (and "
            "vllm:prompt_tokens_cached_total) by the tokens read from the cache, which are "
            "whole blocks of block_size and at most P - 1 tokens (the last prompt token is "
            "always computed, for its logits): hits = floor((P - 1) / block_size) * "
            "block_size, so 128 of 256 and 256 of 257 with blocks of 128 (checked)",
        },
        "gpu_preset": preset,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {out} ({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", default="1", help="VLLM_CPU_OMP_THREADS_BIND (default 1)")
    parser.add_argument("--keep", type=Path, help="work in this folder and leave it there")
    parser.add_argument("--decode-repeats", type=int, default=7)
    parser.add_argument("--prefill-repeats", type=int, default=11)
    parser.add_argument("--out", type=Path, default=OUT)
    options = parser.parse_args()
    folder = options.keep or Path(tempfile.mkdtemp(prefix="trio-rollouts-calibrate-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        main(folder, options.core, options.decode_repeats, options.prefill_repeats, options.out)
    except CheckFailed as failure:
        for log in sorted(folder.glob("server*.log")):
            print(f"\n--- {log.name} (last lines):\n{tail(log)}", file=sys.stderr)
        sys.exit(f"calibration FAILED: {failure}")
    finally:
        if options.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
