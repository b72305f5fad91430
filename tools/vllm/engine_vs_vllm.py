"""The engine model beside the real vLLM on one workload: prefix-cache hits, steps and
the order in which requests finish.

One vLLM 0.32 CPU server (as ``calibrate_engine.py`` starts it: vLLM's CPU scheduler
defaults, block size 128, one core) and ``EmbeddedInference(engine=EngineModel(...))``
with the same scheduler figures (block size 128, ``max_num_seqs`` 128,
``max_num_batched_tokens`` 2048) and the calibrated step costs
(``per_prefill_step=0.0019``) get the same requests: ``GROUPS`` groups of ``MEMBERS``
identical prompts (a 256-id prefix shared by all, then a 128-id question per group), each
request with its own ``max_tokens`` (``ignore_eos``), all admitted at once (sent while
vLLM's scheduler is paused, then resumed). The script prints, for both: prompt ids,
prefix-cache hits, engine steps, and the order in which the requests finished (and the
rank correlation between the two orders). ``docs/placement.md`` gives a run.

    .nox/vllm/bin/python tools/vllm/engine_vs_vllm.py [--core 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio
import trio.testing

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calibrate_engine import (  # noqa: E402
    ARRIVAL_WAIT,
    ARRIVAL_WAIT_PER_CALL,
    MAX_MODEL_LEN,
    VOCAB,
    build,
    complete,
    delta,
    serving,
    settled,
    snapshot,
)

import trio_rollouts as tr  # noqa: E402
from trio_rollouts._context import CallContext, call_context  # noqa: E402
from trio_rollouts.inference import EmbeddedInference, EngineModel, InferenceRequest  # noqa: E402

GROUPS = 4
MEMBERS = 4
PREFIX = 256
QUESTION = 128

#: The CPU server's scheduler and cache, with the calibrated step costs.
MODEL = EngineModel(
    block_size=128,
    num_blocks=8192,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    per_prefill_step=0.0019,
)


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """``(prompt ids, max_tokens)`` per request, in the order they are sent."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(PREFIX)]
    lengths = list(range(8, 8 + 16 * GROUPS * MEMBERS, 16))
    rng.shuffle(lengths)
    requests = []
    for g in range(GROUPS):
        question = [rng.randrange(1, VOCAB) for _ in range(QUESTION)]
        for m in range(MEMBERS):
            requests.append((prefix + question, lengths[g * MEMBERS + m]))
    return requests


def on_vllm(requests: list[tuple[list[int], int]], work: Path, core: str) -> dict[str, Any]:
    model_dir = build(work / "tiny-llama", heads=2)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN  # as calibrate_engine.py does
    config_path.write_text(json.dumps(config, indent=2))
    with serving(model_dir, work, core) as (vllm, _, _, _):
        before = snapshot(vllm)
        finished: list[tuple[float, int]] = []

        def one(i: int) -> None:
            prompt, max_tokens = requests[i]
            complete(vllm, prompt, max_tokens)
            finished.append((time.perf_counter(), i))

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(requests)) as pool:
            vllm.post("/pause?mode=keep&clear_cache=false")
            try:
                futures = []
                for i in range(len(requests)):
                    futures.append(pool.submit(one, i))
                    time.sleep(0.02)  # in order
                time.sleep(ARRIVAL_WAIT + ARRIVAL_WAIT_PER_CALL * len(requests))
            finally:
                vllm.post("/resume")
            for future in futures:
                future.result()
        after = settled(vllm, before, len(requests))
    return {
        "prompt_tokens": delta(before, after, "vllm:prompt_tokens_total"),
        "prefix_cache_hits": delta(before, after, "vllm:prefix_cache_hits_total"),
        "steps": delta(before, after, "vllm:iteration_tokens_total_count"),
        "order": [i for _, i in sorted(finished)],
    }


def on_model(requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    def policy(prompt: list[tr.ChatMessage]) -> tuple[list[str], list[float]]:
        return ["x" * 1000], [1.0]

    interface = EmbeddedInference(engine=MODEL, policy=policy)
    finished: list[tuple[float, int]] = []

    async def main() -> None:
        async def one(i: int) -> None:
            prompt, max_tokens = requests[i]
            call_context.set(CallContext(group=(0, 0, i)))  # admitted in send order
            await interface.agenerate(
                InferenceRequest(
                    prompt=[],
                    prompt_ids=prompt,
                    generation_args=tr.GenerationArgs(max_tokens=max_tokens),
                )
            )
            finished.append((trio.current_time(), i))

        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    (stats,) = interface.engine_statistics()
    return {
        "prompt_tokens": stats.prompt_tokens,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "steps": stats.steps,
        "order": [i for _, i in sorted(finished)],
    }


def spearman(a: list[int], b: list[int]) -> float:
    rank_a = np.argsort(a)
    rank_b = np.argsort(b)
    return float(np.corrcoef(rank_a, rank_b)[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--core", default="1")
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args()
    requests = workload()
    model = on_model(requests)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        real = on_vllm(requests, work, args.core)
    print(f"{GROUPS} groups of {MEMBERS}: {PREFIX}-id shared prefix + {QUESTION}-id question")
    print("| | prompt ids | prefix-cache hits | steps |")
    print("|---|---|---|---|")
    for name, run in (("vLLM 0.32 (CPU)", real), ("EngineModel", model)):
        cells = (run["prompt_tokens"], run["prefix_cache_hits"], run["steps"])
        print(f"| {name} | " + " | ".join(f"{cell:.0f}" for cell in cells) + " |")
    max_tokens = [m for _, m in requests]
    print("finish order (request: max_tokens):")
    for name, run in (("vLLM", real), ("model", model)):
        order = list(run["order"])
        print(f"  {name:5}: " + " ".join(f"{i}:{max_tokens[i]}" for i in order))
    real_order, model_order = list(real["order"]), list(model["order"])
    print(f"rank correlation of the two orders: {spearman(real_order, model_order):.3f}")
    by_length = sorted(range(len(requests)), key=lambda i: max_tokens[i])
    print(f"model order is by max_tokens: {model_order == by_length}")
    print(f"vLLM order is by max_tokens: {real_order == by_length}")


if __name__ == "__main__":
    main()
