"""Reward code in worker processes: :func:`run_reward`, the run's pool, its limiter.

A reward function that parses LaTeX (``math_verify``), simplifies with sympy or runs a
program is CPU-bound, may hang, and may hang inside C code that no signal handler
interrupts. :func:`run_reward` runs it in a worker process of a ``trio-parallel`` pool,
where the event loop keeps serving the pipeline and where a deadline can always be
enforced: past ``timeout`` the worker is killed (``SIGKILL``) and reaped, and
:class:`~trio_rollouts.RewardTimeoutError` is raised, which the failure policy treats as
transient (the group is retried when ``max_attempts`` allows).

Design notes:

- **One pool per Trio run.** The first call of a run opens it (a ``trio-parallel``
  worker context, held by a system task); the run's end closes it: Trio cancels system
  tasks after the main task returns, and the context shuts its idle workers down (a
  worker that does not exit within the grace period is killed). Reward calls are
  descendants of the main task, so none is running then, and no worker process
  outlives the run. The sync bridge and the Ray actors run Trio in a thread: each of
  their runs has its own pool. ``trio-parallel``'s default context is not used: on
  POSIX it is process-wide and its workers live until the interpreter exits.
- **The pool keeps its size.** :func:`current_reward_limiter` (a
  :class:`trio.CapacityLimiter`, ``os.cpu_count()`` tokens by default) bounds the calls
  in flight, and a worker is started only by a call that holds a token and finds no idle
  one, so no more workers are alive than the limiter's ``total_tokens`` (set it before
  the run's first call: lowering it later leaves the extra idle workers alive until
  the run ends). A killed worker is replaced by a fresh one when a call next needs it,
  not eagerly.
- **The timeout counts the function's run, on the real clock.** Waiting for a token,
  starting a worker and the imports that unpickling ``fn`` and its arguments need
  (sympy's take a fraction of a second) do not count: each call first sends ``fn`` and
  its arguments to the worker untimed (``len((fn, *args))``), then, on the same worker
  (the pool hands back the worker it was just given, with no checkpoint in between),
  the timed call. The deadline is ``time.monotonic()`` based, watched by a thread, not
  Trio's clock: it bounds a process, which a :class:`trio.testing.MockClock` does not
  slow down or speed up, so rewards behave the same in tests on a mock clock. The
  untimed part is bounded by the caller's own deadline (a group's ``group_timeout``)
  only.
- **Cancellation kills.** Calls run with ``kill_on_cancel``: when the caller is
  cancelled (its group's deadline, a consumer that stops, a sibling's failure), the
  worker is killed and reaped before ``trio.Cancelled`` propagates. A reward deadline
  therefore lies inside its group's deadline by construction: the call runs inside the
  group's cancel scope.
- **Pickling.** ``trio-parallel`` pickles with ``cloudpickle`` (a dependency): a function
  of an importable module goes by reference, one of ``__main__`` (a script, a notebook),
  a lambda or a closure by value. Exceptions come back as themselves, with the worker's
  traceback. A script that calls :func:`run_reward` must guard its entry point with
  ``if __name__ == "__main__":``, since each worker imports the main module (as
  :mod:`multiprocessing` requires); a worker that dies (that, or a crash in ``fn``)
  raises ``trio_parallel.BrokenWorkerError`` with a note saying what to check.

Threads: :func:`run_reward` and :func:`current_reward_limiter` are called in a Trio run;
each alarm thread touches only its ``threading.Event`` and cancels through the run's
token.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar, TypeVarTuple

import trio
import trio_parallel

from trio_rollouts._checks import check_seconds
from trio_rollouts.pipeline._failure import RewardTimeoutError

__all__ = ["RewardPool", "current_reward_limiter", "run_reward"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: Given to ``trio-parallel`` as its limiter: the call holds the pool's token already.
_TOKEN_HELD = contextlib.nullcontext()


class _WorkerContext(Protocol):
    """What this module uses of ``trio_parallel.WorkerContext`` (untyped upstream)."""

    async def run_sync(
        self,
        sync_fn: Callable[..., T],
        *args: object,
        kill_on_cancel: bool,
        limiter: AbstractAsyncContextManager[object],
    ) -> T: ...


_POOL: trio.lowlevel.RunVar[RewardPool] = trio.lowlevel.RunVar("trio_rollouts.reward_pool")


class RewardPool:
    """The worker processes of one Trio run, opened by its first call and closed at its
    end (see the module docstring).

    Threads: the run's Trio thread only.
    """

    __slots__ = ("_context", "_opened", "limiter")

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        #: Bounds the calls in flight, hence the workers alive.
        self.limiter = limiter
        self._context: _WorkerContext | None = None
        self._opened = trio.Event()

    @classmethod
    def current(cls) -> RewardPool:
        """The current run's pool, opened on first use."""
        try:
            return _POOL.get()
        except LookupError:
            pool = cls(trio.CapacityLimiter(os.cpu_count() or 1))
            trio.lowlevel.spawn_system_task(pool._hold, name="trio_rollouts reward pool")
            _POOL.set(pool)
            return pool

    async def _hold(self) -> None:
        """Open the worker context and hold it until the run ends."""
        try:
            async with trio_parallel.open_worker_context() as context:
                self._context = context
                self._opened.set()
                await trio.sleep_forever()
        except trio_parallel.BrokenWorkerError:
            # The shutdown found a worker that had died or did not exit in its grace
            # period: it was killed and reaped, and raising from a system task would
            # crash the run.
            pass

    async def run(self, fn: Callable[[*Ts], T], args: tuple[*Ts], seconds: float) -> T:
        """``fn(*args)`` in a worker, within ``seconds`` of its own run (``timeout`` of
        :func:`run_reward`).

        Cancellation: as :func:`run_reward`.
        """
        await self._opened.wait()
        context = self._context
        if context is None:  # pragma: no cover - set before _opened
            msg = "the reward pool is not open"
            raise RuntimeError(msg)
        async with self.limiter:
            try:
                # Untimed: start a worker if none is idle, and import what unpickling fn
                # and its arguments needs. The timed call gets this worker back (LIFO,
                # and nothing runs in between).
                await context.run_sync(len, (fn, *args), kill_on_cancel=True, limiter=_TOKEN_HELD)
                return await _timed(context, fn, args, seconds)
            except trio_parallel.BrokenWorkerError as exc:
                exc.add_note(_BROKEN_WORKER)
                raise


