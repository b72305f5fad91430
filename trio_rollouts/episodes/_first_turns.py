"""The first turns of a group's episodes as one group call.

The episodes of a group start from the same problem, so their first requests are often
the same but for their seeds. :class:`FirstTurns` gathers them and makes one
:meth:`~trio_rollouts.inference.GeneratesGroups.agenerate_group` call (``n`` choices)
instead of one call per episode, which a server answers with one prefill;
:class:`~trio_rollouts.MultiTurnAgent` uses it when the request asks for group calls and
the backend makes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import trio

from trio_rollouts._context import calling
from trio_rollouts.inference._interface import (
    GeneratesGroups,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
)
from trio_rollouts.inference._sampling import choice_seed

__all__ = ["FirstTurns"]


@attrs.define(eq=False)
class FirstTurns:
    """The first turns of a group's episodes as one group call (``n``), when they are the
    same request.

    Each episode hands in its first request (:meth:`generate`) and waits. Once every
    episode still running has (an episode that ends before its first turn withdraws),
    the lowest-numbered one makes the call: one
    :meth:`~trio_rollouts.inference.GeneratesGroups.agenerate_group` with its request
    when all are the same but for their seed, else nothing, and each episode then makes
    its own call. With seeds, choice ``i`` was sampled with ``seed + i`` (vLLM's rule),
    ``seed`` being the lowest episode's.
    """

    interface: InferenceInterface
    expected: int
    requests: dict[int, InferenceRequest] = attrs.field(factory=dict)
    responses: dict[int, tuple[InferenceResponse, int | None]] = attrs.field(factory=dict)
    ready: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    separate: bool = False
    withdrawn: set[int] = attrs.field(factory=set)

    def withdraw(self, member: int) -> None:
        """Episode ``member`` has ended (or failed): it will hand in no first request."""
        if member in self.requests or member in self.withdrawn:
            return
        self.withdrawn.add(member)
        self.expected -= 1
        if self.requests and len(self.requests) >= self.expected:
            self.ready.set()

    async def generate(
        self, member: int, request: InferenceRequest
    ) -> tuple[InferenceResponse, int | None]:
        """Episode ``member``'s first turn: its response, and the seed its choice was
        sampled with when that is not its request's (``None``: its own).

        Cancellation: the group's episodes are cancelled together; a cancelled leader
        cancels the group call.
        """
        self.requests[member] = request
        if len(self.requests) >= self.expected:
            self.ready.set()
        try:
            await self.ready.wait()
        except BaseException:
            # Cut (or cancelled) before the call was made: it hands in nothing.
            del self.requests[member]
            self.withdrawn.add(member)
            self.expected -= 1
            if self.requests and len(self.requests) >= self.expected:
                self.ready.set()
            raise
        if member == min(self.requests) and not self.done.is_set():
            try:
                await self._call()
            finally:
                self.done.set()
        else:
            await self.done.wait()
        if self.separate or member not in self.responses:
            return await self.interface.agenerate(request), None
        return self.responses[member]

    async def _call(self) -> None:
        members = sorted(self.requests)
        first = self.requests[members[0]]
        interface = self.interface
        if (
            not isinstance(interface, GeneratesGroups)
            or len(members) == 1
            or not all(_same_but_seed(first, self.requests[m]) for m in members[1:])
        ):
            self.separate = True
            return
        with _placed_for_the_group():
            responses = await interface.agenerate_group(first, len(members))
        seed = first.generation_args.seed
        for i, (m, response) in enumerate(zip(members, responses, strict=True)):
            self.responses[m] = (response, choice_seed(seed, i))


@contextlib.contextmanager
def _placed_for_the_group() -> Iterator[None]:
    """The calls of the ``with`` body are placed for the group, not for one episode (the
    call context's episode unset, and restored after)."""
    with calling(episode=None):
        yield


def _same_but_seed(a: InferenceRequest, b: InferenceRequest) -> bool:
    return (
        a.prompt_ids == b.prompt_ids
        and a.tools == b.tools
        and a.prompt == b.prompt
        and attrs.evolve(a.generation_args, seed=None) == attrs.evolve(b.generation_args, seed=None)
    )
