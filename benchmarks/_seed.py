"""The origin's side of ``pipeline.py``'s measurements (asyncio, no Trio).

Usage: python _seed.py SEED_PIPELINE_SCRIPT scenario s1|s2|s3 [--uvloop]
       python _seed.py SEED_PIPELINE_SCRIPT shutdown [--uvloop]

Both print one JSON line.

``scenario`` runs the origin's own benchmark script (``shared/bench/seed_pipeline.py``)
unchanged, through its ``main()``, and reads the wall time from the line it prints. It
also records the process's CPU time at the script's two ``time.perf_counter()`` calls, so
the CPU spent in the timed region is known too (other load on the machine inflates wall
time, much less CPU time).

``shutdown`` loads the origin (``reference/seed_api.py``) through that script's shims,
starts 512 ``group_rollout`` calls that never finish (one of them returns a group once
all 512 are in flight), takes that group, ``break``s and ``aclose()``s the stream, then
waits until every task it started has ended. The origin's ``aclose()`` only *cancels* its
worker tasks; it does not wait for them. So two numbers: how long ``aclose()`` takes, and
how long until the tasks are really gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
import re
import sys
import time
import types

P = 512


def load_seed_script(script: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("seed_pipeline", script)
    if spec is None or spec.loader is None:
        msg = f"cannot load the origin's benchmark script {script!r}"
        raise ImportError(msg)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_seed_api(script: str):
    return load_seed_script(script)._install_shims()


class _RecordingClock:
    """Stands in for the ``time`` module inside the origin's script: every
    ``perf_counter()`` also records the process's CPU time."""

    def __init__(self) -> None:
        self.cpu: list[float] = []

    def perf_counter(self) -> float:
        self.cpu.append(time.process_time())
        return time.perf_counter()

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)


def scenario(script: str, name: str, uvloop: bool) -> dict[str, object]:
    module = load_seed_script(script)
    clock = _RecordingClock()
    module.time = clock
    sys.argv = [script, name, *(["--uvloop"] if uvloop else [])]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main()
    line = out.getvalue().strip()
    found = re.search(r"seconds=([0-9.]+)", line)
    # The script reads the clock at the start, maybe when the M-th group arrives, and
    # after its exit; its "seconds" spans the first and the last read.
    if found is None or len(clock.cpu) < 2:
        msg = f"unexpected run of the origin's script: {line!r}, {len(clock.cpu)} clock reads"
        raise RuntimeError(msg)
    return {
        "seconds": float(found.group(1)),
        "cpu_seconds": clock.cpu[-1] - clock.cpu[0],
        "line": line,
    }


def shutdown(script: str) -> dict[str, float | int]:
    api, inference_interface, returns_raw = load_seed_api(script)

    class Inf(inference_interface, returns_raw):
        pass

    prebuilt = [
        api.Rollout(
            trajectory=["x"],
            reward=float(i % 2),
            policy_epoch=[[(0, 0)]],
            kv_cache_epoch=[[(0, 0)]],
            num_evictions=[0],
        )
        for i in range(8)
    ]
    live = 0
    started = 0

    class Gen(api.GroupedRolloutGenerator):
        async def group_rollout(self, request):
            nonlocal live, started
            n = started
            started += 1
            live += 1
            if live == P:
                all_in_flight.set()
            try:
                if n == 0:
                    await all_in_flight.wait()
                    return list(prebuilt)
                await asyncio.get_running_loop().create_future()  # sleeps forever
            finally:
                live -= 1

    async def run() -> dict[str, float | int]:
        nonlocal all_in_flight
        all_in_flight = asyncio.Event()
        baseline_tasks = len(asyncio.all_tasks())
        gen = Gen(parallel_generation_tasks=P)
        request = api.GroupedRolloutRequest(
            num_groups=1, rollouts_per_group=8, inference_interface=Inf(), streaming=True
        )
        stream = gen.get_grouped_rollouts(request)
        async for _ in stream:
            live_at_break = live
            tasks_at_break = len(asyncio.all_tasks()) - baseline_tasks
            start = time.perf_counter()
            cpu_start = time.process_time()
            break
        await stream.aclose()
        aclose_done = time.perf_counter()
        aclose_cpu = time.process_time() - cpu_start
        live_after_aclose = live
        tasks_after_aclose = len(asyncio.all_tasks()) - baseline_tasks
        loop_iterations = 0
        while len(asyncio.all_tasks()) > baseline_tasks or live:
            await asyncio.sleep(0)
            loop_iterations += 1
        all_gone = time.perf_counter()
        all_gone_cpu = time.process_time() - cpu_start
        return {
            "live_at_break": live_at_break,
            "tasks_at_break": tasks_at_break,
            "aclose_ms": (aclose_done - start) * 1e3,
            "aclose_cpu_ms": aclose_cpu * 1e3,
            "live_after_aclose": live_after_aclose,
            "tasks_after_aclose": tasks_after_aclose,
            "all_gone_ms": (all_gone - start) * 1e3,
            "all_gone_cpu_ms": all_gone_cpu * 1e3,
            "loop_iterations_until_gone": loop_iterations,
        }

    all_in_flight: asyncio.Event
    return asyncio.run(run())


def main() -> None:
    script, what = sys.argv[1], sys.argv[2]
    uvloop = "--uvloop" in sys.argv
    if what == "scenario":
        print(json.dumps(scenario(script, sys.argv[3], uvloop)))
        return
    if what != "shutdown":
        msg = f"unknown measurement {what!r}; 'scenario' or 'shutdown'"
        raise SystemExit(msg)
    if uvloop:
        import uvloop as uvloop_module

        uvloop_module.install()
    print(json.dumps(shutdown(script)))


if __name__ == "__main__":
    main()