_BROKEN_WORKER = (
    "A reward worker process died: fn crashed it (a segfault, out of memory, os._exit), "
    "or the worker could not import the main module (a script read from stdin) or it "
    "started work on import (guard the entry point with 'if __name__ == \"__main__\":'). "
    "The worker's stderr says which."
)


async def _timed(
    context: _WorkerContext, fn: Callable[[*Ts], T], args: tuple[*Ts], seconds: float
) -> T:
    """``fn(*args)`` on the worker ``context`` hands out next; past ``seconds`` of real
    time, the worker is killed and :class:`RewardTimeoutError` raised."""
    finished = threading.Event()
    with trio.CancelScope() as job:
        trio.lowlevel.start_thread_soon(
            functools.partial(
                _alarm, finished, seconds, trio.lowlevel.current_trio_token(), job.cancel
            ),
            _ignore,
            name="trio_rollouts reward alarm",
        )
        try:
            return await context.run_sync(fn, *args, kill_on_cancel=True, limiter=_TOKEN_HELD)
        finally:
            finished.set()
    # The job was cancelled, so its worker killed. An outer cancellation that came at the
    # same time wins.
    await trio.lowlevel.checkpoint_if_cancelled()
    msg = (
        f"the reward function {_name(fn)} ran past timeout={seconds} s in a worker "
        "process; the worker was killed (a fresh one replaces it)"
    )
    raise RewardTimeoutError(msg)


