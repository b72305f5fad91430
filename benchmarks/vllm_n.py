"""What a GRPO group costs on a real vLLM: ``rollouts_per_group`` requests, or one with ``n``.

vLLM shares the prompt's prefill across the ``n`` choices of one request; separate
requests share it through the prefix cache instead (on by default). This measures
both on a running server, same prompts and lengths, all groups in flight at once, with
the server's own counters (``/metrics``) beside the wall time:

    python benchmarks/vllm_n.py --server-root http://127.0.0.1:8000 --model NAME

Each row is the median of ``--repeats`` runs; each run uses fresh prompts so that the
prefix cache holds nothing from an earlier one. Requests go through ``httpx2`` in both
arms, so the client costs the same per byte.
"""

from __future__ import annotations

import argparse
import functools
import re
import secrets
import statistics
import time
from typing import Any

import httpx2
import trio


def metric(client: httpx2.Client, name: str) -> float:
    text = client.get("/metrics").text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


async def run_arm(
    root: str, model: str, *, use_n: bool, groups: int, size: int, prompt_words: int, tokens: int
) -> dict[str, float]:
    prompts = [" ".join(secrets.token_hex(2) for _ in range(prompt_words)) for _ in range(groups)]
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "ignore_eos": True}
    body["logprobs"] = 1
    body["return_token_ids"] = True
    with httpx2.Client(base_url=root) as sync_client:
        before = {
            name: metric(sync_client, name)
            for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total")
        }
    generated = 0
    limits = httpx2.Limits(max_connections=groups * size)
    async with httpx2.AsyncClient(base_url=root, timeout=600, limits=limits) as client:

        async def one(prompt: str, n: int) -> None:
            nonlocal generated
            reply = await client.post("/v1/completions", json={**body, "prompt": prompt, "n": n})
            reply.raise_for_status()
            for choice in reply.json()["choices"]:
                generated += len(choice["token_ids"])

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                if use_n:
                    nursery.start_soon(one, prompt, size)
                else:
                    for _ in range(size):
                        nursery.start_soon(one, prompt, 1)
        seconds = time.perf_counter() - started
    with httpx2.Client(base_url=root) as sync_client:
        prompt_tokens = (
            metric(sync_client, "vllm:prompt_tokens_total") - before["vllm:prompt_tokens_total"]
        )
        cached = (
            metric(sync_client, "vllm:prefix_cache_hits_total")
            - before["vllm:prefix_cache_hits_total"]
        )
    if generated != groups * size * tokens:
        msg = f"{generated} tokens generated, not {groups * size * tokens}"
        raise RuntimeError(msg)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "computed": prompt_tokens - cached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-root", required=True, help="vLLM's URL, without /v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    print(
        f"{'prompt':>6} {'tokens':>6} {'group':>5}  {'arm':<12} {'seconds':>8} "
        f"{'prefill computed':>16} {'tokens/s':>9}"
    )
    for prompt_words, tokens, size in ((60, 16, 8), (60, 64, 8), (20, 16, 16)):
        rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for _ in range(options.repeats):
            for use_n in (False, True):
                arm = functools.partial(
                    run_arm,
                    options.server_root,
                    options.model,
                    use_n=use_n,
                    groups=options.groups,
                    size=size,
                    prompt_words=prompt_words,
                    tokens=tokens,
                )
                rows[use_n].append(trio.run(arm))
        for use_n, runs in rows.items():
            seconds = statistics.median(run["seconds"] for run in runs)
            computed = statistics.median(run["computed"] for run in runs)
            rate = options.groups * size * tokens / seconds
            arm = f"n={size}" if use_n else f"{size} requests"
            print(
                f"{prompt_words * 5:>6} {tokens:>6} {size:>5}  {arm:<12} {seconds:>8.2f} "
                f"{computed:>16.0f} {rate:>9.0f}"
            )
        ratio = statistics.median(r["seconds"] for r in rows[False]) / statistics.median(
            r["seconds"] for r in rows[True]
        )
        print(f"{'':>20} requests / n time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
