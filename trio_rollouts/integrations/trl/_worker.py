"""``AsyncGRPOTrainer(rollout_worker=...)``: a streaming pipeline as TRL's rollout worker.

TRL's ``RolloutWorkerProtocol`` is a queue the trainer drains (``rollout_buffer``), a
metrics queue, ``start``/``stop``, ``update_model_version`` (after each weight sync) and
``check_health``. :class:`RolloutWorker` runs the agent's streaming pipeline in the sync
bridge's Trio thread and makes its ``rollout_buffer`` take groups from the stream *when
the trainer asks* (:class:`RolloutBuffer`), so the stream's staleness bound is checked at
the moment TRL checks its own, against the same version: ``update_model_version`` is the
library's weight update, and TRL's model version is the stream's policy epoch.
:class:`WeightTransfer` (``weight_transfer=worker.weight_transfer``) puts TRL's
pause/send/resume inside that weight update.
"""

from __future__ import annotations

import collections
import contextlib
import queue
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

from trio_rollouts import (
    GroupedRolloutGenerator,
    GroupedRolloutRequest,
    PromptSource,
    RolloutGroup,
    TrainingBatch,
    blocking_grouped_rollouts,
)
from trio_rollouts.bridge import BlockingRolloutStream
from trio_rollouts.inference import WEIGHT_UPDATE_MODES, WeightUpdateMode
from trio_rollouts.integrations.trl._common import trainer_generation_args

try:
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
except ImportError as error:  # pragma: no cover - depends on the environment
    msg = (
        "trio_rollouts.integrations.trl needs TRL: install the extra, "
        f"pip install 'trio-rollouts[trl]' ({error})"
    )
    raise ImportError(msg) from error

__all__ = ["PushWeights", "RolloutBuffer", "RolloutWorker", "WeightTransfer"]

#: ``push_weights(named_tensors, epoch)``: send the trainer's ``(name, tensor)`` pairs to
#: the inference backends; the calls that start afterwards run under ``epoch``.
PushWeights = Callable[[Iterator[tuple[str, Any]], int], None]


class RolloutBuffer:
    """The worker's ``rollout_buffer``: what TRL's trainer drains, as a queue
    (``get(timeout=...)``, ``get_nowait()``, ``qsize()``, ``empty()``). A ``get``
    takes the next group from the stream when the samples of the last are handed out,
    so each sample is checked against the staleness bound when the trainer takes it; it
    raises ``queue.Empty`` when ``timeout`` passes first (nothing is lost), and the
    pipeline's errors as themselves."""

    def __init__(self, worker: RolloutWorker) -> None:
        self._worker = worker

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        return self._worker.next_sample(timeout if block else 0.0)

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        return self._worker.ready_samples()

    def empty(self) -> bool:
        return self.qsize() == 0


class WeightTransfer:
    """TRL's ``WeightTransferProtocol`` around the worker's weight update: ``pause()``
    enters the stream's ``weight_update(mode)`` (generation paused as the mode says),
    ``send_weights(named_tensors)`` calls the worker's ``push_weights`` with the new
    epoch (or only consumes the tensors), ``resume()`` leaves it: the backends resume
    under the new epoch. A push that raises resumes them under the old one."""

    def __init__(self, worker: RolloutWorker) -> None:
        self._worker = worker

    def init_weight_transfer(self) -> None:
        """Nothing to set up (the stream opens in ``start``)."""

    def pause(self) -> None:
        self._worker.begin_update()

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        self._worker.push(iterator)

    def resume(self) -> None:
        self._worker.end_update(None)

    def destroy(self) -> None:
        """Nothing to release (the stream closes in ``stop``)."""


