"""Test doubles for code that uses trio_rollouts: a scripted agent, null backends, and a
scripted Pausable backend (re-exported by :mod:`trio_rollouts.testing`).

They are what the library's own tests and benchmarks use, so they are held to the same
contracts as the real thing: the null backends are ``ReturnsRaw`` as the pipeline
requires, and the scripted Pausable backend holds requests while paused, as
:class:`~trio_rollouts.inference.Pausable` says a backend must. Every wait is a Trio
sleep or event, so tests run on a :class:`trio.testing.MockClock` with autojump in no
real time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence

import attrs
import trio

from . import ChatMessage, GroupedRolloutGenerator, GroupedRolloutRequest, Rollout, TokenRollout
from .inference import (
    WEIGHT_UPDATE_MODES,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    Pausable,
    ReturnsRaw,
    WeightUpdateMode,
)

#: What :class:`ScriptedAgent` runs for each group: ``await script(agent, request)``
#: returns the group's rollouts.
GroupScript = Callable[
    ["ScriptedAgent", GroupedRolloutRequest], Awaitable[Sequence[Rollout | TokenRollout]]
]


def rollouts(
    rewards: Iterable[float | None], *, env_id: str = "env", problem_id: str = "p"
) -> list[Rollout]:
    """One text rollout per reward (trajectory ``["x"]``), all of one problem: a group for
    a :class:`ScriptedAgent` to return. ``None`` rewards are kept, for testing how the
    pipeline refuses them."""
    return [
        Rollout(trajectory=["x"], reward=reward, env_id=env_id, problem_id=problem_id)
        for reward in rewards
    ]


# Plain attribute writes: the counters change on every call, and a validating
# __setattr__ (the attrs default) would triple the cost of the fixed-group fast path.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class ScriptedAgent(GroupedRolloutGenerator):
    """A grouped agent that runs a script per group, or returns a fixed group, and counts
    its calls.

    With ``script``, ``group_rollout`` is ``await script(self, request)``: the script
    decides what a group is and how long it takes, and may raise, sleep forever, or read
    the counters (``agent.calls`` is the call's own number, counted from 1, until its
    first checkpoint)::

        async def instant(agent, request):
            await trio.lowlevel.checkpoint()
            return rollouts([0.0, 1.0])

        agent = ScriptedAgent(script=instant, parallel_generation_tasks=4)

    With ``group`` instead, each call checkpoints once and returns a new list of the same
    rollouts: the cheapest agent there is, for benchmarks of the pipeline itself.

    The counters are plain ints, updated without a checkpoint, so a test reads them at
    any point; they cost a few integer updates per call.
    """

    #: Runs once per group; see :data:`GroupScript`. Give this or ``group``.
    script: GroupScript | None = attrs.field(default=None, kw_only=True)
    #: The rollouts every call returns (in a new list), when there is no ``script``.
    group: Sequence[Rollout | TokenRollout] = attrs.field(default=(), kw_only=True, converter=tuple)
    #: ``group_rollout`` calls started.
    calls: int = attrs.field(default=0, init=False)
    #: Calls started and not yet returned or raised.
    in_flight: int = attrs.field(default=0, init=False)
    #: The most calls that were ever in flight at once.
    max_in_flight: int = attrs.field(default=0, init=False)
    #: Calls that have returned or raised (cancelled ones included).
    exited: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if (self.script is None) == (not self.group):
            msg = (
                "ScriptedAgent needs exactly one of script= (an async function of the agent "
                "and the request) and group= (a non-empty list of rollouts)"
            )
            raise ValueError(msg)

    async def group_rollout(
        self, request: GroupedRolloutRequest
    ) -> Sequence[Rollout | TokenRollout]:
        """Run the script for one group, or checkpoint and return ``group``.

        Cancellation: as cancellation-safe as the script (with ``group``, a checkpoint);
        the counters are right on every route out.
        """
        self.calls += 1
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        try:
            if self.script is None:
                await trio.lowlevel.checkpoint()
                return list(self.group)
            return await self.script(self, request)
        finally:
            self.in_flight -= 1
            self.exited += 1


@attrs.define(eq=False, kw_only=True)
class NullChatInference(InferenceInterface):
    """A backend that answers every request with ``completion`` after ``latency`` seconds,
    as a chat message only: it is not ``ReturnsRaw``, so the grouped pipeline refuses it
    (use it to test that refusal; :class:`NullInference` is the one that runs)."""

    #: The assistant message's content, for every request.
    completion: str = "ok"
    #: Seconds each request takes (0: a checkpoint only).
    latency: float = attrs.field(
        default=0.0,
        validator=[attrs.validators.instance_of((int, float)), attrs.validators.ge(0)],
    )
    #: Every request received, in arrival order.
    requests: list[InferenceRequest] = attrs.field(factory=list, init=False)

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Record ``request``, sleep ``latency`` seconds and answer.

        Cancellation: a checkpoint; cancelled, it answers nothing (the request stays
        recorded).
        """
        self.requests.append(request)
        await trio.sleep(self.latency)
        return self._answer()

    def _answer(self) -> InferenceResponse:
        return InferenceResponse(response=ChatMessage(role="assistant", content=self.completion))


@attrs.define(eq=False, kw_only=True)
class NullInference(NullChatInference, ReturnsRaw):
    """A ``ReturnsRaw`` backend that answers every request with ``completion`` (also as
    ``raw_text``) after ``latency`` seconds. For agents that ignore the model, it is the
    interface a :class:`~trio_rollouts.GroupedRolloutRequest` needs; agents that call it
    get a fixed answer, and :attr:`requests` shows what they asked."""

    def _answer(self) -> InferenceResponse:
        return InferenceResponse(
            response=ChatMessage(role="assistant", content=self.completion),
            raw_text=self.completion,
        )


