"""The engine model: the embedded backend as a simulated cluster of inference engines.

:class:`EngineModel` describes one engine (a replica), in the terms vLLM is configured
and profiled in; ``EmbeddedInference(engine=EngineModel(...), replicas=R)`` runs ``R``
of them on Trio's clock. What each replica simulates, per step:

1. The requests *running* keep their place, oldest first: a decoding request needs one
   token, one still in prefill the rest of its context (chunked to the step's token
   budget, ``max_num_batched_tokens``). A request that needs a KV block when none is
   free preempts the newest running request (which loses its cache and waits at the
   head of the queue, to be computed again: preemption by recompute), or itself.
2. Then, unless a request was preempted, requests *waiting* are admitted in queue
   order (first come, first served; with ``scheduling_policy="priority"``, the default,
   calls of an older policy epoch first, as vLLM's ``--scheduling-policy priority``
   with the epoch as the priority), while fewer than ``max_num_seqs`` run, the budget
   lasts and their blocks fit. On admission the longest run of full blocks of its context already in
   the prefix cache is taken (never the whole context: its last token is computed).
3. The step takes ``base + per_prefill_token * prefilled + per_decode_seq * decoding``
   seconds (``trio.sleep``: instant under a ``MockClock``); then each request whose
   context is computed samples its next token, and a request that has all its tokens
   finishes and frees its blocks.

The prefix cache is vLLM's: a block of ``block_size`` ids is cached under a hash chained
over the blocks before it and the request's prefix-cache salt (``EmbeddedInference
(cache_salt=...)``, as vLLM's ``cache_salt``: by default the start epoch of the call's
group, so blocks of older weights are never served to a group started after an update),
as soon as it is scheduled, so a sibling admitted in the same step finds it; freed
blocks stay cached, and the least recently freed is evicted first. Each block remembers
the oldest epoch its KV was computed under: a hit on a block older than the epoch the
request belongs to (its call's start epoch; after an ``abort`` update, the epoch it
continues under) counts in ``stale_prefix_hits``, and each sampled token's
``kv_cache_epoch`` is the oldest epoch of the KV it attends to.

Determinism: the requests that arrive at one instant are admitted in the order of their
group, episode and choice (not the order Trio happened to run their tasks in), once
every other task is blocked (``trio.testing.wait_all_tasks_blocked``), so two seeded
runs place, batch and time alike. (A test that waits with ``wait_all_tasks_blocked`` to
see what the engine did waits twice: the first wakes it beside the engine.)
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Hashable, Iterator
from typing import Final, Literal

import attrs
import trio
import trio.testing

from trio_rollouts._checks import int_at_least, non_negative
from trio_rollouts.inference._placement import Placement

__all__ = ["EngineModel", "EngineStatistics"]


@attrs.frozen(kw_only=True)
class EngineModel:
    """One simulated inference engine (a replica), as vLLM is configured and profiled.

    - ``max_num_seqs``: requests running at once (vLLM's ``--max-num-seqs``).
    - ``max_num_batched_tokens``: tokens computed per step, prefill chunks and decodes
      together (``--max-num-batched-tokens``).
    - ``block_size``, ``num_blocks``: the KV cache, in blocks of ``block_size`` ids
      (``--block-size``; vLLM logs its block count at start-up). A request whose
      context cannot fit in the whole cache is refused with ``ValueError``.
    - ``base``, ``per_prefill_token``, ``per_decode_seq``: a step's time in seconds is
      ``base + per_prefill_token * prefilled + per_decode_seq * decoding`` (plus
      ``per_prefill_step`` when the step prefills anything; 0 by default).
    - ``prefix_caching``: vLLM's automatic prefix caching (on by default, as there).
    - ``scheduling_policy``: ``"priority"`` (the default) queues waiting requests by the
      policy epoch their call started under, older first (vLLM's ``--scheduling-policy
      priority`` with that epoch as each request's priority: the calls nearest the
      staleness bound go first), then in arrival order; ``"fcfs"`` by arrival only.
      The two differ only while calls of several epochs wait.

    The step costs default to the fit of the real vLLM 0.32 serving a tiny Llama on one
    core of this project's CPU machine (``tools/vllm/calibrate_engine.py``; the
    measurements are in ``docs/placement.md``): 1.545 ms a step, 25.6 µs per decoding
    request, 5.96 µs per prefilled id (that server also spends about 1.9 ms more on a
    step that prefills: ``per_prefill_step=0.0019`` reproduces it). The scheduler
    defaults are that server's (``max_num_seqs=128``, ``max_num_batched_tokens=2048``);
    the cache is vLLM's GPU block size (16) with the CPU server's 1 M ids of KV.
    :meth:`gpu` is a preset from a published GPU profile.
    """

    max_num_seqs: int = attrs.field(default=128, validator=int_at_least(1))
    max_num_batched_tokens: int = attrs.field(default=2048, validator=int_at_least(1))
    block_size: int = attrs.field(default=16, validator=int_at_least(1))
    num_blocks: int = attrs.field(default=65536, validator=int_at_least(1))
    base: float = attrs.field(default=0.001545, validator=non_negative)
    per_prefill_token: float = attrs.field(default=0.00000596, validator=non_negative)
    per_decode_seq: float = attrs.field(default=0.0000256, validator=non_negative)
    per_prefill_step: float = attrs.field(default=0.0, validator=non_negative)
    prefix_caching: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    scheduling_policy: Literal["priority", "fcfs"] = attrs.field(
        default="priority", validator=attrs.validators.in_(("priority", "fcfs"))
    )

    @classmethod
    def gpu(cls) -> EngineModel:
        """OPT-13B in fp16 on one A100-80GB under vLLM, from DistServe's published
        per-step profile (Zhong et al., OSDI 2024; ``docs/placement.md`` gives the
        derivation): 23.5 ms a step, 0.364 ms per decoding request (its per-context-id
        cost folded in at 512 ids), 0.145 ms per prefilled id; 256 requests, 8192 ids a
        step, 16-id blocks."""
        return cls(
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            block_size=16,
            num_blocks=16384,
            base=0.023475,
            per_prefill_token=0.00014464,
            per_decode_seq=0.0003643,
        )

    def step_seconds(self, prefilled: int, decoding: int) -> float:
        """The time of one step that prefills ``prefilled`` ids and decodes ``decoding``
        requests."""
        seconds = self.base + self.per_prefill_token * prefilled + self.per_decode_seq * decoding
        if prefilled:
            seconds += self.per_prefill_step
        return seconds


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """One replica's counters, over the interface's life (``running`` and ``waiting``:
    now, in the current Trio run), as vLLM's ``/metrics`` has them.

    - ``prompt_tokens``: prompt ids of admitted requests (counted at first admission);
    - ``prefix_cache_hits``: of those, served from the prefix cache;
    - ``stale_prefix_hits``: blocks served from the prefix cache that were computed under
      an epoch older than the one the request belongs to (its call's start epoch, or the
      epoch an ``abort`` continuation resumed under): 0 with ``cache_salt="epoch"``;
    - ``prefill_tokens``: ids computed in prefill, recomputation after a preemption or an
      ``abort`` weight update included (what the replica paid for prompts);
    - ``generation_tokens``: tokens sampled;
    - ``preemptions``: requests preempted (their cache dropped, computed again);
    - ``running``, ``waiting``: requests in the batch, and queued;
    - ``busy_seconds``: time spent in steps;
    - ``steps``: steps run.
    """

    replica: int
    prompt_tokens: int = 0
    prefix_cache_hits: int = 0
    stale_prefix_hits: int = 0
    prefill_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    running: int = 0
    waiting: int = 0
    busy_seconds: float = 0.0
    steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """``prefix_cache_hits / prompt_tokens`` (0.0 before any request)."""
        return self.prefix_cache_hits / self.prompt_tokens if self.prompt_tokens else 0.0


@attrs.define(eq=False)
class Counters:
    """A replica's counters, kept by the interface across runs."""

    prompt_tokens: int = 0
    prefix_cache_hits: int = 0
    stale_prefix_hits: int = 0
    prefill_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    busy_seconds: float = 0.0
    steps: int = 0


