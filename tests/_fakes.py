"""Test doubles shared by the pipeline tests: an inference interface and scripted agents."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio

import trio_rollouts as tr
from trio_rollouts.inference import (
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    Pausable,
    WeightUpdateMode,
)


@attrs.define
class RawInterface(InferenceInterface, tr.ReturnsRaw):
    """Returns a fixed response; marks itself ReturnsRaw as the pipeline requires."""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        return InferenceResponse(
            response=tr.ChatMessage(role="assistant", content="ok"), raw_text="ok"
        )


@attrs.define
class PlainInterface(InferenceInterface):
    """Not ReturnsRaw: the pipeline must refuse it."""

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        return InferenceResponse(response=tr.ChatMessage(role="assistant", content="ok"))


def rollouts(
    rewards: list[float | None], env_id: str = "env", problem_id: str = "p"
) -> list[tr.Rollout]:
    return [
        tr.Rollout(trajectory=["x"], reward=r, env_id=env_id, problem_id=problem_id)
        for r in rewards
    ]


GroupFn = Callable[["ScriptedAgent", tr.GroupedRolloutRequest], Awaitable[list[tr.Rollout]]]


@attrs.define
class ScriptedAgent(tr.GroupedRolloutGenerator):
    """Runs ``script(agent, request)`` per group and tracks calls in flight."""

    script: GroupFn = attrs.field(kw_only=True)
    calls: int = attrs.field(default=0, kw_only=True)
    in_flight: int = attrs.field(default=0, kw_only=True)
    max_in_flight: int = attrs.field(default=0, kw_only=True)
    exited: int = attrs.field(default=0, kw_only=True)

    async def group_rollout(self, request: tr.GroupedRolloutRequest) -> list[tr.Rollout]:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.script(self, request)
        finally:
            self.in_flight -= 1
            self.exited += 1


def request(
    *,
    num_groups: int = 1,
    rollouts_per_group: int = 2,
    streaming: bool = False,
    enforce_order: bool = False,
    filter_groups_with_same_reward: bool = False,
) -> tr.GroupedRolloutRequest:
    return tr.GroupedRolloutRequest(
        num_groups=num_groups,
        rollouts_per_group=rollouts_per_group,
        inference_interface=RawInterface(),
        streaming=streaming,
        enforce_order=enforce_order,
        filter_groups_with_same_reward=filter_groups_with_same_reward,
    )


@attrs.define(eq=False)
class Backend(InferenceInterface, tr.ReturnsRaw, Pausable):
    """A Pausable backend in all four modes whose pause or resume can fail, and that
    does not stamp where an epoch changed; ``log`` records what it was told. A call
    takes ``latency`` seconds and is stamped with the epoch it started under."""

    fail_pause: bool = False
    fail_resume: bool = False
    log: list[str] = attrs.Factory(list)
    epoch: int = 0
    latency: float = 1.0

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        return frozenset({"drain", "restart", "keep", "abort"})

    @property
    def policy_epoch(self) -> int:
        return self.epoch

    @property
    def stamps_policy_epoch(self) -> bool:
        return False

    async def pause(self, mode: WeightUpdateMode) -> None:
        await trio.lowlevel.checkpoint()
        self.log.append(f"pause {mode}")
        if self.fail_pause:
            msg = "pause endpoint answered 404"
            raise RuntimeError(msg)

    async def resume(self, epoch: int) -> None:
        await trio.lowlevel.checkpoint()
        self.log.append(f"resume {epoch}")
        self.epoch = epoch
        if self.fail_resume:
            msg = "resume endpoint answered 500"
            raise RuntimeError(msg)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        await trio.sleep(self.latency)
        return InferenceResponse(
            response=tr.ChatMessage(role="assistant", content="x"),
            raw_text="x",
            policy_epoch=[(0, self.epoch)],
        )