def _alarm(
    finished: threading.Event,
    seconds: float,
    token: trio.lowlevel.TrioToken,
    cancel: Callable[[], None],
) -> None:
    """In a thread: cancel the timed call unless it finishes within ``seconds`` of real
    time."""
    if not finished.wait(seconds):
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(cancel)


def _ignore(result: object) -> None:
    """Take the alarm thread's outcome: it returns None and catches what it can raise."""


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def current_reward_limiter() -> trio.CapacityLimiter:
    """The :class:`trio.CapacityLimiter` of the current run's reward pool: at most its
    ``total_tokens`` calls of :func:`run_reward` run at once, and at most that many
    worker processes are alive. ``os.cpu_count()`` by default; set ``total_tokens``
    before the run's first :func:`run_reward` (lowering it later leaves the extra idle
    workers alive until the run ends).

    Call it in a Trio run; each run has its own pool and limiter.
    """
    return RewardPool.current().limiter


# ASYNC109: this timeout is not a Trio deadline that a cancel scope around the call could
# replace: it is measured on the real clock and ends in killing a process.
async def run_reward(fn: Callable[[*Ts], T], *args: *Ts, timeout: float) -> T:  # noqa: ASYNC109
    """Run the synchronous ``fn(*args)`` in a worker process and return its result.

    For CPU-bound or untrusted reward code (``math_verify``, sympy, a code runner):
    the event loop keeps serving the pipeline meanwhile, and a reward that hangs, even
    inside C code, is stopped. ``fn`` and its arguments are pickled (``cloudpickle``:
    module-level functions by reference, those of ``__main__``, lambdas and closures by
    value); pass keyword arguments with :func:`functools.partial`. An exception ``fn``
    raises propagates as itself, with the worker's traceback. A script that calls it
    needs an ``if __name__ == "__main__":`` guard around its entry point: each worker
    imports the main module.

    ``timeout`` (seconds, a positive finite number, keyword-only) bounds ``fn``'s own
    run on the real clock: past it, the worker is killed and reaped, a fresh one
    replaces it for the next call, and :class:`~trio_rollouts.RewardTimeoutError` is
    raised (transient under the failure policy: the group is retried when
    ``FailurePolicy.max_attempts`` allows). Waiting for a worker (see
    :func:`current_reward_limiter`), starting one and the imports that unpickling
    ``fn`` and its arguments needs do not count.

    Inside an agent, call it from ``get_reward`` (or an environment's ``step`` or
    ``final_reward``)::

        import math_verify


        def score(answer: str, completion: str) -> float:  # runs in a worker
            gold = math_verify.parse(f"${answer}$")
            return float(math_verify.verify(gold, math_verify.parse(completion)))


        class MathAgent(tr.RewardOnlyAgent):
            async def get_reward(self, problem, response):
                return await tr.run_reward(
                    score, str(problem.answer), response.response.content, timeout=20.0
                )

    The workers belong to the current Trio run: opened by its first call, closed when
    it ends, never more alive than :func:`current_reward_limiter` allows.

    Cancellation: a checkpoint. If cancelled (its group's deadline, a consumer that
    stops, a sibling's failure), the worker is killed and reaped before
    ``trio.Cancelled`` propagates; the reward's work is lost. So a reward's deadline
    always lies inside its group's: the call runs inside the group's cancel scope.
    """
    if not callable(fn):
        msg = f"fn must be a callable to run in a worker process, got {fn!r:.80}"
        raise TypeError(msg)
    if inspect.iscoroutinefunction(fn):
        msg = (
            f"fn must be a synchronous function, got the async function {_name(fn)}; "
            "run_reward runs CPU-bound code in a worker process"
        )
        raise TypeError(msg)
    check_seconds("timeout", timeout, positive=True, optional=False, finite=True)
    return await RewardPool.current().run(fn, args, timeout)