@attrs.define(eq=False)
class _Block:
    number: int
    hash: Hashable | None = None
    refs: int = 0
    #: The oldest epoch the KV of its ids was computed under (set when it is cached).
    epoch: int = 0


@attrs.define(eq=False)
class EngineRequest:
    """One request (one choice of a group call) inside the engine."""

    #: The prompt's ids followed by every id the request will generate.
    tokens: list[int]
    prompt_length: int
    #: How many ids it generates (0: it finishes after its prefill).
    target: int
    #: The admission order among the calls that arrive at one instant.
    order: tuple[object, ...]
    #: The policy epoch its call started under (the queue's priority, lower first).
    priority: int = 0
    #: Its prefix-cache salt: the root of its block hashes (requests share cached
    #: blocks only under equal salts).
    salt: Hashable = ("unsalted",)
    #: The salt of its continuation under a new epoch after an ``abort`` update (``None``:
    #: it keeps ``salt``).
    resalt: Callable[[int], Hashable] | None = None
    #: The epoch it belongs to: cached blocks computed before it are stale hits.
    kv_floor: int = 0
    #: ``(position, epoch)``: the epochs the KV it holds was computed under.
    kv_epochs: list[tuple[int, int]] = attrs.field(factory=list)
    policy_epoch: list[tuple[int, int]] = attrs.field(factory=list)
    kv_cache_epoch: list[tuple[int, int]] = attrs.field(factory=list)
    generated: int = 0
    computed: int = 0
    blocks: list[_Block] = attrs.field(factory=list)
    #: The block hashes of ``tokens``, chained from ``root`` (computed as needed).
    hashes: list[Hashable] = attrs.field(factory=list)
    root: Hashable | None = None
    admitted_once: bool = False
    recomputed: bool = False
    preemptions: int = 0
    replica: int = -1
    finished: bool = False
    gone: bool = False
    done: trio.Event = attrs.field(factory=trio.Event)
    error: BaseException | None = None

    @property
    def context_length(self) -> int:
        return self.prompt_length + self.generated


