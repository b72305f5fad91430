"""A Trio training loop with weight updates: train in a worker thread while the pipeline
keeps generating, push the weights inside ``stream.weight_update(mode)``, and bound how
old a group may be (``max_staleness=1``). The embedded backend stands in for the model
servers.

Run: python examples/weight_update_loop.py
The code is the examples of docs/weight-updates.md (the shared agent, then "A trainer
loop on Trio"), verbatim.
"""

import attrs
import numpy as np
import trio

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference, Pausable


@attrs.define
class MultipleChoice(tr.GroupedRolloutGenerator):
    """One prompt per group; the rollouts are sampled concurrently."""

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        interface = request.inference_interface
        prompt = interface.prepare_request("Pick A, B or C.", request.generation_args)
        rollouts = []

        async def sample() -> None:
            response = await interface.agenerate(prompt)
            rollouts.append(
                tr.Rollout(
                    trajectory=[response.raw_text],
                    reward=float(response.response.content == "The answer is B."),
                    policy_epoch=[response.policy_epoch],
                    kv_cache_epoch=[response.kv_cache_epoch],
                )
            )

        async with trio.open_nursery() as nursery:
            for _ in range(request.rollouts_per_group):
                nursery.start_soon(sample)
        return rollouts


def pick_mode(interface: tr.InferenceInterface) -> str:
    """keep where the backend can hold calls in flight, drain anywhere else."""
    if isinstance(interface, Pausable) and "keep" in interface.supported_modes:
        return "keep"
    return "drain"


def train_step(batch: list[tr.RolloutGroup]) -> float:
    """Stands in for the optimizer step (runs in a worker thread)."""
    advantages = np.concatenate([group.advantages() for group in batch])
    return float(np.abs(advantages).mean())


async def push_weights(epoch: int) -> None:
    """Stands in for sending the weights of ``epoch`` to the servers: an NCCL broadcast,
    or a checkpoint on disk and an update call. The backend needs no call of its own:
    the stream resumes it under ``epoch``."""
    await trio.sleep(0.5)


async def train(steps: int) -> None:
    model = EmbeddedInference(seed=0)  # in practice: OpenAIInference(..., server="vllm")
    agent = MultipleChoice(parallel_generation_tasks=16)
    request = tr.GroupedRolloutRequest(
        num_groups=8,  # groups per training step
        rollouts_per_group=4,
        inference_interface=model,
        streaming=True,
        max_staleness=1,  # never train on a group more than one update old
    )
    mode = pick_mode(model)
    async with agent.get_grouped_rollouts(request) as stream:
        for step in range(steps):
            batch = [await stream.receive() for _ in range(request.num_groups)]
            ages = [stream.policy_epoch - group.start_epoch for group in batch]
            loss = await trio.to_thread.run_sync(train_step, batch)
            async with stream.weight_update(mode) as update:
                await push_weights(update.epoch)
            print(
                f"step {step}: loss {loss:.3f}, ages {max(ages)} max; update to epoch "
                f"{update.epoch} ({update.mode}): paused {update.pause_seconds * 1e3:.0f} ms, "
                f"{update.held} calls held"
            )
        stats = stream.statistics()
        print(
            f"epoch {stats.policy_epoch}, {stats.weight_updates} updates, {stats.delivered} "
            f"groups, {stats.stale} stale, {stats.mixed} mixed, unaccounted {stats.unaccounted}"
        )


trio.run(train, 5)