def _for_config(request: GroupedRolloutRequest, config: Any) -> GroupedRolloutRequest:
    """``request`` under an ``AsyncGRPOConfig``: its sampling defaults, and a staleness
    bound that TRL's own never exceeds (see :class:`RolloutWorker`)."""
    args = trainer_generation_args(config, request.generation_args, "RolloutWorker")
    bound = getattr(config, "max_staleness", None)
    budget = getattr(config, "token_budget", 0)
    if budget is None:
        msg = (
            "AsyncGRPOConfig.token_budget=None makes AsyncGRPOTrainer ask the vLLM server at "
            "vllm_server_base_url for its max_model_len; with RolloutWorker set it: 0 for "
            "micro-batches of per_device_train_batch_size samples, or a number of tokens"
        )
        raise ValueError(msg)
    if not isinstance(bound, int):
        return attrs.evolve(request, generation_args=args)
    rows = getattr(config, "per_device_train_batch_size", 0) * getattr(config, "world_size", 1)
    whole = budget <= 0 and rows % request.rollouts_per_group == 0
    safe = bound if whole else bound - 1
    why = (
        f"a micro-batch ({rows} samples) holds whole groups of {request.rollouts_per_group}"
        if whole
        else "a group's samples may be split by a weight update (per_device_train_batch_size "
        "x processes not a multiple of rollouts_per_group, or token_budget > 0), which ages "
        "the rest by one"
    )
    if safe < 0:
        msg = (
            f"AsyncGRPOConfig.max_staleness={bound} drops every sample older than the "
            f"trainer, and {why}: the rest of such a group would be dropped. Make each "
            "micro-batch whole groups (token_budget=0, per_device_train_batch_size x "
            "processes a multiple of rollouts_per_group), or raise max_staleness"
        )
        raise ValueError(msg)
    staleness = safe if request.max_staleness is None else request.max_staleness
    if staleness > safe:
        msg = (
            f"request.max_staleness={staleness} with AsyncGRPOConfig.max_staleness={bound}: "
            f"{why}, so the bound must be at most {safe} for TRL to drop no sample; set "
            f"request.max_staleness <= {safe} (or leave it None)"
        )
        raise ValueError(msg)
    return attrs.evolve(request, generation_args=args, max_staleness=staleness)


def _messages(prompt: object) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return [{"role": m.role, "content": m.content} for m in prompt]
    return []