def stamp(epochs: list[tuple[int, int]], k: int, epoch: int) -> None:
    """Record in ``epochs`` (sparse ``(start, epoch)`` boundaries) that token ``k``
    onwards is generated under ``epoch``: an empty last segment is replaced, so starts
    strictly increase."""
    if not epochs:
        epochs.append((k, epoch))
        return
    start, current = epochs[-1]
    if epoch == current:
        return
    if start == k:
        epochs[-1] = (k, epoch)
    else:
        epochs.append((k, epoch))


def _oldest(epochs: list[tuple[int, int]], start: int, end: int) -> int:
    """The oldest epoch among ``epochs`` (``(position, epoch)`` boundaries) over the
    positions ``[start, end)``."""
    oldest: int | None = None
    for i, (position, epoch) in enumerate(epochs):
        following = epochs[i + 1][0] if i + 1 < len(epochs) else end
        if position < end and following > start and (oldest is None or epoch < oldest):
            oldest = epoch
    return 0 if oldest is None else oldest


@attrs.define(eq=False)
class Replica:
    """One simulated engine in one Trio run: its queue, its batch and its KV cache."""

    number: int
    model: EngineModel
    counters: Counters
    running: list[EngineRequest] = attrs.field(factory=list)
    waiting: collections.deque[EngineRequest] = attrs.field(factory=collections.deque)
    #: Free blocks that were used, least recently freed first.
    free: collections.OrderedDict[int, _Block] = attrs.field(factory=collections.OrderedDict)
    cached: dict[Hashable, _Block] = attrs.field(factory=dict)
    batch: list[tuple[EngineRequest, int]] = attrs.field(factory=list)
    step_end: float | None = None
    step_seconds: float = 0.0
    #: Blocks never used yet (made when first taken: they come before the free queue).
    fresh: int = attrs.field(
        default=attrs.Factory(lambda self: self.model.num_blocks, takes_self=True)
    )

    @property
    def free_blocks(self) -> int:
        return self.fresh + len(self.free)

    #: Calls outstanding (a group call of ``n`` choices is one): what placement weighs.
    calls: int = 0

    @property
    def load(self) -> int:
        return self.calls

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ----------------------------------------------------------------- the cache

    def _hashes(self, seq: EngineRequest, blocks: int) -> list[Hashable]:
        """The chained hashes of the first ``blocks`` full blocks of ``seq.tokens``,
        from its salt."""
        root = seq.salt
        if seq.root != root:
            seq.root = root
            seq.hashes = []
        hashes = seq.hashes
        size = self.model.block_size
        tokens = seq.tokens
        previous: Hashable = hashes[-1] if hashes else ("root", root)
        for j in range(len(hashes), blocks):
            previous = hash((previous, tuple(tokens[j * size : (j + 1) * size])))
            hashes.append(previous)
        return hashes

    def _lookup(self, seq: EngineRequest) -> list[_Block]:
        if not self.model.prefix_caching:
            return []
        # Never the whole context: its last token is computed, to sample from.
        most = (seq.context_length - 1) // self.model.block_size
        found: list[_Block] = []
        for h in self._hashes(seq, most)[:most]:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def _register(self, seq: EngineRequest, upto: int) -> None:
        """Cache the full blocks of ``seq`` among its first ``upto`` ids, each with the
        oldest epoch its ids' KV was computed under."""
        if not self.model.prefix_caching:
            return
        size = self.model.block_size
        full = upto // size
        hashes = self._hashes(seq, full)
        for j in range(full):
            block = seq.blocks[j]
            if block.hash is None and hashes[j] not in self.cached:
                block.hash = hashes[j]
                block.epoch = _oldest(seq.kv_epochs, j * size, (j + 1) * size)
                self.cached[hashes[j]] = block

    @staticmethod
    def _computing(seq: EngineRequest, epoch: int) -> None:
        """``seq``'s ids from ``seq.computed`` on are computed under ``epoch``."""
        epochs = seq.kv_epochs
        if not epochs or epochs[-1][1] != epoch:
            epochs.append((seq.computed, epoch))

    def _allocate(self, seq: EngineRequest, upto: int) -> bool:
        """Give ``seq`` the blocks for its first ``upto`` ids; ``False`` if too few
        are free (nothing taken then)."""
        needed = -(-upto // self.model.block_size) - len(seq.blocks)
        if needed <= 0:
            return True
        if needed > self.free_blocks:
            return False
        for _ in range(needed):
            if self.fresh:
                self.fresh -= 1
                block = _Block(self.model.num_blocks - self.fresh - 1, refs=1)
                seq.blocks.append(block)
                continue
            _, block = self.free.popitem(last=False)
            if block.hash is not None:
                del self.cached[block.hash]
                block.hash = None
            block.refs = 1
            seq.blocks.append(block)
        return True

    def _release(self, seq: EngineRequest) -> None:
        # The last blocks first into the free queue: evicted before the shared prefix.
        for block in reversed(seq.blocks):
            block.refs -= 1
            if block.refs == 0:
                self.free[block.number] = block
        seq.blocks = []
        seq.computed = 0
        seq.kv_epochs = []

    def _take(self, seq: EngineRequest, hits: list[_Block]) -> None:
        size = self.model.block_size
        epochs: list[tuple[int, int]] = []
        stale = 0
        for j, block in enumerate(hits):
            if block.refs == 0:
                del self.free[block.number]
            block.refs += 1
            if not epochs or epochs[-1][1] != block.epoch:
                epochs.append((j * size, block.epoch))
            if block.epoch < seq.kv_floor:
                stale += 1
        self.counters.stale_prefix_hits += stale
        seq.blocks = list(hits)
        seq.computed = len(hits) * size
        seq.kv_epochs = epochs

    # ----------------------------------------------------------------- requests

    def remove(self, seq: EngineRequest) -> None:
        """Take ``seq`` out (cancelled): its blocks are freed at once."""
        seq.gone = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def preempt_all(self, epoch: int) -> None:
        """An ``abort`` update to ``epoch``: every running request loses its cache and
        waits at the head of the queue (in its order), to be computed again under the new
        weights, salted as a continuation under ``epoch`` (as the HTTP client salts an
        ``abort`` continuation)."""
        for seq in reversed(self.running):
            self._release(seq)
            seq.recomputed = True
            if seq.resalt is not None:
                seq.salt = seq.resalt(epoch)
            seq.kv_floor = epoch
            self.queue(seq, first=True)
        self.running.clear()

    def _preempt(self, seq: EngineRequest) -> None:
        self._release(seq)
        seq.recomputed = True
        seq.preemptions += 1
        self.counters.preemptions += 1
        self.queue(seq, first=True)

    def queue(self, seq: EngineRequest, *, first: bool = False) -> None:
        """Put ``seq`` in the waiting queue: last (``first``: at the head, a preempted
        request) among the requests of its priority when the policy orders by priority,
        else last (or first)."""
        waiting = self.waiting
        if self.model.scheduling_policy == "fcfs":
            if first:
                waiting.appendleft(seq)
            else:
                waiting.append(seq)
            return
        priority = seq.priority
        if first:
            i = 0
            while i < len(waiting) and waiting[i].priority < priority:
                i += 1
        else:
            i = len(waiting)
            while i > 0 and waiting[i - 1].priority > priority:
                i -= 1
        waiting.insert(i, seq)

    # ----------------------------------------------------------------- steps

    def start_step(self, now: float, epoch: int) -> bool:
        """Schedule a step (see the module docstring); ``False`` if nothing can run."""
        model = self.model
        budget = model.max_num_batched_tokens
        batch: list[tuple[EngineRequest, int]] = []
        preempted = False
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.context_length - seq.computed, budget)
            while not self._allocate(seq, seq.computed + n):
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._computing(seq, epoch)
                self._register(seq, seq.computed + n)
                batch.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            waiting = self.waiting
            while waiting and len(running) < model.max_num_seqs and budget > 0:
                seq = waiting[0]
                hits = self._lookup(seq)
                computed = len(hits) * model.block_size
                n = min(seq.context_length - computed, budget)
                needed = -(-(computed + n) // model.block_size) - len(hits)
                free_hits = sum(1 for block in hits if block.refs == 0)
                if needed > self.free_blocks - free_hits:
                    break
                waiting.popleft()
                self._take(seq, hits)
                self._allocate(seq, computed + n)
                if not seq.admitted_once:
                    seq.admitted_once = True
                    self.counters.prompt_tokens += seq.prompt_length
                    self.counters.prefix_cache_hits += min(computed, seq.prompt_length)
                # Cached as soon as scheduled: a sibling admitted next finds it.
                self._computing(seq, epoch)
                self._register(seq, computed + n)
                running.append(seq)
                batch.append((seq, n))
                budget -= n
        if not batch:
            return False
        prefilled = 0
        decoding = 0
        for seq, n in batch:
            if n == 1 and seq.generated > 0 and not seq.recomputed:
                decoding += 1
            else:
                prefilled += n
        self.counters.prefill_tokens += prefilled
        self.batch = batch
        self.step_seconds = model.step_seconds(prefilled, decoding)
        self.step_end = now + self.step_seconds
        return True

    def finish_step(self, epoch: int) -> None:
        """The step's results: tokens sampled, requests finished."""
        self.counters.busy_seconds += self.step_seconds
        self.counters.steps += 1
        self.step_end = None
        batch, self.batch = self.batch, []
        for seq, n in batch:
            if seq.gone or seq not in self.running:
                continue
            seq.computed += n
            if seq.computed < seq.context_length:
                continue  # a prefill chunk
            if seq.generated < seq.target:
                k = seq.generated
                stamp(seq.policy_epoch, k, epoch)
                # The token attends to all the KV the request holds: the oldest counts.
                stamp(seq.kv_cache_epoch, k, min(e for _, e in seq.kv_epochs))
                seq.recomputed = False
                seq.generated += 1
                self.counters.generation_tokens += 1
            if seq.generated >= seq.target:
                seq.finished = True
                self.running.remove(seq)
                self._release(seq)
                seq.done.set()


@attrs.define(eq=False)
class Call:
    """The sequences of one call (one, or a group's choices), placed together."""

    sequences: list[EngineRequest]
    group: tuple[int, int, int] | None
    episode: int | None
    ended: bool = False


_UNKEYED: Final = (1,)


def admission_order(
    group: tuple[int, int, int] | None, episode: int | None, arrival: int
) -> tuple[object, ...]:
    """The order among calls arriving at one instant: by group and episode, then (for
    calls of no group, or of one episode) by arrival."""
    if group is None:
        return (_UNKEYED, arrival)
    return ((0, *group), -1 if episode is None else episode, arrival)


@attrs.define(eq=False)
class Cluster:
    """The replicas of one interface in one Trio run, and the system task that runs
    them (:meth:`run`)."""

    model: EngineModel
    placement: Placement
    replicas: list[Replica]
    arrivals: list[Call] = attrs.field(factory=list)
    wake: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)
    arrived: int = 0
    failure: BaseException | None = None

    def submit(self, call: Call) -> None:
        if self.failure is not None:
            raise RuntimeError("the simulated engine failed") from self.failure
        self.arrivals.append(call)
        self.wake.unpark_all()

    def end(self, call: Call) -> None:
        """The call returns or is cancelled: its requests that have not finished leave
        the queue or the batch (their blocks freed), and its placement is released."""
        if call in self.arrivals:
            self.arrivals.remove(call)
        for seq in call.sequences:
            if seq.replica >= 0 and not seq.finished:
                self.replicas[seq.replica].remove(seq)
            seq.gone = True
        index = call.sequences[0].replica
        if index >= 0 and not call.ended:
            call.ended = True
            self.replicas[index].calls -= 1
            self.placement.release(call.group, index)

    def sequences(self) -> Iterator[EngineRequest]:
        for replica in self.replicas:
            yield from replica.running
            yield from replica.waiting

    def dispatch(self) -> None:
        """Place the calls that arrived, in admission order."""
        calls = sorted(self.arrivals, key=lambda call: call.sequences[0].order)
        self.arrivals.clear()
        replicas = self.replicas
        for call in calls:
            load = [replica.load for replica in replicas]
            index = self.placement.pick(load, call.group, call.episode)
            replica = replicas[index]
            replica.calls += 1
            for seq in call.sequences:
                seq.replica = index
                replica.queue(seq)

    def steps_in_progress(self) -> int:
        return sum(1 for replica in self.replicas if replica.step_end is not None)

    def next_step_end(self) -> float:
        return min(
            (replica.step_end for replica in self.replicas if replica.step_end is not None),
            default=math.inf,
        )

    def fail(self, error: BaseException) -> None:
        self.failure = error
        for call in self.arrivals:
            for seq in call.sequences:
                seq.error = error
                seq.done.set()
        for seq in self.sequences():
            seq.error = error
            seq.done.set()


async def settle() -> None:
    """Wait until every other task of the run is blocked: the calls that arrive at this
    instant have all arrived (however many schedule points their tasks go through), and
    are placed in admission order whatever order Trio ran them in. A test that waits
    with ``trio.testing.wait_all_tasks_blocked`` too is woken beside the engine: it
    waits twice to see what the engine did."""
    await trio.testing.wait_all_tasks_blocked()
