"""Weight updates of a running grouped pipeline: ``stream.weight_update(mode)``.

An update is an async context manager entered by the consumer (see
``docs/weight-updates.md``). Its life:

1. Checks, before anything pauses: the mode, the epoch (greater than the stream's), the
   backends (a Pausable backend that does not support the mode, or a backend that is not
   Pausable under ``keep``/``abort``, is a ``TypeError``), one update at a time.
2. The gate closes: no ``group_rollout`` call starts until the update is over (workers
   wait in ``UpdateGate.wait``, ``_gate.py``).
3. Calls in flight: with a staleness bound, those the new epoch makes too old are
   cancelled (``stale``); ``restart`` cancels all of them (``restarted``); ``keep`` and
   ``abort`` stop their deadlines' clocks. ``drain`` and ``restart`` wait until no call is
   in flight, ``keep``/``abort`` until the cancelled calls have exited.
4. Each Pausable backend gets ``pause(mode)``; the body starts when all have returned.
5. At exit, every paused backend gets ``resume(epoch)`` (shielded from cancellation):
   the new epoch when the body returned, the old one when it raised or was cancelled or
   a pause failed. The gate opens and the deadlines' clocks go on. Nothing is ever left
   paused, by any route.

Weights pushed around an update (``EmbeddedInference.set_generation_epoch``, a backend's
``resume`` called by hand) move the backend's epoch but not the stream's, so
``start_epoch`` and ``max_staleness`` do not see them: the pipeline warns once per stream
when it notices the request's backend ahead of the stream (:func:`warn_epoch_ahead`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from trio_rollouts._checks import is_int
from trio_rollouts.inference import InferenceInterface, OpenAIInference
from trio_rollouts.inference._pausable import (
    WEIGHT_UPDATE_MODES,
    Pausable,
    WeightUpdateError,
    WeightUpdateMode,
)
from trio_rollouts.pipeline._epochs import DropReason

if TYPE_CHECKING:
    from trio_rollouts.pipeline._run import Pipeline

__all__ = ["WeightUpdate", "open_weight_update", "warn_epoch_ahead"]


@attrs.define(kw_only=True, eq=False)
class WeightUpdate:
    """A weight update in progress, as ``stream.weight_update(...)`` yields it.

    - ``epoch``: the policy epoch generation resumes under when the body returns.
    - ``mode``: ``"drain"``, ``"restart"``, ``"keep"`` or ``"abort"``.
    - ``held``: calls held by ``keep``, aborted by ``abort``, or cancelled by ``restart``
      or by the staleness bound when the update began (0 for a plain drain).
    - ``pause_seconds``: from entering the block until the body started.
    """

    epoch: int
    mode: WeightUpdateMode
    held: int = 0
    pause_seconds: float = 0.0


def checked_mode(mode: object) -> WeightUpdateMode:
    if not isinstance(mode, str) or mode not in WEIGHT_UPDATE_MODES:
        allowed = ", ".join(repr(m) for m in ("drain", "restart", "keep", "abort"))
        msg = f"weight_update mode must be one of {allowed}, got {mode!r}"
        raise ValueError(msg)
    return mode


def checked_epoch(epoch: object, current: int) -> int:
    if epoch is None:
        return current + 1
    if not is_int(epoch):
        msg = f"weight_update epoch must be an int or None, got {epoch!r}"
        raise TypeError(msg)
    if epoch <= current:  # type: ignore[operator]
        msg = (
            f"weight_update epoch must be greater than the stream's policy_epoch "
            f"({current}), got {epoch!r}"
        )
        raise ValueError(msg)
    return epoch  # type: ignore[return-value]


def checked_backends(
    backends: Sequence[InferenceInterface] | None,
    default: InferenceInterface,
    mode: WeightUpdateMode,
) -> list[Pausable]:
    """The Pausable backends to pause, each once; ``TypeError`` for a backend that cannot
    pause for ``mode``."""
    if backends is None:
        given: list[object] = [default]
    elif isinstance(backends, (str, bytes)) or not isinstance(backends, Sequence):
        msg = f"backends must be a list of inference interfaces or None, got {backends!r:.80}"
        raise TypeError(msg)
    else:
        given = list(backends)
    pausable: list[Pausable] = []
    for i, backend in enumerate(given):
        if not isinstance(backend, InferenceInterface):
            msg = f"backends[{i}] must be an InferenceInterface, got {type(backend).__name__}"
            raise TypeError(msg)
        if not isinstance(backend, Pausable):
            if mode in ("keep", "abort"):
                msg = (
                    f"weight_update(mode={mode!r}) needs backends that can pause (inference."
                    f"Pausable); {type(backend).__name__} is not: use mode='drain' or "
                    "'restart', or a Pausable backend (EmbeddedInference, or "
                    "OpenAIInference(server='vllm' | 'sglang'))"
                )
                raise TypeError(msg)
            continue
        if mode not in backend.supported_modes:
            supported = ", ".join(repr(m) for m in sorted(backend.supported_modes))
            hint = (
                " (OpenAIInference supports keep and abort with server='vllm' or 'sglang')"
                if mode in ("keep", "abort") and isinstance(backend, OpenAIInference)
                else ""
            )
            msg = (
                f"{type(backend).__name__} cannot pause for weight_update(mode={mode!r}); "
                f"it supports {supported}{hint}"
            )
            raise TypeError(msg)
        if all(backend is not seen for seen in pausable):
            pausable.append(backend)
    return pausable


async def _resume_all(backends: Sequence[Pausable], epoch: int) -> list[BaseException]:
    """Resume every backend under ``epoch``, shielded; return the failures."""
    failures: list[BaseException] = []
    with trio.CancelScope(shield=True):
        for backend in backends:
            try:
                await backend.resume(epoch)
            except Exception as exc:
                exc.add_note(f"while resuming {type(backend).__name__} under epoch {epoch}")
                failures.append(exc)
    return failures


@contextlib.asynccontextmanager
async def open_weight_update(
    pipeline: Pipeline,
    mode: object,
    epoch: object,
    backends: Sequence[InferenceInterface] | None,
) -> AsyncIterator[WeightUpdate]:
    """What ``RolloutStream.weight_update`` returns; see the module docstring."""
    p = pipeline
    gate = p.gate
    if p.closed:
        msg = "weight_update() on a stream whose async with has exited"
        raise RuntimeError(msg)
    checked = checked_mode(mode)
    new_epoch = checked_epoch(epoch, gate.epoch)
    pausable = checked_backends(backends, p.request.inference_interface, checked)
    if gate.updating:
        msg = "a weight update is already in progress on this stream (one at a time)"
        raise RuntimeError(msg)
    old_epoch = gate.epoch
    update = WeightUpdate(epoch=new_epoch, mode=checked)
    entered = trio.current_time()
    gate.close()
    paused: list[Pausable] = []
    try:
        # Before the body: settle the calls in flight, then pause the backends.
        bound = gate.max_staleness
        if checked == "restart":
            update.held = p.drop_calls(DropReason.RESTART, None)
        elif bound is not None:
            update.held = p.drop_calls(DropReason.STALE, new_epoch - bound)
        if checked in ("keep", "abort"):
            update.held += p.calls_going_on()
            gate.freeze()
            while gate.dropping():
                await gate.wait_for_progress()
        else:
            while p.ledger.in_flight:
                await gate.wait_for_progress()
        for backend in pausable:
            paused.append(backend)
            try:
                await backend.pause(checked)
            except Exception as exc:
                msg = (
                    f"pausing {type(backend).__name__} for weight_update(mode={checked!r}, "
                    f"epoch={new_epoch}) failed: {type(exc).__name__}: {exc}; every backend "
                    f"paused so far was resumed under epoch {old_epoch}"
                )
                raise WeightUpdateError(msg) from exc
        update.pause_seconds = trio.current_time() - entered
        p.metrics.pause_seconds += update.pause_seconds
    except BaseException as exc:
        # A pause failed, or the update was cancelled before its body (or the pipeline
        # failed): resume what was paused (the failing backend included) under the old
        # epoch; a resume that fails too is a note on the error.
        for failure in await _resume_all(paused, old_epoch):
            exc.add_note(f"resuming failed too: {type(failure).__name__}: {failure}")
        gate.open()
        raise
    try:
        yield update
    except BaseException as exc:
        # The body raised or was cancelled: generation goes on under the old epoch.
        for failure in await _resume_all(paused, old_epoch):
            exc.add_note(f"resuming failed too: {type(failure).__name__}: {failure}")
        gate.open()
        raise
    stamped = checked not in ("keep", "abort") or all(b.stamps_policy_epoch for b in pausable)
    p.advance_epoch(new_epoch, stamped=stamped)
    failures = await _resume_all(paused, new_epoch)
    gate.open()
    if failures:
        error = WeightUpdateError(
            f"the weight update to epoch {new_epoch} finished, but resuming "
            f"{len(failures)} backend(s) failed: {type(failures[0]).__name__}: {failures[0]}"
        )
        for failure in failures[1:]:
            error.add_note(f"resuming failed too: {type(failure).__name__}: {failure}")
        raise error from failures[0]


def warn_epoch_ahead(backend: Pausable, stream_epoch: int) -> None:
    """Warn that ``backend``'s policy epoch is ahead of the stream's (``stream_epoch``):
    its weights were changed outside ``stream.weight_update``."""
    msg = (
        f"the inference backend ({type(backend).__name__}) is at policy epoch "
        f"{backend.policy_epoch}, but the stream is at epoch {stream_epoch}: its weights "
        "were changed outside stream.weight_update() (set_generation_epoch, or a resume of "
        "its own), so the stream's policy_epoch, each group's start_epoch and max_staleness "
        "do not see the change (no group is counted stale). Push weights inside "
        "'with stream.weight_update() as update:' (the sync bridge's stream has it too), "
        "which moves the stream's epoch and the backend's together"
    )
    warnings.warn(msg, UserWarning, stacklevel=4)
