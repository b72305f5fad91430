"""A synchronous (PyTorch-style) training loop on the sync bridge: take a batch, train,
push the new weights, and print each step's loss and how many updates old the batch is.
The embedded backend stands in for the model server.

Run: python examples/sync_bridge_loop.py
The code is the example of docs/sync-bridge.md ("A training loop"), verbatim.
"""

import attrs
import numpy as np

import trio_rollouts as tr
from trio_rollouts.inference import EmbeddedInference


@attrs.define
class MultipleChoice(tr.GroupedRolloutGenerator):
    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        interface = request.inference_interface
        prompt = interface.prepare_request("Pick A, B or C.", request.generation_args)
        rollouts = []
        for _ in range(request.rollouts_per_group):
            response = await interface.agenerate(prompt)
            rollouts.append(
                tr.Rollout(
                    trajectory=[response.raw_text],
                    reward=float(response.response.content == "The answer is B."),
                    policy_epoch=[response.policy_epoch],
                )
            )
        return rollouts


def train_step(advantages: np.ndarray) -> float:
    """Stands in for the optimizer step of your trainer."""
    return float(np.abs(advantages).mean())


def push_weights(epoch: int) -> None:
    """Stands in for sending the new weights to the inference servers (NCCL, a file on
    disk, an HTTP call: yours). It runs inside the stream's weight update, which tells
    the backends the new epoch itself: the simulated backend needs nothing more."""


model = EmbeddedInference(seed=0)  # in practice: OpenAIInference(base_url, model_name)
agent = MultipleChoice(parallel_generation_tasks=16)
request = tr.GroupedRolloutRequest(
    num_groups=8,  # groups per training step
    rollouts_per_group=4,
    inference_interface=model,
    streaming=True,
    enforce_order=True,  # whole batches, in order: lag <= 16 // 8 = 2 steps
)

with tr.blocking_grouped_rollouts(agent, request) as stream:
    for step in range(5):
        batch = stream.take(request.num_groups, timeout=600)
        advantages = np.concatenate([group.advantages() for group in batch])
        lag = stream.policy_epoch - min(group.start_epoch for group in batch)
        loss = train_step(advantages)
        with stream.weight_update() as update:  # no call starts until the block exits
            push_weights(update.epoch)
        print(f"step {step}: batch {batch[0].batch_id}, loss {loss:.3f}, lag {lag}")
    print(stream.statistics().delivered, "groups delivered")