class RolloutWorker:
    """A rollout worker for TRL's ``AsyncGRPOTrainer`` (its ``RolloutWorkerProtocol``)
    fed by ``agent``'s streaming pipeline for ``request``::

        worker = RolloutWorker(agent, request, config, push_weights=push)
        trainer = AsyncGRPOTrainer(model=path, args=config, train_dataset=dataset,
                                   rollout_worker=worker,
                                   weight_transfer=worker.weight_transfer)

    - **Prompts** are the agent's (``prompts=PromptSource(problems_from(dataset))``): the
      pipeline chooses them, exactly once per epoch, so TRL's ``train_dataset`` only
      sizes its epochs.
    - ``start()`` opens the stream (``streaming=True``, ``initial_epoch`` TRL's model
      version) in the sync bridge's Trio thread; ``stop()`` closes it (every call ended,
      the thread joined).
    - ``rollout_buffer.get()`` hands out the samples of one group after another: each
      trajectory element of each rollout is a ``RolloutSample`` whose ``input_ids``,
      ``completion_mask`` and ``old_log_probs`` are the row
      :class:`~trio_rollouts.TrainingBatch` makes of it (ids, True exactly on sampled
      ids, the sampled logprobs), ``advantage`` the group's GRPO advantage
      (``group.advantages()``), ``model_version`` the group's ``start_epoch``, and
      ``group_id`` a running count of groups. A rollout without logprobs is a
      ``TypeError``. ``on_group(group)`` (optional) is called with each group taken.
    - ``update_model_version(v)`` is the library's weight update to epoch ``v``
      (``mode``; the stream's staleness bound cancels calls that ``v`` makes too old).
      With ``weight_transfer=worker.weight_transfer`` the update spans TRL's
      ``pause``/``send_weights``/``resume`` and calls ``push_weights(named_tensors,
      epoch)`` between them, so calls in flight are settled before the weights move;
      with another weight transfer, TRL pushes the weights itself and the update only
      moves the epoch afterwards.
    - ``check_health`` raises the pipeline's failure, as itself; ``metrics_queue`` gets
      ``stream.metrics()`` at each model version.

    With ``config`` (the trainer's ``AsyncGRPOConfig``), the request's unset sampling
    fields take the config's (``max_completion_length``, ``temperature``, ``top_p``,
    ``top_k``; another temperature is a ``ValueError``) and its ``max_staleness``
    defaults to the largest bound at which TRL drops no sample: the config's when each
    micro-batch holds whole groups, one less otherwise (a weight update between two
    samples of a group ages the rest). ``token_budget=None`` is a ``ValueError`` (TRL
    would ask a vLLM server for it). Without ``config`` the request is used as it is: set
    its ``max_staleness`` to at most the trainer's yourself. ``request.initial_epoch``
    must be ``None``: TRL numbers the versions.
    """

    def __init__(
        self,
        agent: GroupedRolloutGenerator,
        request: GroupedRolloutRequest,
        config: Any = None,
        *,
        mode: WeightUpdateMode = "drain",
        push_weights: PushWeights | None = None,
        on_group: Callable[[RolloutGroup], None] | None = None,
    ) -> None:
        if not isinstance(agent, GroupedRolloutGenerator):
            msg = f"agent must be a GroupedRolloutGenerator, got {type(agent).__name__}"
            raise TypeError(msg)
        if not isinstance(request, GroupedRolloutRequest):
            msg = f"request must be a GroupedRolloutRequest, got {type(request).__name__}"
            raise TypeError(msg)
        if request.initial_epoch is not None:
            msg = (
                f"request.initial_epoch={request.initial_epoch}: the trainer numbers the policy "
                "versions (its model_version is the stream's epoch); leave it None"
            )
            raise ValueError(msg)
        if mode not in WEIGHT_UPDATE_MODES:
            msg = f"mode must be one of {list(WEIGHT_UPDATE_MODES)}, got {mode!r}"
            raise ValueError(msg)
        for name, value in (("push_weights", push_weights), ("on_group", on_group)):
            if value is not None and not callable(value):
                msg = f"{name} must be a callable or None, got {type(value).__name__}"
                raise TypeError(msg)
        self.agent = agent
        self.request = request if config is None else _for_config(request, config)
        self.mode: WeightUpdateMode = mode
        self.push_weights = push_weights
        self.on_group = on_group
        self.rollout_buffer = RolloutBuffer(self)
        self.metrics_queue: queue.Queue[dict[str, float]] = queue.Queue()
        self.weight_transfer = WeightTransfer(self)
        #: Groups taken from the stream, and samples handed to the trainer, so far.
        self.groups_taken = 0
        self.samples_handed = 0
        self._version = 0
        self._context: contextlib.AbstractContextManager[BlockingRolloutStream] | None = None
        self._stream: BlockingRolloutStream | None = None
        self._held: collections.deque[Any] = collections.deque()
        self._update: contextlib.AbstractContextManager[Any] | None = None
        self._pending_epoch: int | None = None
        prompts = agent.prompts
        problems = prompts.problems if isinstance(prompts, PromptSource) else ()
        self._prompts = {problem.problem_id: problem.prompt for problem in problems}

    # ---------------------------------------------------------------- the protocol

    def start(self) -> None:
        """Open the stream (a second call while it is open does nothing)."""
        if self._stream is not None:
            return
        request = attrs.evolve(self.request, streaming=True, initial_epoch=self._version)
        context = blocking_grouped_rollouts(self.agent, request)
        self._stream = context.__enter__()
        self._context = context

    def stop(self) -> None:
        """Close the stream: cancel the calls in flight and join the Trio thread. Samples
        not handed out are dropped (their prompts are drawn again by a later stream)."""
        context, self._context, self._stream = self._context, None, None
        self._held.clear()
        self._update = None
        if context is not None:
            context.__exit__(None, None, None)

    @property
    def policy_epoch(self) -> int:
        """TRL's model version as the worker knows it (the stream's epoch once open)."""
        return self._version if self._stream is None else self._stream.policy_epoch

    def update_model_version(self, model_version: int) -> None:
        """The weight update to ``model_version`` (see the class docstring). A version
        below the current one is a ``ValueError``."""
        if isinstance(model_version, bool) or not isinstance(model_version, int):
            msg = f"model_version must be an int, got {model_version!r}"
            raise TypeError(msg)
        if model_version < self.policy_epoch:
            msg = (
                f"model_version={model_version} is below the current one ({self.policy_epoch}): "
                "versions only grow"
            )
            raise ValueError(msg)
        stream = self._stream
        if stream is not None and model_version > stream.policy_epoch:
            with stream.weight_update(self.mode, epoch=model_version):
                pass
        self._version = model_version
        if stream is not None:
            self.metrics_queue.put_nowait(stream.metrics())

    def check_health(self, stale_after_s: float) -> None:
        """Raise the pipeline's failure, as itself, if it has failed."""
        if self._stream is not None:
            self._stream.statistics()

    # ---------------------------------------------------------------- the buffer

    def next_sample(self, timeout: float | None) -> Any:
        """The next ``RolloutSample``, taking a group when none is held; ``queue.Empty``
        when ``timeout`` seconds pass first."""
        stream = self._stream
        if stream is None:
            msg = "the rollout worker is not running: the trainer calls start() first"
            raise RuntimeError(msg)
        if not self._held:
            try:
                group = stream.get(timeout=timeout)
            except TimeoutError:
                raise queue.Empty from None
            self._held.extend(self.samples(group))
            self.groups_taken += 1
            if self.on_group is not None:
                self.on_group(group)
        self.samples_handed += 1
        return self._held.popleft()

    def ready_samples(self) -> int:
        """Samples held plus those of the groups ready in the stream."""
        held = len(self._held)
        if self._stream is None:
            return held
        return held + self.request.rollouts_per_group * self._stream.statistics().buffered

    def samples(self, group: RolloutGroup) -> list[Any]:
        """``group`` as TRL ``RolloutSample`` objects, one per trajectory element."""
        batch = TrainingBatch.from_groups([group])
        if not batch.has_logprobs.all():
            msg = (
                f"a rollout of problem {group[0].problem_id!r} has no logprobs: "
                "AsyncGRPOTrainer's loss needs the sampled logprob of every generated id "
                "(a backend that returns them, ReturnsLogProbs)"
            )
            raise TypeError(msg)
        advantages = group.advantages()
        rewards = group.rewards()
        std = group.reward_std()
        group_id = self.groups_taken
        out = []
        for row, (_, member, _) in enumerate(batch.rows.tolist()):
            n = int(batch.attention_mask[row].sum())
            rollout = group[member]
            completion = rollout.extra.get("completion")
            out.append(
                RolloutSample(
                    prompt=_messages(self._prompts.get(rollout.problem_id or "")),
                    completion=[
                        {
                            "role": "assistant",
                            "content": completion if isinstance(completion, str) else "",
                        }
                    ],
                    input_ids=batch.input_ids[row, :n].copy(),
                    completion_mask=batch.loss_mask[row, :n].astype(np.int64),
                    old_log_probs=batch.logprobs[row, :n].copy(),
                    advantage=float(advantages[member]),
                    model_version=group.start_epoch,
                    group_id=group_id,
                    metrics={"reward": float(rewards[member]), "reward_std": std},
                )
            )
        return out

    # ---------------------------------------------------------------- weight transfer

    def begin_update(self) -> None:
        """``WeightTransfer.pause``: enter the weight update to the next epoch."""
        if self._update is not None:
            msg = "pause() was called twice without resume(): one weight update at a time"
            raise RuntimeError(msg)
        self._pending_epoch = self.policy_epoch + 1
        if self._stream is not None:
            update = self._stream.weight_update(self.mode, epoch=self._pending_epoch)
            update.__enter__()
            self._update = update

    def push(self, iterator: Iterator[tuple[str, Any]]) -> None:
        """``WeightTransfer.send_weights``: ``push_weights`` (or consume the tensors:
        sharded parameters are gathered as they are iterated, on every rank)."""
        epoch = self._pending_epoch if self._pending_epoch is not None else self.policy_epoch + 1
        try:
            if self.push_weights is not None:
                self.push_weights(iterator, epoch)
            else:
                for _ in iterator:
                    pass
        except BaseException as exc:
            self.end_update(exc)
            raise

    def end_update(self, exc: BaseException | None) -> None:
        """``WeightTransfer.resume``: leave the update (under the old epoch if ``exc``)."""
        update, self._update, self._pending_epoch = self._update, None, None
        if update is not None:
            if exc is None:
                update.__exit__(None, None, None)
            else:
                update.__exit__(type(exc), exc, exc.__traceback__)