def _modes(value: Iterable[WeightUpdateMode]) -> frozenset[WeightUpdateMode]:
    modes = frozenset(value)
    unknown = sorted(modes - set(WEIGHT_UPDATE_MODES))
    if unknown:
        msg = f"modes must be among {WEIGHT_UPDATE_MODES}, got {unknown}"
        raise ValueError(msg)
    return modes


def _failure(setting: bool | Exception, default: str) -> Exception:
    return setting if isinstance(setting, Exception) else RuntimeError(default)


@attrs.define(eq=False, kw_only=True)
class ScriptedPausable(NullInference, Pausable):
    """A :class:`NullInference` that a weight update can pause, in the ``modes`` given,
    and that records what it was told.

    - :attr:`log` lists the calls in order, as ``"pause keep"`` and ``"resume 1"``. A
      pause is recorded once it has passed its checkpoint (a pause cancelled at once
      records nothing), a resume when it is called.
    - While paused, arriving requests wait for :meth:`resume`. ``keep`` and ``abort``
      also stop the requests in flight at once and continue them after the resume: a
      request needs ``latency`` seconds of unpaused time, so a pause delays it by exactly
      its length. The two modes differ only in a real engine's memory.
    - A response carries ``policy_epoch=[(0, e)]``, ``e`` the epoch when the request was
      admitted; the backend does not stamp where an epoch changed
      (:attr:`stamps_policy_epoch` is ``False``), so groups that span a ``keep`` or
      ``abort`` update count as ``mixed``.
    - ``fail_pause`` / ``fail_resume``: ``True`` (a ``RuntimeError``) or the exception
      that every later pause / resume raises, after recording the call. A failed pause
      leaves the backend unpaused; a failed resume has resumed all the same (the server
      answered an error after it acted), so nothing stays paused.
    """

    #: The modes :meth:`pause` accepts (all four by default).
    modes: frozenset[WeightUpdateMode] = attrs.field(
        default=frozenset(WEIGHT_UPDATE_MODES), converter=_modes
    )
    #: The epoch generation runs under; :meth:`resume` sets it.
    epoch: int = 0
    #: Make every pause fail: ``True``, or the exception to raise.
    fail_pause: bool | Exception = False
    #: Make every resume fail (after resuming): ``True``, or the exception to raise.
    fail_resume: bool | Exception = False
    #: ``"pause <mode>"`` and ``"resume <epoch>"``, in the order they were called.
    log: list[str] = attrs.field(factory=list, init=False)
    #: The mode of the pause in force, or ``None`` while generating.
    paused: WeightUpdateMode | None = attrs.field(default=None, init=False)
    _resumed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _generating: set[trio.CancelScope] = attrs.field(factory=set, init=False)

    @property
    def supported_modes(self) -> frozenset[WeightUpdateMode]:
        """:attr:`modes`."""
        return self.modes

    @property
    def policy_epoch(self) -> int:
        """:attr:`epoch`."""
        return self.epoch

    @property
    def stamps_policy_epoch(self) -> bool:
        """``False``: a response carries the epoch its request was admitted under."""
        return False

    async def pause(self, mode: WeightUpdateMode) -> None:
        """Stop as ``mode`` says: hold new requests, and with ``keep`` or ``abort`` the
        requests in flight too. Raises ``TypeError`` for a mode outside :attr:`modes`.

        Cancellation: a checkpoint before anything happens; cancelled there, it has
        neither recorded nor paused anything.
        """
        if mode not in self.modes:
            msg = (
                f"{type(self).__name__} cannot pause for {mode!r}; its modes: {sorted(self.modes)}"
            )
            raise TypeError(msg)
        await trio.lowlevel.checkpoint()
        self.log.append(f"pause {mode}")
        if self.fail_pause:
            raise _failure(self.fail_pause, "pause endpoint answered 404")
        if self.paused is None:
            self._resumed = trio.Event()
        self.paused = mode
        if mode in ("keep", "abort"):
            for scope in self._generating:
                scope.cancel()

    async def resume(self, epoch: int) -> None:
        """Generate under ``epoch`` from now on and release what the pause held; only
        sets the epoch when not paused.

        Cancellation: the backend has resumed before the first checkpoint, so a cancelled
        resume leaves nothing paused.
        """
        self.log.append(f"resume {epoch}")
        self.epoch = epoch
        self.paused = None
        self._resumed.set()
        await trio.lowlevel.checkpoint()
        if self.fail_resume:
            raise _failure(self.fail_resume, "resume endpoint answered 500")

    async def base_generate(self, request: InferenceRequest) -> InferenceResponse:
        """Wait while paused, then generate for ``latency`` seconds of unpaused time.

        Cancellation: a checkpoint; cancelled, it answers nothing (the request stays
        recorded).
        """
        self.requests.append(request)
        while self.paused is not None:
            await self._resumed.wait()
        epoch = self.epoch
        remaining = self.latency
        while True:
            with trio.CancelScope() as generating:
                self._generating.add(generating)
                started = trio.current_time()
                try:
                    await trio.sleep(remaining)
                finally:
                    self._generating.discard(generating)
            if not generating.cancelled_caught:
                break
            # Stopped by a keep/abort pause: the time generated so far is kept.
            remaining = max(0.0, remaining - (trio.current_time() - started))
            while self.paused is not None:
                await self._resumed.wait()
        response = self._answer()
        response.policy_epoch = [(0, epoch)]
        return response
