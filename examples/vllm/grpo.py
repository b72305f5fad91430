"""Asynchronous GRPO that learns, end to end, on a real vLLM server (CPU is enough).

A tiny Llama is trained with PyTorch in this process while vLLM generates with it:

- the rollouts come from ``OpenAIInference(server="vllm")`` through a streaming
  ``get_grouped_rollouts``, with the token ids and logprobs vLLM sampled;
- each step trains on a batch in a worker thread (generation goes on meanwhile), then
  pushes the new weights inside ``stream.weight_update("keep")``: save them, and have
  vLLM load them (``POST /collective_rpc`` ``reload_weights``);
- ``max_staleness=1``: no group trains on weights more than one step old;
- on a server started with ``--enable-scale-out``, calls go through vLLM's native
  ``/inference/v1/generate``, which stamps the policy version of every token: a group
  whose generation spanned a weight push carries the exact token where the weights
  changed, and the run reports how many did (elsewhere they count as ``mixed``);
- prompts come from a ``PromptSource``; a checkpoint (weights, optimizer, the source's
  state, the history) is written every few steps, and ``--resume`` goes on from it.

The task: answer a question with the letter ``z``. The reward is dense, so that a random
model gets a signal: the mean over the answer's characters of 1 for a ``z``, and for any
other character ``0.5 * max(0, 1 - |ord(c) - ord("z")| / 64)``. See docs/vllm-end-to-end.md.

    python examples/vllm/grpo.py --server-root http://127.0.0.1:8000 --model-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio
from transformers import LlamaForCausalLM
from transformers.utils import logging as transformers_logging

import trio_rollouts as tr

TARGET = "z"
GROUPS_PER_STEP = 8
ROLLOUTS_PER_GROUP = 8
MAX_TOKENS = 4
CLIP = 0.2  # PPO-style clipping of the importance ratio


def closeness(text: str) -> float:
    """1 for an answer made of the target letter; a character that is not the target
    scores at most 0.5, less the further it is."""
    if not text:
        return 0.0
    return float(np.mean([1.0 if c == TARGET else 0.5 * near(c) for c in text]))


def near(character: str) -> float:
    return max(0.0, 1 - abs(ord(character) - ord(TARGET)) / 64)


class OneLetter(tr.RewardOnlyAgent):
    async def get_reward(self, problem: tr.Problem, response: tr.InferenceResponse) -> float:
        return closeness(response.response.content)


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read() or b"null")


class Trainer:
    """The policy, trained with a clipped GRPO objective against vLLM's own logprobs."""

    def __init__(self, model_dir: Path, lr: float) -> None:
        torch.manual_seed(0)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def step(self, groups: list[tr.RolloutGroup]) -> dict[str, float]:
        """One optimizer step on a batch; runs in a worker thread."""
        losses, gaps = [], []
        for group in groups:
            for rollout, advantage in zip(group, group.advantages(), strict=True):
                if not isinstance(rollout, tr.TokenRollout) or rollout.logprobs is None:
                    msg = "the server returned no token ids or logprobs"
                    raise RuntimeError(msg)
                ids = torch.tensor(rollout.trajectory[0])
                start = (rollout.generation_mask or [[]])[0].count(False)
                if start == len(ids):
                    continue  # nothing generated
                logits = self.model(ids[None]).logits[0, start - 1 : -1]
                new = torch.log_softmax(logits, -1).gather(-1, ids[start:, None])[:, 0]
                old = torch.tensor(rollout.logprobs[0])  # what vLLM sampled with
                gaps.append((new - old).abs().max().item())
                ratio = torch.exp(new - old)
                clipped = ratio.clamp(1 - CLIP, 1 + CLIP)
                losses.append(-torch.min(ratio * advantage, clipped * advantage).mean())
        loss = torch.stack(losses).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item(), "logprob_gap": max(gaps)}

    def push(self, server_root: str, weights: Path) -> None:
        """Save the weights and have vLLM load them in place."""
        self.model.save_pretrained(weights)
        post(
            f"{server_root}/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": str(weights)}},
        )

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def save_checkpoint(path: Path, trainer: Trainer, source: tr.PromptSource, log: list[Any]) -> None:
    """Weights, optimizer, the prompt source's books and the history, atomically."""
    partial = path.with_suffix(".partial")
    torch.save({**trainer.state(), "source": source.state_dict(), "history": log}, partial)
    os.replace(partial, path)


async def train(options: argparse.Namespace) -> list[dict[str, float]]:
    work: Path = options.work
    checkpoint, weights = work / "checkpoint.pt", work / "weights"
    problems = [
        tr.Problem(problem_id=f"q{i}", prompt=f"Question {i}: answer with one letter.")
        for i in range(32)
    ]
    source = tr.PromptSource(problems, seed=0)
    trainer = Trainer(options.model_dir, options.lr)
    history: list[dict[str, float]] = []
    if options.resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        trainer.load(state)
        source.load_state_dict(state["source"])
        history = state["history"]
        print(f"resumed at step {len(history)}")
    # The server must sample with the trainer's weights from the first call on.
    trainer.push(options.server_root, weights)

    interface = tr.OpenAIInference(
        f"{options.server_root}/v1", str(options.model_dir), server="vllm"
    )
    agent = OneLetter(prompts=source, env_id="one-letter", parallel_generation_tasks=16)
    request = tr.GroupedRolloutRequest(
        num_groups=GROUPS_PER_STEP,
        rollouts_per_group=ROLLOUTS_PER_GROUP,
        inference_interface=interface,
        generation_args=tr.GenerationArgs(max_tokens=MAX_TOKENS, temperature=1.0),
        streaming=True,
        max_staleness=1,
        initial_epoch=len(history),
    )
    for probe in await interface.probe():
        print(
            f"{probe.base_url}: logprobs {probe.logprobs_mode}, native generate "
            f"{'yes' if probe.native_generate else 'no'}"
        )
    spanned = 0  # groups with a rollout whose tokens span a weight push, stamped exactly
    print("step  reward  exact  stale     loss      gap  push s")
    async with agent.get_grouped_rollouts(request) as stream:
        while len(history) < options.steps:
            batch = [await stream.receive() for _ in range(GROUPS_PER_STEP)]
            staleness = [stream.policy_epoch - group.start_epoch for group in batch]
            spanned += sum(
                any(len(rollout.policy_epoch[0]) > 1 for rollout in group if rollout.policy_epoch)
                for group in batch
            )
            # Generation goes on while the trainer computes the step.
            stats = await trio.to_thread.run_sync(trainer.step, batch)
            started = time.monotonic()
            async with stream.weight_update("keep"):
                await trio.to_thread.run_sync(trainer.push, options.server_root, weights)
            texts = [
                str(rollout.extra.get("completion", "")) for group in batch for rollout in group
            ]
            row = {
                "step": len(history),
                "reward": float(np.mean([group.reward_mean() for group in batch])),
                "exact": float(np.mean([text == TARGET * len(text) != "" for text in texts])),
                "staleness": float(np.mean(staleness)),
                "loss": stats["loss"],
                "logprob_gap": stats["logprob_gap"],
                "push_seconds": time.monotonic() - started,
            }
            history.append(row)
            print(
                f"{row['step']:>4} {row['reward']:>7.3f} {row['exact']:>6.2f} "
                f"{row['staleness']:>6.2f} {row['loss']:>8.4f} {row['logprob_gap']:>8.2g} "
                f"{row['push_seconds']:>7.2f}",
                flush=True,
            )
            if len(history) % options.checkpoint_every == 0:
                save_checkpoint(checkpoint, trainer, source, history)
        statistics = stream.statistics()
    print(
        f"stream: {statistics.weight_updates} updates, {statistics.stale} stale calls "
        f"dropped, {statistics.mixed} groups across an update without exact stamps, "
        f"{spanned} groups across an update stamped exactly, unaccounted "
        f"{statistics.unaccounted}"
    )
    return history


def report(history: list[dict[str, float]], work: Path) -> None:
    (work / "history.json").write_text(json.dumps(history, indent=1))
    first, last = history[: len(history) // 4], history[-(len(history) // 4) :]
    before = np.mean([row["reward"] for row in first])
    after = np.mean([row["reward"] for row in last])
    print(f"reward: first quarter {before:.3f}, last quarter {after:.3f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([row["step"] for row in history], [row["reward"] for row in history], label="reward")
    axis.plot([row["step"] for row in history], [row["exact"] for row in history], label="exact")
    axis.set_xlabel("step (one weight push each)")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title(f"GRPO on vLLM: answer with '{TARGET}'")
    figure.tight_layout()
    figure.savefig(work / "reward.png", dpi=120)
    print(f"plot: {work / 'reward.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-root", required=True, help="vLLM's URL, without /v1")
    parser.add_argument("--model-dir", type=Path, required=True, help="the model vLLM serves")
    parser.add_argument("--work", type=Path, default=Path("grpo-run"), help="outputs")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--resume", action="store_true", help="go on from the checkpoint")
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the server needs the other core
    transformers_logging.disable_progress_bar()
    try:
        history = trio.run(train, options)
    finally:
        shutil.rmtree(options.work / "weights", ignore_errors=True)
    report(history, options.work)


if __name__ == "__main__":
    main()
